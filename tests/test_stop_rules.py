"""Stopping inside a model draft: the rule, the confidence rules built on it (llama.cpp's p-min, transformers'
self-tuning threshold, SVIP's entropy bound, AdaEDL, BanditSpec's UCB), lossless decoding with each, and the
replay pricing a stop exactly as the real loop drafts it."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import plain_greedy, tiny_target
from test_head_draft import random_head

from specpilot.decoding.drafters import StopRule
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import HeadDrafter
from specpilot.decoding.loop import StepResult, generate
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import AdaEDL, BanditK, RocConfidence, roc_threshold
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel, record_trace
from specpilot.env.replay_env import ReplayEnv, replay_episode

K_MAX = 6
RULES = ["confidence:0.3", "confidence:0.2:3", "transformers-roc", "entropy:3.2", "adaedl:0.3:0.2", "bandit-ucb:0/2/4/6"]


def test_a_stop_rule_stops_a_batch_only_when_every_row_would():
    rule = StopRule(min_confidence=0.5, max_entropy=2.0)
    assert rule.stops([0.4], [1.0]) and rule.stops([0.9], [2.5])
    assert not rule.stops([0.6], [1.0])
    assert not rule.stops([0.4, 0.6], [1.0, 1.0])  # one row still confident: the batch drafts on
    assert rule.stops([0.4, 0.9], [1.0, 3.0])
    with pytest.raises(SpecPilotError, match="confidence in"):
        StopRule(min_confidence=1.5)
    with pytest.raises(SpecPilotError, match="unknown policy"):
        parse_policy("adaedl:1:0.5:4:9")
    with pytest.raises(SpecPilotError, match="outside"):
        parse_policy("confidence:0.5:12")


def test_roc_threshold_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 30))
        labels = rng.integers(0, 2, n).tolist()
        scores = np.round(rng.random(n), 1).tolist()  # ties on purpose
        best, best_cost = None, math.inf
        for threshold in [math.inf] + sorted(set(scores), reverse=True):  # sklearn's order: strictest first
            predicted = [s >= threshold for s in scores]
            positives, negatives = max(1, sum(labels)), max(1, n - sum(labels))
            fpr = sum(p and not y for p, y in zip(predicted, labels)) / negatives
            fnr = sum(y and not p for p, y in zip(predicted, labels)) / positives
            if fpr + 3 * fnr < best_cost - 1e-12:
                best, best_cost = threshold, fpr + 3 * fnr
        assert roc_threshold(labels, scores) == best


def test_transformers_roc_refits_its_threshold_from_accepted_and_rejected_tokens():
    policy = RocConfidence()
    assert policy.stop.min_confidence == 0.4

    def step(confidences, accepted):
        return StepResult(k=len(confidences), k_requested=8, accepted=accepted, new_tokens=[1] * (accepted + 1),
                          draft_s=0.0, verify_s=0.1, confidences=confidences)

    policy.update(step([0.9, 0.8, 0.7, 0.35], 2))  # 0.9, 0.8 kept; 0.7 rejected; 0.35 never verified
    assert policy.probs == [0.9, 0.8, 0.7] and policy.matches == [1, 1, 0]
    assert policy.stop.min_confidence == 0.4  # 3 samples: not refit yet
    policy.update(step([0.95, 0.6, 0.5], 3))  # all accepted: no 0 label
    policy.update(step([0.85, 0.65], 0))
    assert policy.matches == [1, 1, 0, 1, 1, 1, 0]
    assert policy.stop.min_confidence == roc_threshold(policy.matches, policy.probs) == 0.5
    policy.reset()
    assert policy.stop.min_confidence == 0.4 and not policy.probs


def test_adaedl_moves_its_entropy_bound_with_the_acceptance():
    policy = AdaEDL(gamma=2.0, lambda0=0.5)
    assert policy.stop.max_entropy == pytest.approx(0.25 / 2.0)
    policy.update(StepResult(k=4, k_requested=4, accepted=4, new_tokens=[1] * 5, draft_s=0, verify_s=0.1))
    assert policy.lam == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    assert policy.stop.max_entropy == pytest.approx((1 - policy.lam) ** 2 / 2.0)


def test_the_bandit_tries_every_arm_then_follows_the_fastest():
    policy = BanditK(arms=(0, 2, 4), c=0.0)
    obs = np.zeros(len(FEATURES))  # batch_size_log 0: one row
    speeds = {0: 10.0, 2: 25.0, 4: 15.0}
    chosen = []
    for _ in range(9):
        k = policy.choose_k(obs)
        chosen.append(k)
        policy.update(StepResult(k=k, k_requested=k, accepted=0, new_tokens=[1] * int(speeds[k]), draft_s=0.0,
                                 verify_s=1.0))
    assert chosen[:3] == [0, 2, 4]
    assert chosen[3:] == [2] * 6


@pytest.mark.parametrize("rule", RULES)
def test_every_confidence_rule_decodes_losslessly(tiny_pair, rule):
    model, _ = tiny_pair
    draft = HeadDrafter(random_head(model, list(range(0, 64, 2))), model)
    target = tiny_target(model)
    prompts = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2]]
    for prompt in prompts:
        assert generate(target, draft, parse_policy(rule, K_MAX), prompt, 30).token_ids == plain_greedy(model, prompt, 30)
    batch = generate(target, draft, parse_policy(rule, K_MAX), prompts, 30)
    assert batch.token_ids == [plain_greedy(model, p, 30) for p in prompts]


def _flat_cost():
    flat = [0.1] * (K_MAX + 1)
    return CostModel.from_profile({
        "context_lens": [1, 4096], "k": list(range(K_MAX + 1)), "verify_s": [flat, flat],
        "draft_s_per_token": [0.0, 0.0], "hardware": None, "batch_sizes": [1, 2], "batch_context_len": 64,
        "batch_verify_s": [flat, flat], "batch_draft_s_per_token": [0.0, 0.0]})


@pytest.mark.parametrize("batch", [1, 2])
def test_the_replay_drafts_what_the_real_loop_drafts_under_a_stop_rule(tiny_pair, batch):
    """Traces of a model draft hold every drafted token's probability and entropy; the replay stops where the
    real loop's draft stops (every row below the rule), step for step, so a stop rule is priced exactly."""
    model, _ = tiny_pair
    target = tiny_target(model)
    draft = HeadDrafter(random_head(model, list(range(64)), seed=2), model)
    prompts = [[5, 9, 13, 2, 7], [1, 2, 3, 1, 2, 3, 1, 2], [42, 7, 7], [9, 8, 7, 6, 5, 4]]
    traces = [record_trace(target, draft, p, 24, K_MAX, f"p{i}", "c") for i, p in enumerate(prompts)]
    confidences = sorted({c for t in traces for cs in t.confidences for c in cs})
    entropies = sorted({e for t in traces for es in t.entropies for e in es})
    mid_c = (confidences[len(confidences) // 2] + confidences[len(confidences) // 2 + 1]) / 2
    mid_e = (entropies[len(entropies) // 2] + entropies[len(entropies) // 2 + 1]) / 2
    rules = [f"confidence:{mid_c:.6f}", f"entropy:{mid_e:.6f}", "transformers-roc", f"adaedl:{1 / mid_e:.6f}:0.3"]
    env = ReplayEnv(traces, _flat_cost(), k_max=K_MAX, noise=0.0, batch_sizes=[batch])
    stopped = 0
    for rule in rules:
        for first in range(0, len(prompts), batch):
            group = list(range(first, first + batch))
            real = generate(target, draft, parse_policy(rule, K_MAX), [prompts[i] for i in group] if batch > 1
                            else prompts[first], 24)
            real_k = [s.k for s in real.steps]
            replayed = []
            policy = parse_policy(rule, K_MAX)
            update = policy.update
            policy.update = lambda step, update=update: (replayed.append(step.k), update(step))
            replay_episode(env, policy, group)
            assert replayed == real_k, rule
            stopped += sum(1 for s in real.steps if 0 < s.k < min(K_MAX, s.k_requested))
    assert stopped > 5  # the rules did stop drafts early


def test_a_replay_without_the_stop_rule_would_price_another_draft(tiny_pair):
    """The check above has the power to fail: replaying a confidence rule as if it drafted its whole K (what the
    replay did before it read the policy's stop rule) gives other step lengths."""
    model, _ = tiny_pair
    target = tiny_target(model)
    draft = HeadDrafter(random_head(model, list(range(64)), seed=2), model)
    prompt = [5, 9, 13, 2, 7]
    trace = record_trace(target, draft, prompt, 24, K_MAX, "p", "c")
    values = sorted(c for cs in trace.confidences for c in cs)
    rule = f"confidence:{values[len(values) // 2]:.6f}"
    real_k = [s.k for s in generate(target, draft, parse_policy(rule, K_MAX), prompt, 24).steps]
    env = ReplayEnv([trace], _flat_cost(), k_max=K_MAX, noise=0.0)
    env.reset(options={"trace_indices": [0]})
    ignored, done = [], False
    while not done:
        _, _, done, _, _ = env.step(K_MAX)  # env.stop left None
        ignored.append(env.last_step.k)
    assert ignored != real_k


def test_the_stop_check_costs_microseconds_per_drafted_token():
    """The check runs once per drafted token in the hot path: plain Python over the row's values, well under 10 us."""
    import time

    rule = StopRule(min_confidence=0.4, max_entropy=2.5)
    one, four = ([0.5], [1.0]), ([0.3, 0.2, 0.5, 0.1], [3.0, 3.0, 1.0, 3.0])
    for values in (one, four):
        t0 = time.perf_counter()
        for _ in range(20000):
            rule.stops(*values)
        assert (time.perf_counter() - t0) / 20000 < 10e-6
