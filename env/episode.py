"""Per-step reward and per-episode accounting shared by the real and the replay env."""
from __future__ import annotations

REWARDS = ("saved", "speedup")


def step_reward(tokens: int, seconds: float, plain_step_seconds: float, mode: str = "saved") -> float:
    """The reward of one step, in units of plain decoding steps on this device at this context length.

    "speedup": tokens / seconds / plain tokens-per-second, the step's own speedup. Its sum over an
    episode grows with the number of steps, so an agent maximising the return learns to take more,
    slower steps (all-plain decoding scores N on N tokens; a 2x faster schedule scores ~N/2 x 2.x).
    "saved" (default): tokens - seconds / plain step seconds, the plain steps saved by this step. Its
    sum over an episode is (plain time - policy time) / plain step time: maximising the return is
    exactly minimising decode time, and a plain step scores 0.
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
