"""Length policies: how many tokens to draft next. One interface for all of them.

`choose_k(obs)` gets the observation vector of `decoding.observation` (hand-written policies may
ignore it); `update(step)` gets the `StepResult` of the step just run. `stop_below`, when set, asks
the drafter to stop early once its top-1 probability falls below it (confidence-based drafting).
k = 0 turns speculation off for a step (a plain target step).
"""
from __future__ import annotations

import math
from collections import deque

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


def at_or_below(table: dict, batch: int):
    """The value of the largest key <= batch in a table sorted by batch size (the first one's below all keys)."""
    chosen = next(iter(table.values()))
    for size, value in table.items():
        if size <= batch:
            chosen = value
    return chosen


def batch_of(obs) -> int:
    """The batch size an observation describes (its `batch_size_log` feature)."""
    return max(1, int(round(math.exp(float(obs[_BATCH])))))


def context_of(obs) -> int:
    """The context length an observation describes (its `context_len_log` feature; a batch's mean of logs)."""
    return max(0, int(round(math.expm1(float(obs[_CONTEXT])))))


_BATCH = FEATURES.index("batch_size_log")
_CONTEXT = FEATURES.index("context_len_log")


class SGLangAdaptiveK(LengthPolicy):
    """SGLang's `--speculative-adaptive` (`--speculative-adaptive-config`): k follows an exponential
    moving average of the accepted length. Defaults are SGLang's: `candidate_steps` [1, 3, 7],
    `ema_alpha` 0.2, `update_interval` 5, `warmup_batches` 10, `down_hysteresis` -0.25,
    `up_hysteresis` 0.0, one state per batch size (SGLang keeps per-batch-size buckets).

    After every step that drafted, EMA <- alpha * accept_length + (1 - alpha) * EMA (the first
    observation sets it), where accept_length counts the accepted drafts plus the target's own token, as
    SGLang reports it. After the warm-up, every `update_interval` steps the target is EMA + 1: k moves up
    to the next candidate while target >= that candidate + up_hysteresis, and down to the previous one
    while target < the current k + down_hysteresis (so a full accept at k = 1 climbs to 3, and three
    tokens a step at k = 7 fall back to 3). It
    starts at the largest candidate (SGLang's configured speculative_num_steps) and never turns
    speculation off. k is capped at k_max."""

    def __init__(self, candidates=(1, 3, 7), alpha: float = 0.2, update_interval: int = 5, warmup: int = 10,
                 down_hysteresis: float = -0.25, up_hysteresis: float = 0.0, k_max: int = DEFAULT_K_MAX):
        candidates = sorted({int(c) for c in candidates})
        if not candidates or candidates[0] < 1 or not 0.0 < alpha <= 1.0 or update_interval < 1 or warmup < 0:
            raise SpecPilotError(f"sglang-adaptive needs candidates >= 1, 0 < alpha <= 1, interval >= 1, warmup >= 0; "
                                 f"got {candidates}, {alpha}, {update_interval}, {warmup}")
        self.candidates, self.alpha = candidates, float(alpha)
        self.update_interval, self.warmup = int(update_interval), int(warmup)
        self.down, self.up = float(down_hysteresis), float(up_hysteresis)
        self.k_max = min(k_max, candidates[-1])
        self.name = "sglang-adaptive" + ("" if (candidates, alpha) == ([1, 3, 7], 0.2)
                                         else ":" + "/".join(map(str, candidates)) + f":{alpha:g}")
        self.reset()

    def reset(self) -> None:
        self.buckets: dict[int, list] = {}  # batch size -> [candidate index, EMA or None, steps seen]

    def _bucket(self, batch: int) -> list:
        return self.buckets.setdefault(batch, [len(self.candidates) - 1, None, 0])

    def choose_k(self, obs) -> int:
        return min(self.k_max, self.candidates[self._bucket(batch_of(obs))[0]])

    def update(self, step) -> None:
        if step.k <= 0:
            return
        bucket = self._bucket(len(step.accepted_rows))
        accepted = float(step.accepted) + 1.0  # accept_length: the accepted drafts and the target's token
        bucket[1] = accepted if bucket[1] is None else self.alpha * accepted + (1.0 - self.alpha) * bucket[1]
        bucket[2] += 1
        if bucket[2] <= self.warmup or (bucket[2] - self.warmup) % self.update_interval:
            return
        target, i = bucket[1] + 1.0, bucket[0]
        while i + 1 < len(self.candidates) and target >= self.candidates[i + 1] + self.up:
            i += 1
        while i > 0 and target < self.candidates[i] + self.down:
            i -= 1
        bucket[0] = i


class TrtllmK(LengthPolicy):
    """TensorRT-LLM's `draft_len_schedule` ({batch size: k}; k = 0 above the largest key) with its
    acceptance cut-off (`acceptance_rate_window_size`, `acceptance_rate_threshold`): once the rolling
    acceptance rate (accepted / drafted over the last `window` steps that drafted) falls below
    `threshold`, speculation is off for the rest of the request. TensorRT-LLM's defaults: no schedule (the
    configured max draft length at every batch size) and no cut-off (window 0).

    A batch size between two keys takes the k of the next key up (the schedule's keys are upper bounds)."""

    def __init__(self, schedule: dict[int, int] | None = None, window: int = 0, threshold: float = 0.0,
                 k_max: int = DEFAULT_K_MAX):
        self.schedule = dict(sorted((int(b), int(k)) for b, k in (schedule or {}).items()))
        if any(b < 1 or not 0 <= k <= k_max for b, k in self.schedule.items()) or window < 0 or not 0 <= threshold <= 1:
            raise SpecPilotError(f"trtllm needs batch sizes >= 1, k in [0, {k_max}], window >= 0, threshold in [0, 1]; "
                                 f"got {self.schedule}, {window}, {threshold}")
        self.window, self.threshold = int(window), float(threshold)
        self.k_max = max(self.schedule.values(), default=k_max)
        sched = "/".join(f"{b}={k}" for b, k in self.schedule.items()) or str(k_max)
        self.name = f"trtllm:{sched}" + (f":{self.window}:{self.threshold:g}" if self.window else "")
        self.reset()

    def reset(self) -> None:
        self.history: deque = deque(maxlen=max(1, self.window))
        self.off = False

    def k_for(self, batch: int) -> int:
        if not self.schedule:
            return self.k_max
        return next((k for b, k in self.schedule.items() if batch <= b), 0)

    def choose_k(self, obs) -> int:
        return 0 if self.off else self.k_for(batch_of(obs))

    def update(self, step) -> None:
        if not self.window or step.k <= 0:
            return
        self.history.append((float(step.accepted), step.k))
        if len(self.history) == self.window:
            rate = sum(a for a, _ in self.history) / sum(k for _, k in self.history)
            self.off = self.off or rate < self.threshold


class PerBatchK(LengthPolicy):
    """One policy per batch size (the tuned best rule): a batch of B rows is decided by the policy of the
    largest listed batch size <= B (the smallest one below all of them). Every policy sees every update."""

    def __init__(self, policies: dict[int, LengthPolicy], name: str = "per-batch"):
        if not policies:
            raise SpecPilotError("PerBatchK needs at least one (batch size, policy) entry")
        self.policies = dict(sorted(policies.items()))
        self.name = name
        self.k_max = max(p.k_max for p in self.policies.values())
        self.stop_below = None

    def policy_for(self, batch: int) -> LengthPolicy:
        return at_or_below(self.policies, batch)

    def reset(self) -> None:
        for policy in self.policies.values():
            policy.reset()

    def choose_k(self, obs) -> int:
        return self.policy_for(batch_of(obs)).choose_k(obs)

    def update(self, step) -> None:
        for policy in self.policies.values():
            policy.update(step)


POLICY_HELP = ("none | static:K | heuristic | confidence:T | match:N[:K] | sglang-adaptive[:C1/C2/..[:ALPHA]] | "
               "trtllm:B=K/B=K/..[:WINDOW:THRESHOLD] | learned | learned:PATH "
               "| learned-mlp[:PATH] (the MLP alone, without its deferred rules) | learned-idle-counters[:PATH] (its hardware "
               "counters pinned to its device profile's idle ones: an ablation) (benchmark also: oracle, batch-table)")


def resolve_k_max(requested: int | None, policies) -> int:
    """The k_max to draft and observe with: a learned policy's own (its features were scaled by it in
    training), else `requested`, else DEFAULT_K_MAX. A `requested` value that differs from a learned
    policy's, or learned policies with different k_max, are an error."""
    # a learned policy (decoding.learned.LearnedK, which imports this module) maps actions to k
    own = sorted({int(p.k_max) for p in policies if getattr(p, "action_to_k", None) is not None})
    if len(own) > 1:
        raise SpecPilotError(f"the learned policies were trained with different k_max {own}; compare them in separate runs")
    if own:
        if requested is not None and requested != own[0]:
            raise SpecPilotError(f"--k-max {requested} conflicts with the learned policy's k_max {own[0]} (the one it "
                                 "was trained with); drop --k-max")
        return own[0]
    if requested is not None and requested < 0:
        raise SpecPilotError(f"--k-max must be >= 0, got {requested}")
    return DEFAULT_K_MAX if requested is None else requested


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
        if name == "sglang-adaptive":
            parts = arg.split(":") if arg else []
            candidates = [int(c) for c in parts[0].split("/")] if parts and parts[0] else (1, 3, 7)
            if max(candidates) > k_max:
                raise SpecPilotError(f"sglang-adaptive candidate {max(candidates)} is above k_max={k_max}")
            return SGLangAdaptiveK(candidates, float(parts[1]) if len(parts) > 1 else 0.2, k_max=k_max)
        if name == "trtllm":
            parts = arg.split(":") if arg else []
            if len(parts) not in (0, 1, 3):
                raise ValueError
            window, threshold = (int(parts[1]), float(parts[2])) if len(parts) == 3 else (0, 0.0)
            entries = [e.partition("=") for e in parts[0].split("/")] if parts and parts[0] else []
            if len(entries) == 1 and not entries[0][1]:  # trtllm:K: no schedule, K at every batch size
                k = int(entries[0][0])
                if not 0 <= k <= k_max:
                    raise SpecPilotError(f"k={k} is outside [0, k_max={k_max}]")
                return TrtllmK(None, window, threshold, k)
            return TrtllmK({int(b): int(k) for b, _, k in entries}, window, threshold, k_max)
        if name in ("learned", "learned-mlp", "learned-idle-counters"):
            from .learned import LearnedK, idle_counters  # noqa: I001 (learned.py builds on this module: LengthPolicy)

            policy = LearnedK.load(arg or None, defer=name != "learned-mlp", **learned_kwargs)
            return policy.pin_counters(idle_counters(policy)) if name == "learned-idle-counters" else policy
    except ValueError:
        pass
    raise SpecPilotError(f"unknown policy '{text}'; expected {POLICY_HELP}")
