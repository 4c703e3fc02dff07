"""Per-episode accounting shared by the real and the replay env."""
from __future__ import annotations


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
