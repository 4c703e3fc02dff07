"""Per-step reward and per-episode accounting shared by the real and the replay env.

A batch decodes until its last row ends, so plain decoding's time is not "tokens x plain seconds per
token": plain decoding advances every row by one token per step, its batch shrinking only as rows end.
`plain_batch_seconds` is that time from any state (a function of the rows' remaining tokens); a step
is credited with the plain time it removed, the drop of that potential. Advancing the row with the most
tokens left saves a whole plain step; advancing a row that is ahead saves only the small difference
between a plain step of b and b - 1 rows. Summed over an episode the credit is exactly plain decoding's
time of the batch, so the return measures batch time, not per-row throughput. One row: tokens x plain
step seconds, as before.
"""
from __future__ import annotations

from collections.abc import Callable

REWARDS = ("saved", "speedup")


def plain_batch_seconds(remaining: list[int], plain_step: Callable[[int], float]) -> float:
    """Seconds plain decoding needs to finish rows with these remaining tokens: sum over future steps of
    plain_step(rows still running). `plain_step(b)`: seconds of a plain step of b rows."""
    left = sorted((max(0, int(r)) for r in remaining), reverse=True) + [0]
    return sum((left[j] - left[j + 1]) * plain_step(j + 1) for j in range(len(left) - 1) if left[j] > left[j + 1])


class PlainCredit:
    """Credits each step of an episode with the plain decoding time it removed from the batch: the drop
    of `plain_batch_seconds` over the active rows' remaining tokens. Shared by the real and the replay
    env; `plain_step(context_len, rows)` is the device's plain step seconds (measured or profiled)."""

    def __init__(self, plain_step: Callable[[float, int], float]):
        self.plain_step = plain_step

    def reset(self, state) -> None:
        rows = state.active_rows
        self.context0 = sum(r.length for r in rows) / len(rows)
        self.unit = self.plain_step(self.context0, len(rows))  # a plain step of the episode's batch: the reward's unit
        self.left = self._left(state)

    def take(self, state) -> float:
        """Seconds of plain decoding the step just taken removed (call once after each step)."""
        left = self._left(state)
        saved, self.left = self.left - left, left
        return saved

    def batch_seconds(self, lengths: list[int]) -> float:
        """Plain decoding time of rows generating these numbers of tokens (at the episode's start context)."""
        return plain_batch_seconds(lengths, lambda b: self.plain_step(self.context0, b))

    def _left(self, state) -> float:
        rows = state.active_rows
        context = sum(r.length for r in rows) / len(rows) if rows else self.context0
        return plain_batch_seconds([r.remaining for r in rows], lambda b: self.plain_step(context, b))


def step_reward(tokens: float, seconds: float, plain_step_seconds: float, mode: str = "saved") -> float:
    """The reward of one step, in units of plain decoding steps on this device at this context length.

    "speedup": tokens / seconds / plain tokens-per-second, the step's own speedup. Its sum over an
    episode grows with the number of steps, so an agent maximising the return learns to take more,
    slower steps (all-plain decoding scores N on N tokens; a 2x faster schedule scores ~N/2 x 2.x).
    "saved" (default): tokens - seconds / plain step seconds, the plain steps saved by this step. Its
    sum over an episode is (plain time - policy time) / plain step time: maximising the return is
    exactly minimising decode time, and a plain step scores 0.

    For a batch, `tokens` is the plain time the step removed (see `plain_batch_seconds`) in plain steps
    of the batch, so the same formulas hold.
    """
    if mode == "saved":
        return tokens - seconds / plain_step_seconds
    if mode == "speedup":
        return tokens / seconds * plain_step_seconds
    raise ValueError(f"unknown reward '{mode}'; expected one of {REWARDS}")


class EpisodeStats:
    def __init__(self) -> None:
        self.tokens = self.steps = self.drafted = self.accepted = 0
        self.seconds = self.plain_seconds = 0.0

    def add(self, tokens: int, seconds: float, plain_seconds: float, k: int, accepted: int) -> None:
        """One step: its tokens and seconds, and what plain decoding would have spent on those tokens."""
        self.tokens += tokens
        self.seconds += seconds
        self.plain_seconds += plain_seconds
        self.drafted += k
        self.accepted += accepted
        self.steps += 1

    def summary(self, category: str) -> dict:
        return {
            "tokens_per_s": self.tokens / self.seconds,
            "speedup": self.plain_seconds / self.seconds,
            "mean_k": self.drafted / self.steps,
            "accept_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "category": category,
        }
