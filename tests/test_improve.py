"""Rollout policy improvement (the warm start): on hand-made traces where the observation determines the
best k, the fitted policy recovers the oracle's choices, starting from a base rule that gets them wrong."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import stretch_traces

from specpilot.agents.improve import as_policy, collect, fit, improve_policy, mean_regret
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import StaticK
from specpilot.env.oracle import CostModel, OracleK, Trace, hindsight_q
from specpilot.env.replay_env import replay_evaluate

K = 4


def traces(n: int = 8, length: int = 36) -> list[Trace]:
    return stretch_traces(K, n, length)


def cost() -> CostModel:
    """A plain step 0.1 s; verifying any k >= 1 drafts 0.18 s (the CPU's shape at one row)."""
    verify = [[0.1] + [0.18] * K] * 2
    return CostModel([0, 10000], verify, [0.0, 0.0])


def test_rollout_improvement_recovers_the_oracle_where_the_features_decide():
    data_traces, c = traces(), cost()
    base = StaticK(1)  # drafts one token everywhere: wasted at match 1, too little at match 3
    data = collect(base, data_traces, c, K, None, [1], {1: len(data_traces)}, 36, progress=False)
    assert data.regret.shape[1] == K + 1 and (data.regret >= 0).all() and np.allclose(data.regret.min(1), 0)
    layers, norm = fit(data, [32, 32], epochs=150)
    policy = as_policy(layers, norm, "tanh", K)
    assert mean_regret(policy, data) < 0.25 * mean_regret(_constant(1), data)
    match = FEATURES.index("ngram_match_len")
    for o in data.obs:
        assert policy.choose_k(o) == (K if o[match] >= 3 else 0)
    scores = replay_evaluate({"none": StaticK(0), "base": base, "learned": policy,
                              "oracle": OracleK(data_traces, c, K)}, data_traces, c, K, None, 1, 36)
    assert scores["base"]["speedup"] < 0.8 * scores["oracle"]["speedup"]
    assert scores["learned"]["fraction_of_oracle"] == pytest.approx(1.0, abs=0.02)


def held_out_traces(shifts=(1, 3, 5, 7), length: int = 50) -> list[Trace]:
    """Traces of the same kind as `traces()` at stretch offsets and a length none of them has (odd shifts: the
    training traces' shifts are even), with other token ids: no training trace repeats one of these."""
    out = []
    for s in shifts:
        good = [((i + s) // 6) % 2 == 0 for i in range(length)]
        out.append(Trace(f"h{s}", "c", list(range(10)), list(range(300 + s, 300 + s + length)),
                         [K if g else 0 for g in good], [K] * length, match_lens=[3 if g else 1 for g in good], k_max=K))
    return out


def test_improve_policy_rounds_never_lose_to_the_base():
    """Every round's fitted policy (1 round, then 2) beats the base rule on traces no round was fitted on, and
    each round's fit leaves less regret on its labelled states than the base had there."""
    data_traces, c, held_out = traces(6), cost(), held_out_traces()
    base = StaticK(1)
    base_speed = replay_evaluate({"base": base}, held_out, c, K, None, 1, 50)["base"]["speedup"]
    for rounds in (1, 2):
        layers, norm, history = improve_policy(base, data_traces, c, K, None, [1], {1: 6}, 36, rounds=rounds,
                                               hidden=[32, 32], activation="tanh", epochs=100, progress=False)
        assert [h["round"] for h in history] == list(range(1, rounds + 1))
        assert all(h["fitted_regret"] < h["base_regret"] for h in history), history
        learned = as_policy(layers, norm, "tanh", K)
        speed = replay_evaluate({"learned": learned}, held_out, c, K, None, 1, 50)["learned"]["speedup"]
        assert speed > base_speed, (rounds, speed, base_speed)
    assert history[1]["states"] > history[0]["states"]  # round 2 labels the fitted policy's states too


class _constant:
    """A policy whose logits always pick k (for mean_regret)."""

    def __init__(self, k: int):
        self.k = k

    def logits(self, obs):
        out = np.zeros((len(obs), K + 1))
        out[:, self.k] = 1.0
        return out


def test_learned_policy_clips_inputs_into_its_trained_range_and_counts_them():
    data_traces, c = traces(4), cost()
    data = collect(StaticK(1), data_traces, c, K, None, [1], {1: 4}, 36, progress=False)
    layers, norm = fit(data, [16], epochs=20)
    policy = as_policy(layers, norm, "tanh", K)
    assert norm["low"] == pytest.approx(data.obs.min(0).tolist()) and norm["high"] == pytest.approx(data.obs.max(0).tolist())
    inside = data.obs[0].astype(np.float64)
    policy.choose_k(inside)
    assert (policy.calls, policy.out_of_range) == (1, 0)
    context = FEATURES.index("context_len_log")
    far = inside.copy()
    far[context] = norm["high"][context] + 5.0  # a context far longer than any trained on
    edge = inside.copy()
    edge[context] = norm["high"][context]
    assert policy.choose_k(far) == policy.choose_k(edge)
    assert np.allclose(policy.logits(far), policy.logits(edge))
    assert (policy.calls, policy.out_of_range) == (3, 1)
    assert policy.clipped_features() == {"context_len_log": 1}  # which input was clipped, and nothing else
    below = inside.copy()
    below[context] = norm["low"][context] - 1.0
    below[FEATURES.index("remaining_frac")] = norm["high"][FEATURES.index("remaining_frac")] + 1.0
    policy.choose_k(below)
    assert policy.clipped_features() == {"context_len_log": 2, "remaining_frac": 1}


def test_labels_are_the_same_from_any_number_of_worker_processes():
    """collect(workers=2) labels the episodes in two processes: the same states and regrets, in the same order, as
    one process (episodes are seeded by their index), for a rule base and for a fitted policy following itself."""
    data_traces, c = traces(5), cost()
    plan = dict(batch_sizes=[1], episodes={1: 5}, max_new_tokens=36, progress=False)
    one = collect(StaticK(1), data_traces, c, K, None, seed=3, **plan)
    two = collect(StaticK(1), data_traces, c, K, None, seed=3, workers=2, **plan)
    for field in ("obs", "regret", "batch"):
        np.testing.assert_array_equal(getattr(one, field), getattr(two, field))
    fitted = as_policy(*fit(one, [16], epochs=20), "tanh", K)
    one = collect(fitted, data_traces, c, K, None, follow=fitted, **plan)
    two = collect(fitted, data_traces, c, K, None, follow=fitted, workers=2, **plan)
    np.testing.assert_array_equal(one.obs, two.obs)
    np.testing.assert_array_equal(one.regret, two.regret)


def test_behaviour_cloning_of_the_oracle_recovers_its_k_where_the_features_decide():
    """labels="oracle": the one-row states are labelled with the oracle's hindsight regret (no rollouts of the
    base), on the oracle's own path in round 1; the fitted policy drafts K where the match says the drafts are
    right and nothing where it says they are wrong, and reaches the oracle's speed."""
    data_traces, c = traces(), cost()
    data = collect(StaticK(1), data_traces, c, K, None, [1], {1: len(data_traces)}, 36, progress=False, labels="oracle")
    assert np.allclose(data.regret.min(1), 0) and (data.regret >= 0).all()
    # episode 0 (the first trace): the states of the oracle's path, each labelled Q*(i, k) - min_k Q*(i, k) in
    # plain steps (0.1 s here)
    q, i, expected = hindsight_q(data_traces[0], c, K, 36), 0, []
    while i < 36:
        expected.append((q[i] - q[i].min()) / 0.1)
        k = int(np.argmin(q[i]))
        i += min(k, data_traces[0].available[i], data_traces[0].matches[i]) + 1
    np.testing.assert_allclose(data.regret[: len(expected)], expected, rtol=1e-5, atol=1e-6)
    match = FEATURES.index("ngram_match_len")
    # the oracle's labels: K is free of regret where the drafts are right, 0 where they are wrong (the last
    # positions of a row excepted, where fewer drafts fit)
    good = data.obs[:, match] >= 3
    assert (data.regret[good, K] == 0).mean() > 0.9 and (data.regret[~good, 0] == 0).mean() > 0.9
    policy = as_policy(*fit(data, [32, 32], epochs=150), "tanh", K)
    started = data.obs[:, FEATURES.index("remaining_frac")] < 1.0  # a row's first state reads alike in every trace
    for o in data.obs[started]:  # (no history yet), while its best k differs by where the trace's stretch starts
        assert policy.choose_k(o) == (K if o[match] >= 3 else 0)
    scores = replay_evaluate({"learned": policy, "oracle": OracleK(data_traces, c, K), "base": StaticK(1)},
                             data_traces, c, K, None, 1, 36)
    # the first state's k is a guess (least regret on average: 0 or K, as the fit's start falls), worth up to ~6% of
    # these 36-token rows; every later state's is the oracle's
    assert scores["learned"]["fraction_of_oracle"] >= 0.93 > scores["base"]["fraction_of_oracle"] + 0.1
    with pytest.raises(SpecPilotError, match="'rollout' or 'oracle'"):
        collect(StaticK(1), data_traces, c, K, None, [1], {1: 1}, 36, progress=False, labels="dp")


def test_batch_weights_decide_between_batch_sizes_that_disagree(monkeypatch):
    """The same observations labelled k = K at one row and k = 0 at two rows: the fit follows the batch size
    whose states weigh, and improve_policy hands its `batch_weights` to the fit."""
    from specpilot.agents import improve
    from specpilot.agents.improve import Dataset

    rng = np.random.default_rng(0)
    obs = np.zeros((200, len(FEATURES)), np.float32)  # eight features vary, the others are constant (pinned)
    obs[:, :8] = rng.standard_normal((200, 8))
    want_k, want_0 = np.ones((200, K + 1), np.float32), np.ones((200, K + 1), np.float32)
    want_k[:, K] = 0.0
    want_0[:, 0] = 0.0
    data = Dataset(np.concatenate([obs, obs]), np.concatenate([want_k, want_0]), np.array([1] * 200 + [2] * 200))
    for weights, k in (({2: 0.0}, K), ({1: 0.0}, 0)):
        policy = as_policy(*fit(data, [16], epochs=300, batch_weights=weights), "tanh", K)
        assert all(policy.choose_k(o) == k for o in obs[:20])
    seen = []
    monkeypatch.setattr(improve, "fit", lambda *a, **kw: (seen.append(kw["batch_weights"]), fit(*a, **kw))[1])
    improve_policy(StaticK(1), traces(2), cost(), K, None, [1], {1: 2}, 36, rounds=1, hidden=[8], activation="tanh",
                   epochs=2, progress=False, batch_weights={1: 2.0})
    assert seen == [{1: 2.0}]
