"""What one `generate` call returns: the generated ids, its steps and their statistics (decoding/loop.py)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loop import StepResult


@dataclass
class GenerationStats:
    steps: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    mean_k: float
    mean_accepted: float
    accept_rate: float
    accept_counts: dict[int, int]
    prefill_s: float = 0.0
    policy_s: float = 0.0
    """Time spent building observations and choosing k (the controller's overhead)."""

    @classmethod
    def from_steps(cls, steps: list[StepResult], seconds: float, prefill_s: float = 0.0, policy_s: float = 0.0) -> "GenerationStats":
        n = len(steps)
        new = sum(len(s.new_tokens) for s in steps)
        drafted = sum(s.k * s.batch_size for s in steps)
        accepted = sum(sum(s.accepted_rows) for s in steps)
        row_steps = sum(s.batch_size for s in steps)
        return cls(
            steps=n,
            new_tokens=new,
            seconds=seconds,
            tokens_per_s=new / seconds if seconds > 0 else 0.0,
            mean_k=sum(s.k for s in steps) / n if n else 0.0,
            mean_accepted=accepted / row_steps if row_steps else 0.0,
            accept_rate=accepted / drafted if drafted else 0.0,
            accept_counts=dict(sorted(Counter(a for s in steps for a in s.accepted_rows).items())),
            prefill_s=prefill_s,
            policy_s=policy_s,
        )

    def as_dict(self) -> dict:
        return {
            "steps": self.steps, "new_tokens": self.new_tokens, "seconds": round(self.seconds, 6),
            "tokens_per_s": round(self.tokens_per_s, 3), "mean_k": round(self.mean_k, 4),
            "mean_accepted": round(self.mean_accepted, 4), "accept_rate": round(self.accept_rate, 4),
            "accept_counts": {str(a): c for a, c in self.accept_counts.items()},
            "prefill_s": round(self.prefill_s, 6), "policy_s": round(self.policy_s, 6),
        }


@dataclass
class Generation:
    token_ids: list
    """The generated ids: a list of ints for one prompt, one such list per row for a batch."""
    steps: list[StepResult]
    stats: GenerationStats
