"""The hybrid drafter's traces (env/sources.py): each source's proposals recorded at every position, the same as
that source recorded alone; the replay of a source rule takes the real loop's steps (source, k, accepted) one for
one; the oracle over sources is the brute-force minimum over every choice of source and length, and the replay
of its path costs what the program says."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from specpilot.decoding.drafters import NgramDrafter
from specpilot.decoding.loop import generate
from specpilot.decoding.models import load_draft
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel, Trace, oracle_schedule, record_trace
from specpilot.env.replay_env import ReplayEnv, replay_episode
from specpilot.env.sources import (
    ADVANCE_SHARE,
    SourceOracleK,
    oracle_over_sources,
    source_view,
)

PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "Print: a b a b a b a b a b a b"]  # a cycle: the lookup's continuation runs out, all right, the head goes on


@pytest.fixture(scope="module")
def traced(embedded_target):
    target = embedded_target
    hybrid = load_draft("hybrid", target)
    prompts = [target.encode(p, chat=True) for p in PROMPTS]
    traces = [record_trace(target, hybrid, ids, 24, 8, question_id=f"q{n}") for n, ids in enumerate(prompts)]
    return target, hybrid, prompts, traces


def cost_model() -> CostModel:
    """A verify curve that rises with k and a head that costs a tenth of a plain step per token."""
    verify = [1.0, 1.05, 1.1, 1.4, 1.5, 1.6, 1.9, 2.0, 2.1]
    return CostModel([16, 4096], [verify, [v * 1.2 for v in verify]], [0.1, 0.1])


@pytest.mark.embedded
def test_each_source_of_a_hybrid_trace_is_that_source_recorded_alone(traced):
    target, hybrid, prompts, traces = traced
    for ids, trace in zip(prompts, traces):
        lookup = record_trace(target, NgramDrafter(max_n=3), ids, 24, 8)
        head = record_trace(target, hybrid.head, ids, 24, 8)
        assert trace.output_ids == lookup.output_ids == head.output_ids
        assert (trace.matches, trace.available, trace.ngram_n) == (lookup.matches, lookup.available, 3)
        assert source_view(trace, "head").matches == head.matches
        assert source_view(trace, "head").available == head.available
        extend = source_view(trace, "extend")
        for i, (m, a) in enumerate(zip(trace.matches, trace.available)):
            if a == 0:  # nothing to copy: the head's own draft
                assert (extend.matches[i], extend.available[i]) == (head.matches[i], head.available[i])
            elif a == 8 or m < a:  # all copied, or a copied token already wrong: the lookup's acceptance
                assert extend.matches[i] == m
            else:  # every copied token right: the head carries on after them
                assert extend.matches[i] >= m and extend.confidences[i][:a] == [1.0] * a
    assert any(0 < a < 8 and m == a for t in traces for m, a in zip(t.matches, t.available))  # the head extended


@pytest.mark.embedded
@pytest.mark.parametrize("policy", ["hybrid-sam:2:8:2", "hybrid-best:6:2"] + [
    pytest.param(p, marks=pytest.mark.slow) for p in ("source:extend:4", "hybrid-score:8:3:0.3")])
def test_the_replay_of_a_source_rule_takes_the_real_loops_steps(traced, policy):
    target, hybrid, prompts, traces = traced
    env = ReplayEnv(traces, cost_model(), k_max=8, noise=0.0, max_new_tokens=24)
    for n, ids in enumerate(prompts):
        real = generate(target, hybrid, parse_policy(policy, 8, draft="hybrid"), ids, 24)
        seen = []
        rule = parse_policy(policy, 8, draft="hybrid")
        update = rule.update
        rule.update = lambda step, seen=seen, update=update: (seen.append(step), update(step))
        replay_episode(env, rule, [n])
        assert [(s.source, s.k, s.accepted) for s in seen] == [(s.source, s.k, s.accepted) for s in real.steps]
    assert {s.source for s in real.steps if s.k} >= ({"lookup", "head"} if "sam" in policy else set())


def random_trace(rng: np.random.Generator, n: int) -> Trace:
    def proposals():
        available = [int(rng.integers(0, 5)) for _ in range(n)]
        matches = [min(a, int(rng.integers(0, 5)), n - i - 1) for i, a in enumerate(available)]
        return {"matches": matches, "available": available, "confidences": [[1.0] * a for a in available],
                "entropies": [[0.0] * a for a in available]}
    lookup = proposals()
    return Trace("r", "c", [1, 2, 3], list(range(n)), lookup["matches"], lookup["available"], lookup["confidences"],
                 lookup["entropies"], [0] * n, 4, sources={"head": proposals(), "extend": proposals()})


def brute_force(trace: Trace, cost: CostModel, k_max: int, i: int = 0, memo: dict | None = None) -> float:
    """Every (source, k) at every step, recursively (the remaining time from a position memoised): no shared code
    with the program but the views."""
    memo = {} if memo is None else memo
    n = len(trace.output_ids)
    if i >= n:
        return 0.0
    if i in memo:
        return memo[i]
    table, per_token = cost.step_costs(len(trace.prompt_ids) + i)
    best = np.inf
    for source, k in itertools.product(("lookup", "head", "extend"), range(k_max + 1)):
        view = source_view(trace, source)
        d = min(k, view.available[i], n - i - 1)
        copied = min(d, trace.available[i])
        price = {"lookup": 0.0, "head": d, "extend": 0.0 if copied == d else ADVANCE_SHARE * copied + d - copied}
        seconds = table[d] - per_token * d + per_token * price[source]
        best = min(best, seconds + brute_force(trace, cost, k_max, i + min(d, view.matches[i]) + 1, memo))
    memo[i] = best
    return best


def test_the_oracle_over_sources_is_the_brute_force_minimum_and_its_replay_costs_it():
    rng = np.random.default_rng(0)
    cost = cost_model()
    for _ in range(6):
        trace = random_trace(rng, 12)
        seconds, path = oracle_over_sources(trace, cost, 4)
        assert seconds == pytest.approx(brute_force(trace, cost, 4), rel=1e-12)
        for source in ("lookup", "head", "extend"):  # choosing beats every single source's own oracle
            assert seconds <= oracle_over_sources(trace, cost, 4, sources=(source,))[0] + 1e-12
        env = ReplayEnv([trace], cost, k_max=4, noise=0.0)
        oracle = SourceOracleK([trace], cost, 4)
        oracle.prepare("r")
        episode = replay_episode(env, oracle, [0])
        assert episode.seconds == pytest.approx(seconds, rel=1e-9)
    plain_trace = Trace("p", "c", [1, 2, 3], list(range(7)), [2, 0, 3, 1, 0, 1, 0], [3, 1, 4, 2, 0, 1, 1],
                        [], [], [0] * 7, 4)  # a single draft's trace: the oracle over sources is its oracle
    assert oracle_over_sources(plain_trace, cost, 4, sources=(None,))[0] == pytest.approx(
        oracle_schedule(plain_trace, cost, 4)[0], rel=1e-12)


def switching_traces(n: int = 6, length: int = 36, k: int = 4, span: int = 6) -> list[Trace]:
    """Copied spans and free text alternating every `span` tokens (shifted per trace): in a span the lookup drafts k / 2
    right tokens (its match 3 long) and the head none, outside the lookup has nothing and the head drafts k right ones;
    the extension is the lookup's copy in a span, then the head's wrong tokens (read through the copy: dearer) when k
    asks for more, and the head's draft outside. No single source at a fixed k is right in both."""
    out = []
    for t in range(n):
        good = [((i + 2 * t) // span) % 2 == 0 for i in range(length)]
        cut = [lambda m, i=i: min(m, length - i - 1) for i in range(length)]
        half = k // 2
        lookup = {"matches": [cut[i](half if g else 0) for i, g in enumerate(good)],
                  "available": [half if g else 0 for g in good]}
        head = {"matches": [cut[i](0 if g else k) for i, g in enumerate(good)], "available": [k] * length,
                "confidences": [[0.9] * k] * length, "entropies": [[0.5] * k] * length}
        extend = {"matches": [lookup["matches"][i] if g else head["matches"][i] for i, g in enumerate(good)],
                  "available": [k] * length, "confidences": [[1.0] * k if g else [0.9] * k for g in good],
                  "entropies": [[0.0] * k if g else [0.5] * k for g in good]}
        out.append(Trace(f"s{t}", "c", list(range(10)), list(range(100 * t, 100 * t + length)), lookup["matches"],
                         lookup["available"], [[1.0] * a for a in lookup["available"]],
                         [[0.0] * a for a in lookup["available"]], [3 if g else 0 for g in good], k,
                         sources={"head": head, "extend": extend}))
    return out


def test_a_warm_start_over_sources_learns_which_source_drafts_where_the_features_say():
    from specpilot.agents.improve import collect, fit, as_policy
    from specpilot.decoding.hybrid import ACTION_SOURCES
    from specpilot.decoding.policies import StaticK
    from specpilot.env.replay_env import replay_evaluate

    k = 4
    traces = switching_traces(k=k)
    cost = CostModel([0, 10000], [[0.1] + [0.18] * k] * 2, [0.02, 0.02])  # a head token: a fifth of a plain step
    data = collect(StaticK(1), traces, cost, k, None, [1], {1: len(traces)}, 36, progress=False, sources=ACTION_SOURCES)
    assert data.regret.shape[1] == 3 * (k + 1) and np.allclose(data.regret.min(1), 0)
    layers, norm = fit(data, [32, 32], epochs=150)
    policy = as_policy(layers, norm, "tanh", k, sources=ACTION_SOURCES)
    singles = {f"source:{s}:{n}": parse_policy(f"source:{s}:{n}", k, draft="hybrid") for s in ("lookup", "head", "extend")
               for n in range(1, k + 1)}  # each source alone at its best fixed k
    scores = replay_evaluate({"none": StaticK(0), **singles, "learned": policy, "oracle": SourceOracleK(traces, cost, k)},
                             traces, cost, k, None, 1, 36)
    best_single = max(scores[n]["fraction_of_oracle"] for n in singles)
    assert scores["learned"]["fraction_of_oracle"] >= 0.97 and best_single < scores["learned"]["fraction_of_oracle"] - 0.05
    env = ReplayEnv(traces, cost, k_max=k, noise=0.0, sources=ACTION_SOURCES)
    chosen = []
    update = policy.update
    policy.update = lambda step: (chosen.append((step.source, step.match_len, step.k)), update(step))
    replay_episode(env, policy, [0])
    # in a span only the lookup's tokens (the lookup, or an extension it fills alone: the same draft at the same price)
    assert all(s == "lookup" or (s == "extend" and d <= k // 2) for s, m, d in chosen if m == 3)
    assert "lookup" not in {s for s, m, _ in chosen if m == 0}


def test_the_field_rules_over_sources_are_tuned_on_hybrid_traces_and_a_policy_file_names_its_sources(tmp_path):
    from specpilot.agents.export import write_policy
    from specpilot.bench.tune_cli import tune_rules
    from specpilot.decoding.hybrid import ACTION_SOURCES
    from specpilot.decoding.learned import LearnedK
    from specpilot.decoding.observation import FEATURES
    from specpilot.decoding.policies import ActionTable

    k = 4
    traces = switching_traces(k=k, span=12)
    profile = {"context_lens": [0, 10000], "verify_s": [[0.1] + [0.18] * k] * 2, "draft_s_per_token": [0.02, 0.02]}
    result = tune_rules(traces, profile, "hybrid", k, None, [1], 36, progress=False)
    assert {"hybrid-sam", "hybrid-score", "hybrid-best", "hybrid-ucb", "source-lookup", "source-head"} <= set(result["best"])
    assert "match" not in result["best"]  # the n-gram match rule is prompt lookup's, not the hybrid's
    speed = result["speedups"][1]
    assert speed[result["best_rule"][1]] == max(speed[result["best"][f][1]] for f in result["best"])
    # switching pays here (llama.cpp's best-of reads the lookup's available tokens; these synthetic traces have no
    # n-gram statistics for SAM's and Arctic's rules to read)
    assert speed[result["best"]["hybrid-best"][1]] > max(speed[result["best"][f"source-{s}"][1]] for s in ("lookup", "head"))

    table = ActionTable(k, (0.0, 0.5), ACTION_SOURCES)
    assert len(table) == 3 * 2 * (k + 1) and table.decode(3) == (3, None) and table.source(3, "head") == "head"
    assert table.source((2 * 1 + 1) * (k + 1) + 2) == "lookup" and table.decode((2 * 1 + 1) * (k + 1) + 2)[1].min_confidence == 0.5
    n = len(FEATURES)
    layers = [(np.zeros((len(table), n), dtype=np.float32), np.eye(len(table), dtype=np.float32)[2 * (k + 1) + 3] * 5)]
    norm = {"mean": [0.0] * n, "var": [1.0] * n, "epsilon": 1e-8, "clip": 10.0}
    path = write_policy(tmp_path / "p", layers, norm, "tanh", k, "cpu-test-1c", "test", 0, {}, stop_levels=(0.0, 0.5),
                        sources=ACTION_SOURCES)
    policy = LearnedK.load(path, allow_device_mismatch=True)
    assert policy.choose_k(np.zeros(n, dtype=np.float32)) == 3 and policy.source == "lookup" and policy.stop is None


def test_the_replay_checks_price_of_a_hybrid_step_is_the_replay_envs():
    """`bench.replay_check.step_prices` re-prices each real step by its source as the replay env does: fed the replay's
    own steps (noise-free, every source, copies the lookup fills alone and longer extensions), it returns their seconds;
    the source-blind price (the profile's table) differs on them, so the check would catch a replay-check that ignored
    the source."""
    from specpilot.bench.replay_check import step_prices
    from specpilot.decoding.hybrid import SourceBanditK

    rng = np.random.default_rng(4)
    cost = cost_model()
    for t in range(4):
        trace = random_trace(rng, 16)
        env = ReplayEnv([trace], cost, k_max=4, noise=0.0)
        policy = SourceBanditK(arms=(("lookup", 3), ("head", 2), ("extend", 1), ("extend", 4)), c=2.0)
        steps = []
        update = policy.update
        policy.update = lambda step: (steps.append(step), update(step))
        replay_episode(env, policy, [0])
        assert {s.source for s in steps if s.k} >= {"head", "extend"}
        seconds = [s.draft_s + s.verify_s for s in steps]
        assert step_prices(steps, cost, trace) == pytest.approx(seconds, rel=1e-12)
        blind = step_prices(steps, cost)
        assert any(abs(a - b) > 1e-9 for a, b in zip(blind, seconds))
