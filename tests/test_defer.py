"""A learned policy that hands some batch sizes back to the tuned rule (LearnedK.defer, agents.defer): the table
is chosen on the replay, written into policy.json, and the loaded policy decides exactly as the MLP below it and
exactly as the rule from it up."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import COMMITTED_CPU_KEY, stretch_traces

from specpilot.agents.defer import defer_table, rule_spec, write_defer
from specpilot.agents.export import write_policy
from specpilot.agents.improve import as_policy
from specpilot.bench.batch_table import BatchTableK
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.loop import StepResult
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import PerBatchK, StaticK, TrtllmK
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel, Trace
from specpilot.env.replay_env import replay_evaluate

K = 4
MATCH = FEATURES.index("ngram_match_len")


def traces(n: int = 8, length: int = 36) -> list[Trace]:
    return stretch_traces(K, n, length)


def cost() -> CostModel:
    """One row: a plain step 0.1 s, a verify of k >= 1 0.18 s (speculation pays on the good stretches). Two rows:
    a plain step 0.12 s, a verify of k >= 1 1.0 s (it never pays)."""
    one = [0.1] + [0.18] * K
    return CostModel([0, 10000], [one, one], [0.0, 0.0], batch_sizes=[1, 2],
                     batch_verify_s=[one, [0.12] + [1.0] * K], batch_draft_s=[0.0, 0.0])


def match_mlp(meta: dict | None = None) -> LearnedK:
    """A one-layer 'MLP' that drafts K where the match is >= 3 tokens, else nothing."""
    n = len(FEATURES)
    w = np.zeros((K + 1, n), dtype=np.float32)
    b = np.full(K + 1, -100.0, dtype=np.float32)
    w[K, MATCH], b[K], b[0] = 10.0, -20.0, 0.0
    norm = {"mean": [0.0] * n, "var": [1.0] * n, "epsilon": 1e-8, "clip": 100.0}
    return as_policy([(w, b)], norm, "tanh", K, meta)


def obs(batch: int, match: float) -> np.ndarray:
    o = np.zeros(len(FEATURES), dtype=np.float32)
    o[FEATURES.index("batch_size_log")] = math.log(batch)
    o[MATCH] = match
    return o


def test_the_table_keeps_the_mlp_where_it_wins_and_the_rule_where_it_does_not():
    data, c = traces(), cost()
    rule = PerBatchK({1: StaticK(1), 2: StaticK(0)}, "best-rule")
    table, ratios = defer_table(match_mlp(), rule, data, c, K, None, [1, 2], 36, margin=0.0)
    direct = {b: replay_evaluate({"mlp": match_mlp(), "rule": rule}, data, c, K, None, b, 36) for b in (1, 2)}
    for b in (1, 2):
        assert ratios[b] == pytest.approx(direct[b]["mlp"]["speedup"] / direct[b]["rule"]["speedup"])
    assert ratios[1] > 1.1 and ratios[2] < 0.9
    assert table == {"1": None, "2": "static:0"}
    # a margin larger than the MLP's lead hands that batch size to the rule too
    wide, _ = defer_table(match_mlp(), rule, data, c, K, None, [1, 2], 36, margin=ratios[1] - 1.0 + 0.01)
    assert wide == {"1": "static:1", "2": "static:0"}
    with pytest.raises(SpecPilotError, match="margin"):
        defer_table(match_mlp(), rule, data, c, K, None, [1], 36, margin=-0.1)


def test_a_written_table_makes_the_loaded_policy_the_mlp_below_and_the_rule_above(tmp_path):
    data, c = traces(), cost()
    mlp = match_mlp({"draft": "ngram:3"})
    path = write_policy(tmp_path / "p", [(wt.T, b) for wt, b in mlp.layers], mlp.meta["normalization"],
                        "tanh", K, "cpu", "test", 0, {"draft": "ngram:3"})
    rule = PerBatchK({1: StaticK(1), 2: StaticK(0)}, "best-rule")
    table, ratios = defer_table(mlp, rule, data, c, K, None, [1, 2], 36, margin=0.0)
    write_defer(path, table, ratios, 0.0)
    meta = json.loads(path.read_text())
    assert meta["defer"] == table and meta["defer_evidence"]["split"] == "train"
    gated = parse_policy(f"learned:{path}", device="cpu")
    alone = parse_policy(f"learned-mlp:{path}", device="cpu")
    assert gated.name == "learned" and alone.name == "learned-mlp" and not alone.defer
    for match in (1.0, 3.0):
        assert gated.choose_k(obs(1, match)) == alone.choose_k(obs(1, match)) == (K if match >= 3 else 0)
        assert gated.choose_k(obs(2, match)) == 0 and alone.choose_k(obs(2, match)) == (K if match >= 3 else 0)
        assert gated.choose_k(obs(16, match)) == 0  # above the largest listed size: its entry
    assert gated.deferred == 4 and gated.calls == 2
    got = {b: replay_evaluate({"gated": gated, "mlp": alone, "rule": rule}, data, c, K, None, b, 36) for b in (1, 2)}
    assert got[1]["gated"]["speedup"] == got[1]["mlp"]["speedup"]
    assert got[2]["gated"]["speedup"] == got[2]["rule"]["speedup"] > got[2]["mlp"]["speedup"]


def test_deferred_rules_see_every_update_and_reset():
    """A rule with state (TensorRT-LLM's acceptance cut-off) behaves the same inside the policy as alone."""
    mlp = match_mlp()
    gated = LearnedK({**mlp.meta, "defer": {"1": None, "8": "trtllm:3:4:0.5"}},
                     {f"layer0.{p}": v for p, v in zip(("weight", "bias"), (mlp.layers[0][0].T, mlp.layers[0][1]))})
    alone = TrtllmK(None, 4, 0.5, 3)
    for policy in (gated, alone):
        chosen = []
        for accepted in (3, 0, 0, 0, 0, 0, 3):
            k = policy.choose_k(obs(8, 3.0))
            chosen.append(k)
            policy.update(StepResult(k=k, k_requested=k, accepted=min(accepted, k), new_tokens=[], draft_s=0.0,
                                     verify_s=0.0, accepted_rows=[min(accepted, k)] * 8))
        policy.reset()
        policy.chosen = chosen
    assert gated.chosen == alone.chosen and gated.chosen[0] == 3 and gated.chosen[-1] == 0  # cut off, and stays off
    assert gated.choose_k(obs(8, 3.0)) == 3  # reset turned it back on


def test_rule_spellings_and_bad_tables():
    table_rule = PerBatchK({1: StaticK(3), 2: BatchTableK({1: 3, 2: 1}, K)}, "best-rule")
    assert rule_spec(table_rule, 2, K) == "static:1" and rule_spec(table_rule, 1, K) == "static:3"
    mlp = match_mlp()
    weights = {"layer0.weight": mlp.layers[0][0].T, "layer0.bias": mlp.layers[0][1]}
    for bad, message in (({"0": "static:1"}, "batch size"), ({"x": "static:1"}, "batch size"),
                         ({"8": "learned"}, "rule"), ({"8": "static:99"}, "outside"), ({"8": 3}, "rule")):
        with pytest.raises(SpecPilotError, match=message):
            LearnedK({**mlp.meta, "defer": bad}, weights, "p.json")
    assert not LearnedK({**mlp.meta, "defer": {"8": "static:1"}}, weights, defer=False).defer


def test_a_deferring_policy_is_lossless_as_rows_end_and_the_batch_shrinks(tiny_pair):
    """Two rows decided by the rule (static:3) until one ends at EOS, then one row by the MLP: every row's tokens
    are its own greedy decoding."""
    from conftest import plain_greedy, tiny_target

    from specpilot.decoding.drafters import NgramDrafter
    from specpilot.decoding.loop import generate

    model, _ = tiny_pair
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 13, 2, 7, 5, 9]]
    mlp = match_mlp()
    gated = LearnedK({**mlp.meta, "defer": {"1": None, "2": "static:3"}},
                     {"layer0.weight": mlp.layers[0][0].T, "layer0.bias": mlp.layers[0][1]})
    eos = plain_greedy(model, prompts[1], 30)[6]
    references = [plain_greedy(model, p, 30, eos=eos) for p in prompts]
    assert len(references[1]) < len(references[0])  # the second row ends first
    result = generate(tiny_target(model, eos=eos), NgramDrafter(3), gated, prompts, 30)
    assert result.token_ids == references
    assert gated.deferred > 0 and gated.calls > 0  # both the rule and the MLP decided


def test_the_committed_cpu_policys_table_is_what_the_command_writes(tmp_path, monkeypatch):
    """`python -m specpilot.agents.defer` on a copy of the committed CPU policy (its profile, traces and tuned rules)
    writes the table the committed policy holds, from the train split."""
    import shutil
    from pathlib import Path

    from specpilot.agents.defer import defer_main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the profile and traces paths are relative to the repository
    committed = root / "policies" / COMMITTED_CPU_KEY / "ngram-3"
    meta = json.loads((committed / "policy.json").read_text())
    for name in ("policy.json", meta["weights"], "rules.json"):
        shutil.copy(committed / name, tmp_path / name)
    copy = json.loads((tmp_path / "policy.json").read_text())
    copy.pop("defer"), copy.pop("defer_evidence")
    (tmp_path / "policy.json").write_text(json.dumps(copy))
    assert defer_main(["--device", COMMITTED_CPU_KEY, "--draft", "ngram:3", "--policy", str(tmp_path / "policy.json"),
                       "--margin", "0"]) == 0
    written = json.loads((tmp_path / "policy.json").read_text())
    assert written["defer"] == meta["defer"]
    assert written["defer_evidence"]["mlp_over_rule"] == pytest.approx(meta["defer_evidence"]["mlp_over_rule"], abs=1e-4)
    loaded = LearnedK.load(tmp_path, device=COMMITTED_CPU_KEY, draft="ngram:3")
    assert set(loaded.defer) == {1, 2, 4, 8, 16} and [loaded.defer[b] is None for b in (1, 2, 4)] == [True] * 3


def test_a_policy_trained_on_simulated_contexts_is_judged_at_them():
    """A policy trained at the YAML's `context_lens` (a simulated chip's long contexts) is gated by the replay at
    those contexts, not at the prompts' own: here speculation pays at a short context and loses at 10,000 tokens."""
    short, long_ = [0.1] + [0.12] * K, [0.1] + [0.5] * K
    c = CostModel([0, 10000], [short, long_], [0.0, 0.0])
    rule = PerBatchK({1: StaticK(0)}, "best-rule")
    data = traces()
    native, ratios = defer_table(match_mlp(), rule, data, c, K, None, [1], 36, margin=0.0)
    assert native == {"1": None} and ratios[1] > 1.0  # the MLP keeps one row at the prompts' contexts
    at_long, long_ratios = defer_table(match_mlp(), rule, data, c, K, None, [1], 36, margin=0.0, context_lens=[10000])
    direct = replay_evaluate({"mlp": match_mlp(), "rule": rule}, data, c, K, None, 1, 36, context_len=10000)
    assert long_ratios[1] == pytest.approx(direct["mlp"]["speedup"] / direct["rule"]["speedup"]) and long_ratios[1] < 1.0
    assert at_long == {"1": "static:0"}


def test_the_one_routing_table_decides_as_the_two_lookups_in_turn_and_counts_into_the_policy():
    """LearnedK.route (built once at load from `defer` and `by_batch`) gives every batch size what the rule table
    then the network table give it, brute-forced over random tables; a network it routes to counts its calls into
    the policy that routed."""
    from specpilot.decoding.learned import route_table
    from specpilot.decoding.policies import at_or_below

    rng = np.random.default_rng(0)
    net, subs = object(), [object(), object()]
    for _ in range(200):
        defer = {int(b): (StaticK(int(rng.integers(K))) if rng.random() < 0.5 else None)
                 for b in sorted(rng.choice([1, 2, 3, 4, 8, 16], size=rng.integers(0, 4), replace=False))}
        by_batch = {int(b): subs[int(rng.integers(2))] if rng.random() < 0.6 else None
                    for b in sorted(rng.choice([1, 2, 4, 6, 16], size=rng.integers(0, 4), replace=False))}
        route = route_table(defer, by_batch, net)
        for batch in range(1, 40):
            rule = at_or_below(defer, batch) if defer else None
            expected = rule or (at_or_below(by_batch, batch) if by_batch else None) or net
            assert at_or_below(route, batch) is expected, (defer, by_batch, batch)
    mlp = match_mlp()
    sub = match_mlp()
    mlp.by_batch, mlp.defer = {1: None, 2: sub}, {1: None, 4: StaticK(1)}
    mlp.route = route_table(mlp.defer, mlp.by_batch, mlp)
    mlp._only = None
    assert [mlp.choose_k(obs(b, 5.0)) for b in (1, 2, 3, 4, 9)] == [K, K, K, 1, 1]
    assert (mlp.calls, mlp.deferred, sub.calls) == (3, 2, 0)
