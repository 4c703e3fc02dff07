"""bench.ceiling: where a feature decides acceptance, its predictive policy finds the rule that reads it."""
from __future__ import annotations

import random

from specpilot.bench.ceiling import Featurizer, fit_acceptance, predictive_policy, speedup
from specpilot.env.oracle import CostModel, Trace, oracle_schedule


def test_predictive_policy_learns_what_the_match_length_says():
    rng = random.Random(0)
    traces = []
    for q in range(12):
        n = 30
        lens = [rng.choice([1, 3]) for _ in range(n)]
        matches = [8 if m == 3 else 0 for m in lens]  # a 3-gram match is always right, a 1-gram never
        traces.append(Trace(f"q{q}", "c", [1, 2, 3], list(range(10, 10 + n)), matches, [8] * n, match_lens=lens, k_max=8))
    cost = CostModel([16, 1024], [[1.0] + [1.6] * 8] * 2, [0.0, 0.0])
    featurize = Featurizer(traces)
    choose = predictive_policy(fit_acceptance(traces, featurize, 8), featurize, lam=1.0)
    plain = sum(len(t.output_ids) for t in traces)
    oracle = plain / sum(oracle_schedule(t, cost, 8)[0] for t in traces)
    rule = speedup(traces, cost, lambda t, i, s, tab: 8 if t.match_lens[i] == 3 else 0)  # the ideal causal rule here
    always = speedup(traces, cost, lambda t, i, s, tab: 8)
    ours = speedup(traces, cost, choose)
    assert ours >= 0.995 * rule and ours > 1.05 * always
    assert ours <= oracle + 1e-9  # (the oracle also picks where a step lands: foresight no causal policy has)


def test_input_families_add_their_columns_and_the_command_runs(tmp_path, capsys):
    """Featurizer: frames:N adds five inputs per earlier position (zeros and an unknown shadow before the start),
    source nine (from a token-class function); the command fits and prints the three splits; a bad family is a
    one-line error."""
    import json


    from specpilot.bench.ceiling import ceiling_main, features, match_features, shadow_at
    from specpilot.decoding.config import run_cli

    rng = random.Random(1)
    traces = []
    for q in range(6):
        n = 20
        lens = [rng.choice([1, 3]) for _ in range(n)]
        traces.append(Trace(f"q{q}", "c", [1, 2, 3, 1, 2], [rng.randint(1, 4) for _ in range(n)],
                            [8 if m == 3 else 0 for m in lens], [8] * n, match_lens=lens, k_max=8, ngram_n=3))
    base = len(features(traces[0], 0, 0.5, match_features(traces[0], 0)))
    two = Featurizer(traces, ["match", "frames:2"])
    assert len(two(traces[0], 5, 1.0)) == base + 10
    assert two(traces[0], 0, 0.5)[base:] == [0.0, 0.0, 0.0, 0.0, 0.5] * 2
    assert two(traces[0], 5, 1.0)[base + 4] == shadow_at(traces[0], 4)
    source = Featurizer(traces, ["match", "source"], token_class=lambda token: [0.0] * 4 + [float(token == 4)])
    assert len(source(traces[1], 7, 0.0)) == base + 14
    profile = {"device": "cpu", "context_lens": [0, 4096], "verify_s": [[1.0] + [1.6] * 8] * 2,
               "draft_s_per_token": [0.0, 0.0]}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    splits = {t.question_id: ("train" if i < 4 else "test") for i, t in enumerate(traces)}
    (tmp_path / "t.json").write_text(json.dumps({"meta": {"draft": "ngram:3", "splits": splits},
                                                 "traces": [t.__dict__ for t in traces]}))
    args = ["--profile", str(tmp_path / "p.json"), "--traces", str(tmp_path / "t.json"), "--max-new-tokens", "20"]
    assert ceiling_main(args + ["--inputs", "match,frames:1"]) == 0
    out = capsys.readouterr().out
    assert "inputs match,frames:1" in out and "train" in out and "test" in out and "ood" not in out
    assert run_cli(ceiling_main, args + ["--inputs", "match,frames:0"]) == 2
    assert "--inputs takes match, target, source and frames:N" in capsys.readouterr().err


def test_target_confidences_come_from_one_forward_and_refuse_another_models_trace(tiny_pair, tmp_path):
    """The target's top probability at each output position is that of the token the greedy trace holds (the
    full-recompute softmax), its entropy >= 0; cached once; a trace that is not this target's greedy output is refused."""
    import pytest
    import torch
    from conftest import plain_greedy, tiny_target

    from specpilot.bench.ceiling import cached_confidences, target_confidences
    from specpilot.decoding.errors import SpecPilotError

    model = tiny_pair[0]
    prompt = [5, 9, 14, 5, 9]
    output = plain_greedy(model, prompt, 8)
    trace = Trace("q", "c", prompt, output, [0] * 8, [0] * 8, k_max=8)
    top, entropy = target_confidences(tiny_target(model), trace)
    assert len(top) == len(entropy) == 8 and all(0 < p <= 1 for p in top) and all(e >= -1e-9 for e in entropy)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt + output[:3]])).logits[0, -1].double(), -1)
    assert top[3] == pytest.approx(float(probs.max()), rel=1e-5)
    cache = tmp_path / "c.json"
    assert cached_confidences(tiny_target(model), [trace], cache)["q"][0] == pytest.approx(top, abs=1e-5)
    assert cache.exists()
    wrong = Trace("w", "c", prompt, [(t + 1) % 50 for t in output], [0] * 8, [0] * 8, k_max=8)
    with pytest.raises(SpecPilotError, match="not this target's greedy output"):
        target_confidences(tiny_target(model), wrong)
