"""Length policies: how many tokens to draft next. One interface for all of them.

`choose_k(obs)` gets the observation vector of `decoding.observation` (hand-written policies may
ignore it); `update(step)` gets the `StepResult` of the step just run. `stop_below`, when set, asks
the drafter to stop early once its top-1 probability falls below it (confidence-based drafting).
k = 0 turns speculation off for a step (a plain target step).
"""
from __future__ import annotations

import numpy as np

from .errors import SpecPilotError
from .observation import FEATURES

DEFAULT_K_MAX = 8


class LengthPolicy:
    name = "policy"
    k_max = 0
    stop_below: float | None = None

    def reset(self) -> None:
        """A new sequence starts."""

    def choose_k(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    def update(self, step) -> None:
        """Called with the StepResult of every step."""


class NoSpeculation(LengthPolicy):
    name = "none"

    def choose_k(self, obs) -> int:
        return 0


class StaticK(LengthPolicy):
    def __init__(self, k: int):
        self.k = self.k_max = k
        self.name = f"static:{k}"

    def choose_k(self, obs) -> int:
        return self.k


class HeuristicK(LengthPolicy):
    """transformers' assisted-generation schedule: start at 5, +2 after a full accept, else -1 (>= 1)."""

    name = "heuristic"

    def __init__(self, k_max: int = DEFAULT_K_MAX, start: int = 5):
        self.k_max, self.start = k_max, min(start, k_max)
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def choose_k(self, obs) -> int:
        return self.k

    def update(self, step) -> None:
        if step.k and step.accepted == step.k:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, self.k - 1)


class ConfidenceStop(LengthPolicy):
    """Draft up to k_max tokens but stop once the draft's top-1 probability falls below the threshold
    (DISCO / AdaEDL style early exit)."""

    def __init__(self, threshold: float, k_max: int = DEFAULT_K_MAX):
        if not 0.0 <= threshold <= 1.0:
            raise SpecPilotError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.stop_below, self.k_max = threshold, k_max
        self.name = f"confidence:{threshold:g}"

    def choose_k(self, obs) -> int:
        return self.k_max


class MatchLengthK(LengthPolicy):
    """Prompt lookup's own confidence: draft k tokens when the current n-gram match is at least `min_match`
    tokens long, else decode plainly (a longer matched n-gram makes its continuation likelier to be right).

    Reads the observation's `ngram_match_len` (a batch: the mean over its active rows). For a prompt-lookup
    draft only: other drafts report no match (`parse_policy` refuses them when told the draft)."""

    def __init__(self, min_match: float, k: int):
        if min_match <= 0 or k < 1:
            raise SpecPilotError(f"match:N:K needs N > 0 and K >= 1, got N={min_match:g}, K={k}")
        self.min_match, self.k = float(min_match), k
        self.k_max = k
        self.name = f"match:{min_match:g}:{k}"
        self._index = FEATURES.index("ngram_match_len")

    def choose_k(self, obs) -> int:
        return self.k if obs[self._index] >= self.min_match else 0


POLICY_HELP = ("none | static:K | heuristic | confidence:T | match:N[:K] | learned | learned:PATH "
               "(benchmark also: oracle, batch-table)")


def parse_policy(text: str, k_max: int = DEFAULT_K_MAX, **learned_kwargs) -> LengthPolicy:
    """Build a policy from its CLI spelling (see POLICY_HELP)."""
    name, _, arg = text.strip().partition(":")
    try:
        if name == "none" and not arg:
            return NoSpeculation()
        if name == "static":
            k = int(arg)
            if not 0 <= k <= k_max:
                raise SpecPilotError(f"k={k} is outside [0, k_max={k_max}] (raise --k-max to allow it)")
            return StaticK(k)
        if name == "heuristic" and not arg:
            return HeuristicK(k_max)
        if name == "confidence":
            return ConfidenceStop(float(arg), k_max)
        if name == "match":
            n, _, k = arg.partition(":")
            k = int(k) if k else k_max
            if k > k_max:
                raise SpecPilotError(f"k={k} is outside [1, k_max={k_max}] (raise --k-max to allow it)")
            draft = learned_kwargs.get("draft")
            if draft and not str(draft).startswith("ngram"):
                raise SpecPilotError(f"policy '{text}' reads prompt lookup's n-gram match; draft '{draft}' has none "
                                     "(use --draft ngram)")
            return MatchLengthK(float(n), k)
        if name == "learned":
            from .learned import (
                LearnedK,  # learned.py builds on this module (LengthPolicy)
            )

            return LearnedK.load(arg or None, **learned_kwargs)
    except ValueError:
        pass
    raise SpecPilotError(f"unknown policy '{text}'; expected {POLICY_HELP}")
