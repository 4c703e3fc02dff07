"""BatchTableK: Cohere's hardware-aware dynamic speculation (vLLM's num_speculative_tokens_per_batch_size).

For each profiled batch size b, the k maximising the profiled goodput
    goodput(b, k) = b * E[tokens per row per step | k] / step_seconds(b, k)
where the expected tokens per step come from the draft's recorded acceptance (train-split traces:
E[min(k, a(i), m(i)) + 1] over positions) and the step seconds from the device's cost profile at
that batch size. A batch size between two profiled ones uses the smaller one's k (vLLM's ranges).
The table sees only the batch size: not the text, the context or the counters.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.policies import LengthPolicy, at_or_below, batch_of, context_of
from specpilot.env.oracle import CostModel, Trace
from specpilot.env.replay_env import ReplayEnv


def expected_tokens(traces: list[Trace], k_max: int) -> np.ndarray:
    """E[tokens appended per row per step] for k = 0..k_max over every traced position."""
    matches = np.array([m for t in traces for m in t.matches], dtype=np.int64)
    available = np.array([a for t in traces for a in t.available], dtype=np.int64)
    if matches.size == 0:
        raise SpecPilotError("no traced positions to estimate acceptance from")
    return np.array([np.minimum(np.minimum(k, available), matches).mean() + 1.0 for k in range(k_max + 1)])


def goodput_table(cost: CostModel, traces: list[Trace], k_max: int, context_len: int,
                  batch_sizes: list[int]) -> dict[int, np.ndarray]:
    """{b: goodput in tokens/s for k = 0..k_max}."""
    tokens = expected_tokens(traces, k_max)
    return {b: b * tokens / cost.step_costs(context_len, b)[0][: k_max + 1] for b in batch_sizes}


class BatchTableK(LengthPolicy):
    name = "batch-table"

    def __init__(self, table: dict[int, int], k_max: int):
        if not table:
            raise SpecPilotError("BatchTableK needs at least one (batch size, k) entry")
        self.table = dict(sorted((int(b), int(k)) for b, k in table.items()))
        self.k_max = k_max

    def k_for(self, batch: int) -> int:
        return at_or_below(self.table, batch)

    def choose_k(self, obs) -> int:
        return self.k_for(batch_of(obs))

    @classmethod
    def from_profile(cls, profile: dict, traces: list[Trace], k_max: int, contexts: list[int] | None = None) -> "BatchTableK":
        """Per profiled batch size, the k of the best goodput at the profile's batch context, or (with
        `contexts`, the context lengths the traffic has) of the best goodput over them all (mean seconds)."""
        cost = CostModel.from_profile(profile)
        sizes = profile.get("batch_sizes") or [1]
        context = profile.get("batch_context_len") or profile["context_lens"][0]
        if contexts:
            tables = [goodput_table(cost, traces, min(k_max, cost.k_max), c, sizes) for c in contexts]
            goodput = {b: 1.0 / np.mean([1.0 / t[b] for t in tables], axis=0) for b in sizes}
        else:
            goodput = goodput_table(cost, traces, min(k_max, cost.k_max), context, sizes)
        policy = cls({b: int(np.argmax(g)) for b, g in goodput.items()}, k_max)
        policy.goodput = {b: g.round(3).tolist() for b, g in goodput.items()}
        return policy


class BatchContextTableK(LengthPolicy):
    """The per-batch-size table with a context-length axis (vLLM PR 48944's 5-item entries
    [start_bs, end_bs, start_ctx, end_ctx, k]): per (batch size, context length) cell the k of the best
    profiled goodput; a point between cells takes the cell at or below it in both."""

    name = "batch-context-table"

    def __init__(self, table: dict[tuple[int, int], int], k_max: int):
        if not table:
            raise SpecPilotError("BatchContextTableK needs at least one (batch size, context, k) entry")
        self.table = {(int(b), int(c)): int(k) for (b, c), k in sorted(table.items())}
        self.batches = sorted({b for b, _ in self.table})
        self.contexts = sorted({c for _, c in self.table})
        self.k_max = k_max

    def k_for(self, batch: int, context: int) -> int:
        b = max([x for x in self.batches if x <= batch] or self.batches[:1])
        c = max([x for x in self.contexts if x <= context] or self.contexts[:1])
        return self.table[(b, c)]

    def choose_k(self, obs) -> int:
        return self.k_for(batch_of(obs), context_of(obs))

    @classmethod
    def from_profile(cls, profile: dict, traces: list[Trace], k_max: int, contexts: list[int]) -> "BatchContextTableK":
        cost = CostModel.from_profile(profile)
        sizes = profile.get("batch_sizes") or [1]
        table = {}
        for c in contexts:
            for b, g in goodput_table(cost, traces, min(k_max, cost.k_max), c, sizes).items():
                table[(b, c)] = int(np.argmax(g))
        return cls(table, k_max)

    def vllm_entries(self, max_batch: int, max_context: int) -> list[list[int]]:
        """[[start_bs, end_bs, start_ctx, end_ctx, k], ...] (inclusive) covering 1..max_batch x 0..max_context."""
        entries = []
        contexts = self.contexts + [max_context + 1]
        for lo, hi in zip(contexts, contexts[1:]):
            start = 0 if lo == self.contexts[0] else lo
            for b0, b1, k in vllm_ranges({b: self.k_for(b, lo) for b in range(1, max_batch + 1)}, max_batch):
                entries.append([b0, b1, start, hi - 1, k])
        return entries


def trtllm_schedule(k_by_batch: dict[int, int]) -> dict[int, int]:
    """TensorRT-LLM's `draft_len_schedule` {batch size: k} for a table whose k holds from its batch size up to
    the next one: a key covers the batch sizes up to it, above the largest key speculation is off (so a
    table that drafts at its largest batch size stops drafting above it)."""
    schedule: dict[int, int] = {}
    sizes = sorted(k_by_batch)
    for i, b in enumerate(sizes):
        k = k_by_batch[b]
        last = i + 1 == len(sizes)
        if k > 0 and (last or k_by_batch[sizes[i + 1]] != k):
            schedule[b if last else sizes[i + 1] - 1] = k  # our table holds k up to the next size
    return schedule


def vllm_ranges(k_by_batch: dict[int, int], max_batch: int) -> list[list[int]]:
    """[[start_bs, end_bs, k], ...] (inclusive ranges) covering 1..max_batch, equal neighbours merged."""
    ranges: list[list[int]] = []
    for b in range(1, max_batch + 1):
        k = k_by_batch[b]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, k])
    return ranges


def policy_to_table(policy: LengthPolicy, traces: list[Trace], cost: CostModel, k_max: int, max_batch: int,
                    hardware=None, episodes: int = 8, seed: int = 0,
                    max_new_tokens: int | None = None, context_len: int = 0) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
    """Query a policy on representative observations per batch size: run it in the noise-free replay
    env (the observation builder of training and inference) on `episodes` batches of recorded traces
    at each batch size 1..max_batch and keep its mean k, rounded; `max_new_tokens` is the rows' budget
    (a learned policy's training budget: its remaining-token features mean that). Returns ({b: k}, {b: {k: steps}})."""

    env = ReplayEnv(traces, cost, k_max=k_max, noise=0.0, hardware=hardware, batch_sizes=list(range(1, max_batch + 1)),
                    max_new_tokens=max_new_tokens)
    rng = np.random.default_rng(seed)
    chosen, counts = {}, {}
    for b in range(1, max_batch + 1):
        tally: Counter = Counter()
        for _ in range(episodes):
            obs, _ = env.reset(options={"trace_indices": rng.integers(len(traces), size=b).tolist(), "context_len": context_len})
            policy.reset()
            done = False
            while not done:
                k = policy.choose_k(obs)
                if env.state.batch_size == b:  # rows that finish shrink the batch: count full-size steps only
                    tally[k] += 1
                obs, _, done, _, _ = env.step(k)
                policy.update(env.last_step)
        counts[b] = dict(sorted(tally.items()))
        steps = sum(tally.values())
        # the policy's mean k at this batch size, rounded: a static table cannot switch speculation on
        # and off per step, and the mode of a policy that does (k = 0 often, k = 7 otherwise) is neither
        chosen[b] = int(np.floor(sum(k * n for k, n in tally.items()) / steps + 0.5)) if steps else 0
    return chosen, counts
