"""Per-step reward and per-episode accounting shared by the real and the replay env.

Plain decoding of a batch advances every running row by one token per step; its step j (the j-th new
token of each row that reaches j tokens) costs `plain_step(context, rows)` with rows = how many rows
produce a j-th token and context = the batch's cache width before it: the longest prompt + j - 1 (rows
are left-padded to the longest, and a row that ends leaves the batch but not the width). A row that ends
at EOS before its budget takes no part in the steps after its end. An episode is credited with exactly
that plain time of the same rows to the same ends: plain step j is credited at the policy step after
which it is *complete*, i.e. every row still running has generated at least j tokens (a row that ended
has taken part in all the steps it ever will). Advancing the row furthest behind completes plain steps
and earns credit; advancing a row that is ahead earns nothing until the others catch up. One row: each
new token completes one plain step, credited at its own context length.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

REWARDS = ("saved", "speedup")


def plain_layers_seconds(prompt_lens: Sequence[int], generated: Sequence[int], first: int, last: int,
                         plain_step: Callable[[float, int], float]) -> float:
    """Seconds of plain decoding's steps first..last (1-based) for rows with these prompt lengths that
    generate these numbers of tokens: step j runs the rows with generated >= j at the batch's cache width,
    the longest prompt + j - 1."""
    total, width = 0.0, max(prompt_lens, default=0)
    for j in range(first, last + 1):
        rows = sum(1 for g in generated if g >= j)
        if rows:
            total += plain_step(width + j - 1, rows)
    return total


class PlainCredit:
    """Credits each step of an episode with the plain decoding steps it completed (see the module
    docstring): summed over an episode, exactly plain decoding's time of the same rows to the same ends.
    `plain_step(context_len, rows)` is the device's plain step seconds (measured or profiled)."""

    def __init__(self, plain_step: Callable[[float, int], float]):
        self.plain_step = plain_step

    def reset(self, state) -> None:
        # contexts as the cost sees them (a replay row may sit at a simulated context length)
        self.prompt_lens = [r.context_offset + r.prompt_len for r in state.rows]
        rows = state.active_rows
        self.context0 = max(r.context_len for r in rows)
        self.unit = self.plain_step(self.context0, len(rows))  # a plain step of the episode's batch: the reward's unit
        self.completed = 0

    def take(self, state) -> float:
        """Seconds of plain decoding the step just taken completed (call once after each step)."""
        generated = [r.length - r.prompt_len for r in state.rows]
        running = [generated[i] for i in state.active]
        complete = min(running) if running else max(generated)
        saved = plain_layers_seconds(self.prompt_lens, generated, self.completed + 1, complete, self.plain_step)
        self.completed = max(self.completed, complete)
        return saved

    def batch_seconds(self, generated: list[int]) -> float:
        """Plain decoding time of the episode's rows generating these numbers of tokens."""
        return plain_layers_seconds(self.prompt_lens, generated, 1, max(generated, default=0), self.plain_step)


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
