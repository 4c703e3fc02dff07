"""ReplayEnv: the real env's spaces, driven by recorded acceptance traces and a device cost profile.

Greedy decoding makes acceptance independent of the schedule (see decoding/oracle.py), so a step
from position i with action k drafts k' = min(k, a(i)) tokens and accepts min(k', m(i)); its time is
the device's profiled step cost t(k', context) times log-normal noise of the measured size. The one
observation builder sees the same kind of StepResult as in the real loop, so a policy pre-trained
here runs unchanged on the real env. Thousands of times faster than the real loop.
"""
from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from decoding.errors import SpecPilotError
from decoding.loop import StepResult
from decoding.observation import ObservationBuilder
from decoding.oracle import CostModel, Trace

from .episode import EpisodeStats, step_reward


class FixedMonitor:
    """Hardware counters as recorded with the profile (replay has no live hardware to read)."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, dtype=np.float32)

    def read(self) -> np.ndarray:
        return self.values


class TracedDraft:
    """Answers the observation builder's `peek` from the trace, as the live drafter would."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.state: "ReplayState | None" = None

    def peek(self, context, k: int) -> tuple[int, int]:
        i = self.state.length - self.state.prompt_len
        if i >= len(self.trace.available):  # the episode has ended
            return 0, 0
        return (self.trace.match_lens[i] if self.trace.match_lens else 0), min(k, self.trace.available[i])


@dataclass
class ReplayState:
    buffer: np.ndarray
    length: int
    prompt_len: int
    max_new_tokens: int
    draft: TracedDraft | None = None
    done: bool = False

    @property
    def context(self) -> np.ndarray:
        return self.buffer[: self.length]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (self.length - self.prompt_len)

    @property
    def generated(self) -> list[int]:
        return self.buffer[self.prompt_len : self.length].tolist()


class ReplayEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, traces: list[Trace], cost: CostModel, k_max: int = 8, noise: float = 0.05,
                 hardware: np.ndarray | None = None, max_new_tokens: int | None = None, reward: str = "saved"):
        super().__init__()
        if not traces:
            raise SpecPilotError("ReplayEnv needs at least one trace")
        if cost.k_max < k_max:
            raise SpecPilotError(f"the cost profile covers k <= {cost.k_max}, the env needs k_max = {k_max}")
        self.traces, self.cost, self.k_max, self.noise = traces, cost, k_max, noise
        self.max_new_tokens, self.reward = max_new_tokens, reward
        from decoding.hardware import HW_FEATURES

        monitor = FixedMonitor(hardware if hardware is not None else np.zeros(len(HW_FEATURES), dtype=np.float32))
        self.observer = ObservationBuilder(k_max, monitor=monitor)
        self.action_space = gym.spaces.Discrete(k_max + 1)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(len(self.observer.names),), dtype=np.float32)
        self.state: ReplayState | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        index = int(options["trace_index"]) if options and "trace_index" in options else int(self.np_random.integers(len(self.traces)))
        self.trace = trace = self.traces[index]
        n = len(trace.output_ids) if self.max_new_tokens is None else min(self.max_new_tokens, len(trace.output_ids))
        self.state = ReplayState(np.asarray(trace.prompt_ids + trace.output_ids, dtype=np.int64), len(trace.prompt_ids),
                                 len(trace.prompt_ids), n, TracedDraft(trace))
        self.state.draft.state = self.state
        self.observer.reset(self.state)
        self.episode = EpisodeStats()
        return self.observer.build(self.state), {"question_id": trace.question_id, "category": trace.category}

    def step(self, action):
        state, trace = self.state, self.trace
        if state is None or state.done:
            raise SpecPilotError("call reset() before step() (the episode has ended)")
        i = state.length - state.prompt_len
        k = max(0, min(int(action), state.remaining - 1))
        drafted = min(k, trace.available[i])
        accepted = min(drafted, trace.matches[i])
        table, draft_per_token = self.cost.step_costs(state.length)
        noise = float(np.exp(self.noise * self.np_random.standard_normal())) if self.noise else 1.0
        seconds = table[drafted] * noise
        draft_s = min(draft_per_token * drafted * noise, seconds)
        n_new = min(accepted + 1, state.remaining)
        new_tokens = state.buffer[state.length : state.length + n_new].tolist()
        step = StepResult(k=drafted, k_requested=int(action), accepted=accepted, new_tokens=new_tokens,
                          draft_s=draft_s, verify_s=seconds - draft_s,
                          confidences=trace.confidences[i][:drafted] if trace.confidences else [],
                          entropies=trace.entropies[i][:drafted] if trace.entropies else [],
                          match_len=trace.match_lens[i] if trace.match_lens else 0, context_len=state.length)
        state.length += n_new
        state.done = state.remaining <= 0
        self.observer.push(step)
        self.last_step = step
        plain = table[0]
        reward = step_reward(n_new, seconds, plain, self.reward)
        self.episode.add(n_new, seconds, plain * n_new, drafted, accepted)
        info = {"k": drafted, "accepted": accepted, "tokens": n_new, "seconds": seconds, "tokens_per_s": n_new / seconds}
        if state.done:
            info["spec_episode"] = self.episode.summary(trace.category)
        return self.observer.build(state), float(reward), state.done, False, info


def replay_steps_per_second(env: ReplayEnv, steps: int = 20000, seed: int = 0) -> float:
    """Env steps per second of the replay env under random actions (what PPO pre-training gets)."""
    import time

    rng = np.random.default_rng(seed)
    actions = rng.integers(0, env.action_space.n, size=steps)
    env.reset(seed=seed)
    t0 = time.perf_counter()
    for action in actions:
        _, _, done, _, _ = env.step(int(action))
        if done:
            env.reset()
    return steps / (time.perf_counter() - t0)


def replay_evaluate(policies: dict, traces: list[Trace], cost: CostModel, k_max: int,
                    hardware: np.ndarray | None = None) -> dict[str, dict]:
    """Noise-free speedup over plain decoding of each policy on the traces, by the device's cost model.

    The same replay env PPO pre-trains on, without noise: a policy's number here depends only on its
    choices, so policies (and the oracle, which the replay reproduces exactly) compare free of timing noise.
    """
    env = ReplayEnv(traces, cost, k_max=k_max, noise=0.0, hardware=hardware)
    results = {}
    for name, policy in policies.items():
        seconds = plain = 0.0
        drafted = accepted = 0
        for index, trace in enumerate(traces):
            if hasattr(policy, "prepare"):
                policy.prepare(trace.question_id)
            obs, _ = env.reset(options={"trace_index": index})
            policy.reset()
            done = False
            while not done:
                obs, _, done, _, _ = env.step(policy.choose_k(obs))
                policy.update(env.last_step)
            seconds += env.episode.seconds
            plain += env.episode.plain_seconds
            drafted += env.episode.drafted
            accepted += env.episode.accepted
        results[name] = {"speedup": plain / seconds, "accept_rate": accepted / drafted if drafted else 0.0}
    if "oracle" in results:
        for row in results.values():
            row["fraction_of_oracle"] = row["speedup"] / results["oracle"]["speedup"]
    return results
