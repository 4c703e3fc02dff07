"""bench.ceiling: where a feature decides acceptance, its predictive policy finds the rule that reads it."""
from __future__ import annotations

import random

from bench.ceiling import fit_acceptance, match_features, predictive_policy, speedup
from env.oracle import CostModel, Trace, oracle_schedule


def test_predictive_policy_learns_what_the_match_length_says():
    rng = random.Random(0)
    traces = []
    for q in range(12):
        n = 30
        lens = [rng.choice([1, 3]) for _ in range(n)]
        matches = [8 if m == 3 else 0 for m in lens]  # a 3-gram match is always right, a 1-gram never
        traces.append(Trace(f"q{q}", "c", [1, 2, 3], list(range(10, 10 + n)), matches, [8] * n, match_lens=lens, k_max=8))
    cost = CostModel([16, 1024], [[1.0] + [1.6] * 8] * 2, [0.0, 0.0])
    extras = {t.question_id: [match_features(t, i) for i in range(len(t.output_ids))] for t in traces}
    choose = predictive_policy(fit_acceptance(traces, extras, 8), extras, lam=1.0)
    plain = sum(len(t.output_ids) for t in traces)
    oracle = plain / sum(oracle_schedule(t, cost, 8)[0] for t in traces)
    rule = speedup(traces, cost, lambda t, i, s, tab: 8 if t.match_lens[i] == 3 else 0)  # the ideal causal rule here
    always = speedup(traces, cost, lambda t, i, s, tab: 8)
    ours = speedup(traces, cost, choose)
    assert ours >= 0.995 * rule and ours > 1.05 * always
    assert ours <= oracle + 1e-9  # (the oracle also picks where a step lands: foresight no causal policy has)
