"""ReplayEnv: the real env's spaces, driven by recorded acceptance traces and a device cost profile.

Greedy decoding makes acceptance independent of the schedule (see env/oracle.py), so a step
from position i with action k drafts k' = min(k, a(i)) tokens and accepts min(k', m(i)); its time is
the device's profiled step cost t(k', context) times log-normal noise of the measured size. The one
observation builder sees the same kind of StepResult as in the real loop, so a policy pre-trained
here runs unchanged on the real env. Thousands of times faster than the real loop.

What the replay must not leak: a row's budget is `max_new_tokens`, as in the real loop, though the
trace knows where the row will end (EOS); `remaining` counts to the budget and the row simply stops
at its trace's end. With `speed_jitter` J each episode runs the whole profile J^u times faster or
slower (u uniform in [-1, 1]): the machine's speed drifts, so the measured-cost features must not be
read as absolute (the reward, in plain steps, is unchanged by it).

A profile's cost curve is one draw: on the CPU two profiles of the same machine a day apart, or a profile and
the real loop an hour later, disagree on what a verify pass of k tokens costs against a plain step by 5-10%
per k and up to 15% in level. With `cost_jitter` s each episode scales the cost of every k >= 1 by
exp(s * (u + z_k)), u and z_k standard normal (u shared by the k's of the episode, z_k each k's own); plain
steps keep their price. A policy trained so cannot lean on a bump of the curve that the next measurement moves.

Machine conditions (`conditions`): a shared or throttled machine changes what a step costs, and not only
by a common factor (a power cap slows the compute-bound verify passes of a large batch more than the
memory-bound plain steps). Each condition is a cost profile measured or simulated under it plus the
hardware counters as they read under it; each episode draws one, so the counters carry what the policy
needs to know about the machine. The reward stays exact: plain decoding is priced under the same condition.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from specpilot.decoding.drafters import StopRule, match_statistics
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import HW_FEATURES
from specpilot.decoding.loop import BatchView, RowView, StepResult
from specpilot.decoding.observation import ObservationBuilder
from specpilot.decoding.policies import ActionTable
from specpilot.decoding.prompts import batches_of

from .episode import EpisodeStats, PlainCredit, step_reward
from .oracle import CostModel, Trace
from .sources import SourceView, head_tokens, source_view


class FixedMonitor:
    """Hardware counters as recorded with the profile (replay has no live hardware to read)."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values, dtype=np.float32)

    def read(self) -> np.ndarray:
        return self.values


class TracedDraft:
    """Answers the observation builder's `peek` from the traces, as the live drafter would."""

    def __init__(self, state: "ReplayState"):
        self.state = state

    def peek(self, context, k: int, row: int = 0) -> tuple[int, int]:
        r = self.state.rows[row]
        i = r.length - r.prompt_len
        if i >= len(r.trace.available):  # the episode has ended
            return 0, 0
        return (r.trace.match_lens[i] if r.trace.match_lens else 0), min(k, r.trace.available[i])

    def match_stats(self, context, row: int = 0) -> tuple[int, int, float]:
        """The live prompt-lookup drafter's match statistics, from the trace's tokens (memoised on the trace:
        the same position always reads the same)."""
        r = self.state.rows[row]
        if not r.trace.ngram_n:  # a model draft's trace: its live drafter has no match statistics
            return 0, 0, 0.0
        memo = r.trace.__dict__.setdefault("_match_stats", {})
        if r.length not in memo:
            memo[r.length] = match_statistics(r.buffer[: r.length], r.trace.ngram_n)
        return memo[r.length]


@dataclass
class ReplayRow(RowView):
    trace: Trace
    buffer: np.ndarray
    length: int
    prompt_len: int
    max_new_tokens: int
    end: int
    """Tokens this row generates (its trace's length within the budget); `max_new_tokens` is the budget."""
    done: bool = False
    context_offset: int = 0
    """Simulated tokens before the prompt: the row's context is context_offset + length."""


@dataclass
class ReplayState(BatchView):
    """The replayed batch (usually one row), shaped like decoding.loop.DecodeState for the observer."""

    rows: list[ReplayRow]
    active: list[int]
    draft: TracedDraft | None = None
    width: int = 0
    """The context the batch's next step runs at: the cache's width (+ the token fed), as in the real loop,
    where rows are left-padded to the longest and each step keeps max(accepted) + 1 slots of every row.
    One row: its context length."""


@dataclass
class MachineCondition:
    """One machine condition of the replay env: its step costs and its counters (decoding.hardware.HW_FEATURES)."""

    name: str
    cost: CostModel
    hardware: np.ndarray


class ReplayEnv(gym.Env):
    """With `batch_sizes`, each episode draws a batch size and that many traces: one k per step for
    the batch, each row accepting min(k, a_r, m_r) tokens, the step costing the profiled batch cost of
    the widest row's draft at the batch's cache width (the longest row's context and the slots kept since:
    what a left-padded batch runs at); a step is credited with the plain decoding time it removed from the batch
    (`env.episode.PlainCredit`), in plain steps of the episode's batch."""

    metadata = {"render_modes": []}

    def __init__(self, traces: list[Trace], cost: CostModel, k_max: int = 8, noise: float = 0.05,
                 hardware: np.ndarray | None = None, max_new_tokens: int | None = None, reward: str = "saved",
                 batch_sizes: tuple[int, ...] | list[int] = (1,), speed_jitter: float = 1.0,
                 context_lens: tuple[int, ...] | list[int] = (), conditions: list[MachineCondition] = (),
                 hardware_noise: float = 0.0, cost_jitter: float = 0.0, stop_levels=(0.0,), sources=(None,)):
        super().__init__()
        if not traces:
            raise SpecPilotError("ReplayEnv needs at least one trace")
        if cost.k_max < k_max:
            raise SpecPilotError(f"the cost profile covers k <= {cost.k_max}, the env needs k_max = {k_max}")
        self.batch_sizes = [int(b) for b in batch_sizes]
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise SpecPilotError(f"batch sizes must be >= 1, got {batch_sizes}")
        if max(self.batch_sizes) > 1 and cost.max_batch == 1:
            raise SpecPilotError("the cost profile has no batch sizes; run scripts/profile_device.py --batch-sizes 1,2,4,8,16")
        self.traces, self.cost, self.k_max, self.noise = traces, cost, k_max, noise
        # machine conditions an episode draws from (option "condition": a name); none given: the one profile
        self.conditions = list(conditions)
        for condition in self.conditions:
            if condition.cost.k_max < k_max:
                raise SpecPilotError(f"the cost profile of condition '{condition.name}' covers k <= {condition.cost.k_max}")
            if max(self.batch_sizes) > 1 and condition.cost.max_batch == 1:
                raise SpecPilotError(f"the cost profile of condition '{condition.name}' has no batch sizes")
        self.condition = "default"
        if hardware_noise < 0:
            raise SpecPilotError(f"hardware_noise is a standard deviation >= 0, got {hardware_noise}")
        self.hardware_noise = float(hardware_noise)
        self.max_new_tokens, self.reward = max_new_tokens, reward
        if speed_jitter < 1.0:
            raise SpecPilotError(f"speed_jitter is a factor >= 1 (1 = off), got {speed_jitter}")
        self.speed_jitter, self.speed = float(speed_jitter), 1.0
        if cost_jitter < 0:
            raise SpecPilotError(f"cost_jitter is a standard deviation >= 0, got {cost_jitter}")
        self.cost_jitter, self.shape = float(cost_jitter), np.ones(k_max + 1)
        # simulated context lengths (e.g. a GPU profile's 4k-32k): an episode draws one, each row's context starts
        # there (its trace's tokens after it); the cost is taken at that context, the acceptance from the trace
        self.context_lens = [int(c) for c in context_lens]
        self.hardware = np.asarray(hardware if hardware is not None else np.zeros(len(HW_FEATURES)), dtype=np.float32)
        self.monitor = FixedMonitor(self.hardware)
        self.observer = ObservationBuilder(k_max, monitor=self.monitor)
        # plain decoding priced by the episode's cost model (its machine condition), at this episode's speed
        self.credit = PlainCredit(lambda context, batch: self.speed * float(self.cost.step_costs(context, batch)[0][0]))
        # an action is k, or with several stop levels (k, the top-1 probability below which the draft stops)
        # ... and for a hybrid drafter's traces (env.sources) with `sources`, (source, k, stop level) triples
        self.actions = ActionTable(k_max, stop_levels, sources)
        if tuple(sources) != (None,) and not all(t.sources for t in traces):
            raise SpecPilotError("actions over draft sources need the hybrid drafter's traces (profile_device.py --draft hybrid)")
        self.action_space = gym.spaces.Discrete(len(self.actions))
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(len(self.observer.names),), dtype=np.float32)
        self.state: ReplayState | None = None
        self.stop: StopRule | None = None
        """The stop rule inside the draft for the next step (`replay_episode` sets the policy's before each step)."""
        self.source: str | None = None
        """A hybrid drafter's source for the next step (`replay_episode` sets the policy's; None: its default),
        read from the traces' `sources` (env.sources); ignored by the traces of a single draft."""

    def _row(self, trace: Trace) -> ReplayRow:
        budget = len(trace.output_ids) if self.max_new_tokens is None else self.max_new_tokens
        return ReplayRow(trace, np.asarray(trace.prompt_ids + trace.output_ids, dtype=np.int64), len(trace.prompt_ids),
                         len(trace.prompt_ids), budget, min(budget, len(trace.output_ids)))

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "trace_indices" in options:
            indices = [int(i) for i in options["trace_indices"]]
        elif "trace_index" in options:
            indices = [int(options["trace_index"])]
        else:
            batch = int(options.get("batch_size", 0)) or (
                self.batch_sizes[0] if len(self.batch_sizes) == 1 else int(self.np_random.choice(self.batch_sizes)))
            indices = [int(i) for i in self.np_random.integers(len(self.traces), size=batch)]
        rows = [self._row(self.traces[i]) for i in indices]
        context = int(options.get("context_len", 0)) or (
            int(self.np_random.choice(self.context_lens)) if self.context_lens else 0)
        for r in rows:
            r.context_offset = max(0, context - r.prompt_len)
        if self.speed_jitter > 1.0:
            self.speed = float(self.speed_jitter ** self.np_random.uniform(-1.0, 1.0))
        if self.cost_jitter:
            self.shape = cost_shape(self.np_random, self.k_max, self.cost_jitter)
        self._draw_condition(options.get("condition"))
        self.trace = rows[0].trace
        self.state = ReplayState(rows, list(range(len(rows))), width=max(r.context_len for r in rows))
        self.state.draft = TracedDraft(self.state)
        self.observer.reset(self.state)
        self.episode = EpisodeStats()
        self.credit.reset(self.state)
        info = {"question_id": self.trace.question_id, "category": self.trace.category, "batch_size": len(rows),
                "condition": self.condition}
        return self.observer.build(self.state), info

    def _draw_condition(self, name: str | None) -> None:
        """Set this episode's cost model and counters: the named condition, else one drawn uniformly (with
        `hardware_noise`, each counter read off by that standard deviation for the episode)."""
        if not self.conditions:
            if name not in (None, "default"):
                raise SpecPilotError(f"condition '{name}' asked of a replay env without conditions")
            values = self.hardware
        else:
            names = [c.name for c in self.conditions]
            if name is not None and name not in names:
                raise SpecPilotError(f"unknown condition '{name}'; this env has {', '.join(names)}")
            chosen = self.conditions[names.index(name) if name is not None else int(self.np_random.integers(len(names)))]
            self.cost, self.condition, values = chosen.cost, chosen.name, np.asarray(chosen.hardware, dtype=np.float32)
        if self.hardware_noise:
            values = np.clip(values + self.hardware_noise * self.np_random.standard_normal(values.shape), 0.0, None)
        self.monitor.values = np.asarray(values, dtype=np.float32)

    def draft_length(self, action) -> tuple[int, int, bool]:
        """(k asked, tokens the draft will propose, whether it stops early) for this action in the current state: k
        within the budget, cut where the action's (or `stop`'s) rule stops the draft. Two actions with the same
        (tokens, stopped) take the same step (the warm start's rollouts run one of them)."""
        state = self.state
        asked, stop = self.actions.decode(action, self.stop)
        source = self.actions.source(action, self.source)
        k = max(0, min(asked, state.remaining - 1))
        stopped = False  # the draft ran one more step than it kept: the one whose token it stopped before
        if stop is not None and k:
            k, stopped = stop_depth(stop, [(source_view(r.trace, source), r.length - r.prompt_len)
                                           for r in state.active_rows], k)
        return asked, k, stopped

    def step(self, action):
        state = self.state
        if state is None or state.done:
            raise SpecPilotError("call reset() before step() (the episode has ended)")
        rows = state.active_rows
        batch = len(rows)
        asked, k, stopped = self.draft_length(action)
        source = self.actions.source(action, self.source)  # the action's, else the policy's (replay_episode)
        drafted_rows, accepted_rows, new_rows = [], [], []
        views = [source_view(r.trace, source) for r in rows]
        for r, view in zip(rows, views):
            i = r.length - r.prompt_len
            drafted = min(k, view.available[i])
            drafted_rows.append(drafted)
            accepted_rows.append(min(drafted, view.matches[i]))
        drafted = max(drafted_rows)  # rows with fewer proposals are padded to the widest
        context = sum(r.context_len for r in rows) / batch  # what the observation reads (as the real loop's step)
        table, draft_per_token = self.cost.step_costs(state.width, batch)  # what the step costs
        noise = float(np.exp(self.noise * self.np_random.standard_normal())) if self.noise else 1.0
        noise *= self.speed
        extra = draft_per_token * noise if stopped else 0.0
        first = rows[0].trace, rows[0].length - rows[0].prompt_len
        # a hybrid's drafting is priced by its source (env.sources: lookup tokens free, copied ones read by the head)
        head = head_tokens(first[0], source, first[1], drafted)
        seconds = (table[drafted] - draft_per_token * (drafted - head)) * self.shape[drafted] * noise + extra
        draft_s = min(draft_per_token * head * noise + extra, seconds)
        positions = [r.length - r.prompt_len for r in rows]  # each row's position before this step
        for r, accepted in zip(rows, accepted_rows):
            n_new = min(accepted + 1, r.end - (r.length - r.prompt_len))
            new_rows.append(r.buffer[r.length : r.length + n_new].tolist())
            r.length += n_new
            r.done = r.length - r.prompt_len >= r.end
        trace, i = first
        step = StepResult(k=drafted, k_requested=asked,
                          accepted=accepted_rows[0] if batch == 1 else sum(accepted_rows) / batch,
                          new_tokens=[t for new in new_rows for t in new],
                          draft_s=draft_s, verify_s=seconds - draft_s,
                          confidences=batch_means([(v.confidences, p) for v, p in zip(views, positions)], drafted),
                          entropies=batch_means([(v.entropies, p) for v, p in zip(views, positions)], drafted),
                          match_len=trace.match_lens[i] if trace.match_lens else 0, context_len=round(context),
                          accepted_rows=accepted_rows, new_rows=new_rows,
                          source=(source or "extend") if trace.sources and drafted else None)
        state.width += max(accepted_rows) + 1
        state.active = [j for j in state.active if not state.rows[j].done]
        self.observer.push(step)
        self.last_step = step
        tokens = len(step.new_tokens)
        saved = self.credit.take(state)  # plain decoding time this step removed
        reward = step_reward(saved / self.credit.unit, seconds, self.credit.unit, self.reward)
        self.episode.add(tokens, seconds, saved, drafted * batch, sum(accepted_rows))
        if state.done:  # as in the real env: plain decoding's time for the rows' true lengths
            self.episode.plain_seconds = self.credit.batch_seconds([r.end for r in state.rows])
        info = {"k": drafted, "accepted": step.accepted, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds, "batch_size": batch}
        if state.done:
            info["spec_episode"] = self.episode.summary(self.trace.category)
        return self.observer.build(state), float(reward), state.done, False, info


def stop_depth(stop: StopRule, rows: list[tuple[Trace | SourceView, int]], k: int) -> tuple[int, bool]:
    """(tokens, stopped): how many tokens a batch's model draft proposes under `stop` when asked for k, and whether it
    stopped early (then it ran one draft step more than it kept). It stops before depth d when every row would
    (`StopRule.stops`) by its trace's draft probability and entropy there; a row whose trace has no token at depth d
    counts as stopping. Exact for greedy traces (the drafts do not depend on the stop)."""
    for d in range(k):
        confidences, entropies = [], []
        for trace, i in rows:
            if i < len(trace.confidences) and d < len(trace.confidences[i]) and d < trace.available[i]:
                confidences.append(trace.confidences[i][d])
                entropies.append(trace.entropies[i][d] if i < len(trace.entropies) and d < len(trace.entropies[i]) else 0.0)
            else:
                confidences.append(-1.0)  # no token here: stops whatever the rule
                entropies.append(math.inf)
        if stop.stops(confidences, entropies):
            return d, True
    return k, False


def batch_means(per_row: list[tuple[list[list[float]], int]], drafted: int) -> list[float]:
    """What the real loop reports of a batch's draft (its drafters' confidences and entropies): per drafted depth the mean
    over the rows that proposed a token there, from each row's trace at its position; [] when the traces hold none."""
    out = []
    for d in range(drafted):
        values = [values_at[p][d] for values_at, p in per_row if values_at and p < len(values_at) and d < len(values_at[p])]
        if not values:
            break
        out.append(sum(values) / len(values))
    return out


def replay_steps_per_second(env: ReplayEnv, steps: int = 20000, seed: int = 0) -> float:
    """Env steps per second of the replay env under random actions (what PPO pre-training gets)."""
    rng = np.random.default_rng(seed)
    actions = rng.integers(0, env.action_space.n, size=steps)
    env.reset(seed=seed)
    t0 = time.perf_counter()
    for action in actions:
        _, _, done, _, _ = env.step(int(action))
        if done:
            env.reset()
    return steps / (time.perf_counter() - t0)


def cost_shape(rng: np.random.Generator, k_max: int, jitter: float) -> np.ndarray:
    """One draw of the per-k cost factors of `cost_jitter`: exp(jitter * (u + z_k)) for k = 1..k_max, u shared
    and z_k each k's own (standard normal), 1 for k = 0 (a plain step keeps its price)."""
    z = rng.standard_normal(k_max + 2)
    shape = np.exp(jitter * (z[0] + z[1:]))
    shape[0] = 1.0
    return shape


def replay_episode(env: ReplayEnv, policy, trace_indices: list[int], context_len: int = 0,
                   condition: str | None = None) -> EpisodeStats:
    """One replayed batch of these traces under `policy` (reset, then choose_k / update every step), its rows'
    contexts starting at `context_len` when it is given (a simulated long context), under `condition`."""
    obs, _ = env.reset(options={"trace_indices": trace_indices, "context_len": context_len, "condition": condition})
    policy.reset()
    done = False
    while not done:
        k = policy.choose_k(obs)
        env.stop = getattr(policy, "stop", None)  # read after choose_k, as the real loop does
        env.source = getattr(policy, "source", None)
        obs, _, done, _, _ = env.step(k)
        policy.update(env.last_step)
    env.stop = env.source = None
    return env.episode


def replay_evaluate(policies: dict, traces: list[Trace], cost: CostModel, k_max: int,
                    hardware: np.ndarray | None = None, batch_size: int = 1,
                    max_new_tokens: int | None = None, context_len: int = 0,
                    shape: np.ndarray | None = None) -> dict[str, dict]:
    """Noise-free speedup over plain decoding of each policy on the traces, by the device's cost model.

    The same replay env PPO pre-trains on, without noise: a policy's number here depends only on its
    choices, so policies (and the oracle, which the replay reproduces exactly) compare free of timing
    noise. With batch_size B the traces are replayed B at a time (consecutive groups) as batches.
    `max_new_tokens`: the generation budget the rows see (as in the real loop; default: each trace's length).
    `context_len`: the rows' simulated context (their traces' tokens after it; 0 = the prompts' own).
    `shape`: per-k factors (k = 0..k_max) on the profile's step costs, one `cost_shape` draw (None = the profile).
    """

    env = ReplayEnv(traces, cost, k_max=k_max, noise=0.0, hardware=hardware, batch_sizes=[batch_size],
                    max_new_tokens=max_new_tokens)
    if shape is not None:
        if len(shape) != k_max + 1:
            raise SpecPilotError(f"a cost shape has one factor per k = 0..{k_max}, got {len(shape)}")
        env.shape = np.asarray(shape, dtype=np.float64)
    groups = batches_of(len(traces), batch_size)
    results = {}
    for name, policy in policies.items():
        if batch_size > 1 and hasattr(policy, "prepare"):
            continue  # the oracle's schedule is per sequence
        seconds = plain = 0.0
        drafted = accepted = 0
        for group in groups:
            if hasattr(policy, "prepare"):
                policy.prepare(traces[group[0]].question_id)
            replay_episode(env, policy, group, context_len)
            seconds += env.episode.seconds
            plain += env.episode.plain_seconds
            drafted += env.episode.drafted
            accepted += env.episode.accepted
        results[name] = {"speedup": plain / seconds, "accept_rate": accepted / drafted if drafted else 0.0}
    if "oracle" in results:
        for row in results.values():
            row["fraction_of_oracle"] = row["speedup"] / results["oracle"]["speedup"]
    return results
