"""PPO as the project runs it (agents.ppo: its env wrapping, normalisation and network) learns: on a small replay env
whose optimal policy is known (hand-made traces: where prompt lookup matches 3 tokens every draft is right, where it
matches 1 every draft is wrong; any k costs the same), PPO started from a poor policy raises its speed to near the
oracle's in a few thousand steps. With the advantage's sign flipped (the negative control) the same run does not,
so the test fails when PPO's update is broken."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import stretch_traces
from stable_baselines3.common.buffers import RolloutBuffer

from specpilot.agents.ppo import load_hyperparams, make_ppo, make_vec_env
from specpilot.decoding.policies import LengthPolicy, StaticK
from specpilot.env.oracle import CostModel, OracleK
from specpilot.env.replay_env import ReplayEnv, replay_evaluate

K, LENGTH, STEPS = 4, 36, 6144


def cost() -> CostModel:
    """A plain step 0.1 s; verifying any k >= 1 drafts 0.18 s (the CPU's shape at one row)."""
    return CostModel([0, 10000], [[0.1] + [0.18] * K] * 2, [0.0, 0.0])


class Agent(LengthPolicy):
    """The PPO model's deterministic choice on the normalised observation (what the export reproduces)."""

    def __init__(self, model, venv):
        self.model, self.venv, self.k_max, self.name = model, venv, K, "ppo"

    def choose_k(self, obs) -> int:
        action, _ = self.model.predict(self.venv.normalize_obs(np.asarray(obs, dtype=np.float32)[None]), deterministic=True)
        return int(action[0])


def train_ppo(steps: int, seed: int = 0):
    traces = stretch_traces(K, 8, LENGTH)
    hp = load_hyperparams("cpu", {"n_steps": 256, "batch_size": 64, "n_epochs": 10, "learning_rate": 0.003,
                                  "net_arch": [32, 32], "gamma": 0.2, "ent_coef": 0.0})
    venv = make_vec_env(lambda: ReplayEnv(traces, cost(), k_max=K, noise=0.0, max_new_tokens=LENGTH), seed)
    model = make_ppo(venv, hp, seed, None)
    with_bias = model.policy.action_net.bias
    with_bias.data[:] = 0.0
    with_bias.data[1] = 4.0  # a poor start: k = 1 everywhere (wasted at match 1, too little at match 3)
    before = fraction_of_oracle(Agent(model, venv), traces)
    if steps:
        model.learn(total_timesteps=steps)
    return before, fraction_of_oracle(Agent(model, venv), traces)


def fraction_of_oracle(policy, traces) -> float:
    c = cost()
    scores = replay_evaluate({"policy": policy, "oracle": OracleK(traces, c, K)}, traces, c, K, None, 1, LENGTH)
    return scores["policy"]["fraction_of_oracle"]


def test_ppo_raises_a_poor_policy_to_near_the_oracle():
    static_one = fraction_of_oracle(StaticK(1), stretch_traces(K, 8, LENGTH))
    before, after = train_ppo(STEPS)
    assert before == pytest.approx(static_one, abs=0.01) and before < 0.85  # the start is the poor policy
    assert after > 0.97, (before, after)


def test_with_the_advantage_sign_flipped_ppo_does_not_learn(monkeypatch):
    compute = RolloutBuffer.compute_returns_and_advantage

    def flipped(self, *args, **kwargs):
        compute(self, *args, **kwargs)
        self.advantages = -self.advantages

    monkeypatch.setattr(RolloutBuffer, "compute_returns_and_advantage", flipped)
    before, after = train_ppo(STEPS)
    assert after < 0.9 and after <= before + 0.02, (before, after)


def test_the_value_net_is_fitted_to_the_warm_starts_returns_and_the_policy_is_untouched():
    """agents.ppo.fit_value_to_policy (YAML `value_prefit_rollouts`): before PPO's first update from a warm start the
    value net learns that policy's returns (explained variance from below 0 to > 0.5 after two
    rollouts at the YAML's `value_prefit_lr`), and the policy network keeps every
    weight, so the first advantages measure the warm start against its own value, not a random net's."""
    import torch

    from specpilot.agents.ppo import fit_value_to_policy

    traces = stretch_traces(K, 8, LENGTH)
    hp = load_hyperparams("cpu", {"n_steps": 256, "batch_size": 64, "net_arch": [32, 32], "gamma": 0.2})
    venv = make_vec_env(lambda: ReplayEnv(traces, cost(), k_max=K, noise=0.0, max_new_tokens=LENGTH), 0)
    model = make_ppo(venv, hp, 0, None)
    model.policy.action_net.bias.data[1] = 4.0  # the "warm start": k = 1
    policy_before = [p.detach().clone() for p in list(model.policy.mlp_extractor.policy_net.parameters())
                     + list(model.policy.action_net.parameters())]
    history = fit_value_to_policy(model, rollouts=2, lr=hp["value_prefit_lr"])
    assert history["explained_variance_before"] < 0.05 and history["explained_variance_after"] > 0.5, history
    after = list(model.policy.mlp_extractor.policy_net.parameters()) + list(model.policy.action_net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(policy_before, after))
    assert model.num_timesteps == 2 * 256  # its env steps count in the run's budget
