"""Stopping inside the draft as part of the learned action: the (k, stop level) table, the envs decoding it, the
policy file carrying it, and a warm start that learns to use it where the draft's confidence predicts acceptance."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specpilot.agents.export import write_policy
from specpilot.agents.improve import as_policy, improve_policy
from specpilot.decoding.drafters import StopRule
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.policies import ActionTable, StaticK
from specpilot.env.oracle import CostModel, Trace
from specpilot.env.replay_env import ReplayEnv, replay_evaluate

K_MAX = 4
LEVELS = [0.0, 0.5]


def test_the_action_table_pairs_each_k_with_each_level():
    table = ActionTable(K_MAX, LEVELS)
    assert len(table) == 2 * (K_MAX + 1)
    assert table.decode(3) == (3, None)  # the first level is 0: actions 0..k_max are k itself
    assert table.decode(K_MAX + 1 + 3) == (3, StopRule(min_confidence=0.5))
    assert table.decode(2, StopRule(max_entropy=1.0)) == (2, StopRule(max_entropy=1.0))  # no level: the caller's rule
    assert table.decode(12) == (12, None)  # a k past the table (a rule asking beyond k_max)
    assert ActionTable.of(table.to_k, table.to_stop).to_stop == table.to_stop
    for bad in ([0.5, 0.0], [0.0, 0.0], [0.0, 1.2], []):
        with pytest.raises(SpecPilotError, match="stop levels"):
            ActionTable(K_MAX, bad)


def _trace(qid: str, rng: np.random.Generator, n: int = 40) -> Trace:
    """A model draft whose confidence tells which tokens the target keeps: at each position a run of r correct
    tokens (confidence 0.8-0.95) and then wrong ones (0.05-0.3)."""
    runs = rng.integers(0, K_MAX + 1, n)
    conf = [[float(rng.uniform(0.8, 0.95)) if d < r else float(rng.uniform(0.05, 0.3)) for d in range(K_MAX)]
            for r in runs]
    return Trace(qid, "c", list(range(8)), list(range(100, 100 + n)), [int(r) for r in runs], [K_MAX] * n,
                 confidences=conf, entropies=[[0.5] * K_MAX for _ in range(n)], k_max=K_MAX)


def _cost() -> CostModel:
    """A verify of 1-2 drafted tokens costs about a plain step, of 3-4 up to twice that (this CPU's shape), a draft step
    8% of one: a wrong drafted token costs, the more so deep in the draft."""
    verify = [0.1, 0.11, 0.12, 0.16, 0.2]
    return CostModel.from_profile({"context_lens": [1, 4096], "k": list(range(K_MAX + 1)), "verify_s": [verify, verify],
                                   "draft_s_per_token": [0.008, 0.008], "hardware": None})


def test_the_replay_env_decodes_a_stop_level_action():
    trace = _trace("a", np.random.default_rng(0))
    env = ReplayEnv([trace], _cost(), k_max=K_MAX, noise=0.0, stop_levels=LEVELS)
    assert env.action_space.n == 2 * (K_MAX + 1)
    env.reset(options={"trace_indices": [0]})
    seen, done = set(), False
    while not done and env.state.remaining > K_MAX:
        r = trace.matches[env.state.rows[0].length - env.state.rows[0].prompt_len]
        _, _, done, _, info = env.step(K_MAX + 1 + K_MAX)  # k = K_MAX, stop below 0.5: drafts exactly the confident run
        assert env.last_step.k == r and env.last_step.accepted == r
        # priced as the verify of r tokens, r draft steps, and the draft step whose token it stopped before (if any)
        assert info["seconds"] == pytest.approx([0.1, 0.11, 0.12, 0.16, 0.2][r] + 0.008 * (r + (r < K_MAX)))
        seen.add(r < K_MAX)
    assert seen == {True, False}


def test_a_policy_file_carries_its_stop_levels(tmp_path):
    n_in, n_out = len(FEATURES), 2 * (K_MAX + 1)
    w = np.zeros((n_out, n_in), dtype=np.float32)
    b = np.zeros(n_out, dtype=np.float32)
    b[K_MAX + 1 + 3] = 1.0  # always: k = 3, stop below 0.5
    norm = {"mean": [0.0] * n_in, "var": [1.0] * n_in, "epsilon": 1e-8, "clip": 10.0}
    path = write_policy(tmp_path / "p", [(w, b)], norm, "tanh", K_MAX, "cpu-test-2c", "test", 0, {}, stop_levels=LEVELS)
    policy = LearnedK.load(path, device="cpu-test-2c")
    assert policy.action_to_stop == ActionTable(K_MAX, LEVELS).to_stop
    assert policy.choose_k(np.zeros(n_in)) == 3 and policy.stop == StopRule(min_confidence=0.5)
    plain = write_policy(tmp_path / "q", [(w[: K_MAX + 1], b[: K_MAX + 1])], norm, "tanh", K_MAX, "cpu-test-2c", "test",
                         0, {})
    assert "action_to_stop" not in json.loads(plain.read_text())  # k alone: the file as before


def test_the_warm_start_learns_to_stop_where_confidence_predicts_acceptance():
    """No fixed k can draft exactly the run the target will keep; a stop below 0.5 inside the draft does. The
    rollout improvement, offered the (k, stop level) actions, finds it: faster than every static k in replay; offered
    k alone it cannot be."""
    rng = np.random.default_rng(1)
    traces = [_trace(f"t{i}", rng) for i in range(12)]
    cost = _cost()

    def fitted(levels):
        layers, norm, _ = improve_policy(StaticK(2), traces, cost, K_MAX, None, [1], {1: len(traces)}, 40, 1,
                                         [32], "tanh", epochs=300, seed=0, progress=False, stop_levels=levels)
        return as_policy(layers, norm, "tanh", K_MAX, stop_levels=levels)

    with_stop, k_only = fitted(LEVELS), fitted([0.0])
    policies = {f"static:{k}": StaticK(k) for k in range(K_MAX + 1)}
    policies.update({"with-stop": with_stop, "k-only": k_only})
    speed = {name: row["speedup"] for name, row in replay_evaluate(policies, traces, cost, K_MAX).items()}
    best_static = max(speed[f"static:{k}"] for k in range(K_MAX + 1))
    assert speed["with-stop"] > 1.02 * best_static  # (static:2's 1.777; 300 passes of the fit since the observation
    # gained the hybrid's source features: 150 left it at 1.811)
    assert speed["with-stop"] > 1.05 * speed["k-only"]  # (1.676: the runs are independent, k alone cannot follow them)


def test_the_warm_starts_labels_roll_out_one_action_per_distinct_draft():
    """Actions that draft the same tokens (and stop alike) take the same step, so the labels roll out one of them;
    the labels equal a rollout of every action."""
    from specpilot.agents import improve

    traces = [_trace("a", np.random.default_rng(3))]
    improve._start_worker(StaticK(2), None, traces, _cost(), K_MAX, None, 40, (), (), 0.0, 0.0, 0, "rollout",
                          tuple(LEVELS))
    try:
        _, regrets, _ = improve._label_episode((0, 1, [0]))
    finally:
        improve._WORKER.clear()
    env = ReplayEnv(traces, _cost(), k_max=K_MAX, noise=0.0, max_new_tokens=40, stop_levels=LEVELS)
    env.reset(seed=0, options={"trace_indices": [0], "context_len": 0})
    memo = {id(traces[0]): traces[0], id(traces): traces, id(env.cost): env.cost}
    q = np.array([improve._rollout_seconds(env, StaticK(2), a, memo) for a in range(len(env.actions))])
    assert np.allclose(regrets[0], (q - q.min()) / env.credit.unit)
    assert len({env.draft_length(a)[1:] for a in range(len(env.actions))}) < len(env.actions)
