"""Layer 1: logits -> probabilities -> tokens.

The same `Sampling` is applied to the draft's and the target's logits, so rejection sampling
compares the two distributions that are actually sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecPilotError


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. temperature <= 0 means greedy (argmax) decoding."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecPilotError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecPilotError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecPilotError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Float32 probabilities over the last dimension after temperature, top-k and top-p.

    For greedy decoding this is the plain softmax (used for draft confidences only).
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already cover top_p (the first is always kept)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= sampling.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `probs` (shape (..., V) -> (...))."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
