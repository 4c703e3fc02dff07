"""Length policies: how many tokens to draft next. One interface for all of them.

`choose_k(obs)` gets the observation vector of `decoding.observation` (hand-written policies may
ignore it); `update(step)` gets the `StepResult` of the step just run. `stop`, when set (a
`decoding.drafters.StopRule`), asks a model draft to stop inside its draft once a token's top-1
probability or entropy says so (confidence-based drafting); the loop reads it before every step, so a
policy may change it as it learns. k = 0 turns speculation off for a step (a plain target step).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from .drafters import StopRule
from .errors import SpecPilotError
from .observation import FEATURES

DEFAULT_K_MAX = 8


class LengthPolicy:
    name = "policy"
    k_max = 0
    stop: "StopRule | None" = None
    source: str | None = None
    """For a drafter with several sources (`hybrid.HybridDrafter`): the one this step drafts from, set by
    `choose_k` (None: the drafter's default)."""

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
    """llama.cpp's `--spec-draft-n-max K --spec-draft-p-min P` (and transformers' fixed
    `assistant_confidence_threshold`): draft up to K tokens, stopping before a token whose top-1 draft
    probability is below P (DISCO / AdaEDL-style early exit by confidence)."""

    def __init__(self, threshold: float, k_max: int = DEFAULT_K_MAX):
        if not 0.0 <= threshold <= 1.0:
            raise SpecPilotError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.stop, self.k_max = StopRule(min_confidence=threshold), k_max
        self.name = f"confidence:{threshold:g}" + _k_suffix(k_max)

    def choose_k(self, obs) -> int:
        return self.k_max


class RocConfidence(LengthPolicy):
    """transformers' assisted generation with `assistant_confidence_threshold` (default 0.4) and its self-tuning:
    draft up to K tokens, stopping below the threshold; after each step the drafted tokens' probabilities up to
    the first rejected one are kept with labels (1 accepted, 0 rejected), and once there are more than 5 with
    both labels the threshold moves to the one of the ROC curve that minimises FPR + 3 x FNR (transformers
    weighs a false negative three times a false positive). Per sequence (one generate call). A batch reads
    its per-depth mean probabilities and its mean accepted count (transformers runs one row only)."""

    def __init__(self, threshold: float = 0.4, k_max: int = DEFAULT_K_MAX):
        if not 0.0 <= threshold <= 1.0:
            raise SpecPilotError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.start, self.k_max = float(threshold), k_max
        self.name = "transformers-roc" + ("" if threshold == 0.4 and k_max == DEFAULT_K_MAX else f":{threshold:g}")
        self.name += _k_suffix(k_max)
        self.reset()

    def reset(self) -> None:
        self.stop = StopRule(min_confidence=self.start)
        self.probs: list[float] = []
        self.matches: list[int] = []

    def choose_k(self, obs) -> int:
        return self.k_max

    def update(self, step) -> None:
        if not step.k or not step.confidences:
            return
        accepted = int(round(step.accepted))
        self.probs.extend(step.confidences[: accepted + 1])
        self.matches.extend([1] * min(accepted, len(step.confidences)))
        if accepted < len(step.confidences):
            self.matches.append(0)
        del self.probs[len(self.matches):]
        if len(self.probs) > 5 and 0 in self.matches and 1 in self.matches:
            self.stop = StopRule(min_confidence=min(1.0, roc_threshold(self.matches, self.probs)))


def _k_suffix(k: int) -> str:
    """A stop-rule policy's name ends with its K unless it is the default k_max (names stay unique and parse back)."""
    return "" if k == DEFAULT_K_MAX else f":{k}"


def roc_threshold(labels: list[int], scores: list[float], fn_weight: float = 3.0) -> float:
    """The score threshold (predict 1 when score >= it) of the ROC curve minimising FPR + fn_weight x FNR;
    candidates are every distinct score and +inf (predict nothing), as sklearn's `roc_curve` lists them."""
    y, x = np.asarray(labels, dtype=np.int64), np.asarray(scores, dtype=np.float64)
    order = np.argsort(-x, kind="stable")
    y, x = y[order], x[order]
    last = np.r_[np.nonzero(np.diff(x))[0], len(x) - 1]  # the last index of each distinct score
    tp, fp = np.cumsum(y)[last], np.cumsum(1 - y)[last]
    positives, negatives = max(1, int(y.sum())), max(1, int((1 - y).sum()))
    fpr, fnr = np.r_[0.0, fp / negatives], 1.0 - np.r_[0.0, tp / positives]
    thresholds = np.r_[np.inf, x[last]]
    return float(thresholds[int(np.argmin(fpr + fn_weight * fnr))])


class EntropyStop(LengthPolicy):
    """SVIP's rule ("draft model knows when to stop"): draft up to K tokens, stopping before a token whose draft
    entropy (nats) is above H: a bound on that token's acceptance, 1 - sqrt(gamma x entropy), falls below the
    acceptance the verify cost needs. The threshold is the one knob, tuned on the train split."""

    def __init__(self, max_entropy: float, k_max: int = DEFAULT_K_MAX):
        if not max_entropy >= 0:
            raise SpecPilotError(f"an entropy threshold is >= 0 nats, got {max_entropy}")
        self.stop, self.k_max = StopRule(max_entropy=float(max_entropy)), k_max
        self.name = f"entropy:{max_entropy:g}" + _k_suffix(k_max)

    def choose_k(self, obs) -> int:
        return self.k_max


class AdaEDL(LengthPolicy):
    """AdaEDL (Agrawal et al., 2024): stop drafting before a token whose entropy-based lower bound on its
    acceptance probability, 1 - sqrt(gamma x entropy), is below lambda; lambda adapts to the acceptance seen,
    an exponential moving average (weight `BETA` on the past) of each step's accepted / drafted, starting at
    `lambda0`. Equivalently a stop above entropy (1 - lambda)^2 / gamma. Per sequence."""

    BETA = 0.9

    def __init__(self, gamma: float = 1.0, lambda0: float = 0.5, k_max: int = DEFAULT_K_MAX):
        if gamma <= 0 or not 0.0 <= lambda0 <= 1.0:
            raise SpecPilotError(f"adaedl needs gamma > 0 and lambda0 in [0, 1]; got {gamma}, {lambda0}")
        self.gamma, self.lambda0, self.k_max = float(gamma), float(lambda0), k_max
        self.name = f"adaedl:{gamma:g}:{lambda0:g}" + _k_suffix(k_max)
        self.reset()

    def _set(self, lam: float) -> None:
        self.lam = lam
        self.stop = StopRule(max_entropy=(1.0 - lam) ** 2 / self.gamma)

    def reset(self) -> None:
        self._set(self.lambda0)

    def choose_k(self, obs) -> int:
        return self.k_max

    def update(self, step) -> None:
        if step.k:
            self._set(self.BETA * self.lam + (1.0 - self.BETA) * min(1.0, float(step.accepted) / step.k))


class BanditK(LengthPolicy):
    """BanditSpec's UCB over draft lengths: each arm is a k whose reward is its steps' tokens per second; the next
    arm maximises mean / best arm's mean + c sqrt(2 ln t / n_k) (every arm is tried once first, in order). The
    statistics persist across sequences (the bandit learns the workload; `reset` keeps them), and one bandit runs
    per batch size."""

    def __init__(self, arms=(0, 1, 2, 3, 4, 6, 8), c: float = 0.3, k_max: int = DEFAULT_K_MAX):
        arms = sorted({int(a) for a in arms if 0 <= int(a) <= k_max})
        if not arms or c < 0:
            raise SpecPilotError(f"bandit needs arms in [0, k_max={k_max}] and c >= 0, got {arms}, {c}")
        self.arms, self.c, self.k_max = arms, float(c), max(arms)
        self.name = "bandit-ucb" + ("" if (tuple(arms), c) == ((0, 1, 2, 3, 4, 6, 8), 0.3) else
                                    ":" + "/".join(map(str, arms)) + f":{c:g}")
        self.buckets: dict[int, dict] = {}
        self._last: tuple[int, int] | None = None

    def _bucket(self, batch: int) -> dict:
        return self.buckets.setdefault(batch, {"n": [0] * len(self.arms), "sum": [0.0] * len(self.arms)})

    def choose_k(self, obs) -> int:
        return self.arms[self.pick(obs)]

    def pick(self, obs) -> int:
        """The index of the arm to play now (UCB over this batch size's statistics), remembered for `update`."""
        batch = batch_of(obs)
        b = self._bucket(batch)
        untried = [i for i, n in enumerate(b["n"]) if n == 0]
        if untried:
            arm = untried[0]
        else:
            t, means = sum(b["n"]), [total / n for total, n in zip(b["sum"], b["n"])]
            best = max(max(means), 1e-12)
            arm = max(range(len(b["n"])), key=lambda i: means[i] / best + self.c * math.sqrt(2 * math.log(t) / b["n"][i]))
        self._last = (batch, arm)
        return arm

    def update(self, step) -> None:
        if self._last is None or step.seconds <= 0:
            return
        batch, arm = self._last
        self._last = None
        b = self._bucket(batch)
        b["n"][arm] += 1
        b["sum"][arm] += len(step.new_tokens) / step.seconds


class MatchLengthK(LengthPolicy):
    """Prompt lookup's own confidence: draft k tokens when the current n-gram match is at least `min_match`
    tokens long, else decode plainly (a longer matched n-gram makes its continuation likelier to be right).

    Reads the observation's `ngram_match_len` (a batch: the mean over its active rows). For a prompt-lookup
    draft only: other drafts report no match (`rule_spec.parse_rule` refuses them when told the draft)."""

    def __init__(self, min_match: float, k: int):
        if min_match <= 0 or k < 1:
            raise SpecPilotError(f"match:N:K needs N > 0 and K >= 1, got N={min_match:g}, K={k}")
        self.min_match, self.k = float(min_match), k
        self.k_max = k
        self.name = f"match:{min_match:g}:{k}"
        self._index = FEATURES.index("ngram_match_len")

    def choose_k(self, obs) -> int:
        return self.k if obs[self._index] >= self.min_match else 0


class ActionTable:
    """The actions of a policy that picks k and, inside the draft, a stop level (the top-1 probability below which a
    model draft stops, `StopRule.min_confidence`; 0 = draft all k) and, for a drafter with several sources (the
    hybrid's lookup, head, extend), the source: one index per triple, action = (source index x levels + level
    index) x (k_max + 1) + k. The first level is 0 and the first source None (the policy's or the drafter's default,
    `hybrid.ACTION_SOURCES`), so actions 0..k_max are k itself (a rule's k steps an env of any table)."""

    def __init__(self, k_max: int, stop_levels=(0.0,), sources=(None,)):
        levels = [float(v) for v in stop_levels]
        if not levels or levels[0] != 0.0 or len(set(levels)) != len(levels) or any(not 0.0 <= v < 1.0 for v in levels):
            raise SpecPilotError(f"stop levels must be distinct probabilities in [0, 1), the first 0 (actions 0..k_max "
                                 f"stay plain k), got {list(stop_levels)}")
        sources = list(sources) or [None]
        if len(set(sources)) != len(sources) or None in sources[1:]:
            raise SpecPilotError(f"draft sources must be distinct names (None, the default, first only), got {sources}")
        self.stop_levels, self.sources = levels, sources
        self.to_k = [k for _ in sources for _ in levels for k in range(k_max + 1)]
        self.to_stop = [v for _ in sources for v in levels for _ in range(k_max + 1)]
        self.to_source = [s for s in sources for _ in levels for _ in range(k_max + 1)]
        self._rules = [StopRule(min_confidence=v) if v > 0 else None for v in self.to_stop]

    @classmethod
    def of(cls, to_k: list[int], to_stop: list[float], to_source: list | None = None) -> "ActionTable":
        """The table a policy file lists (`action_to_k`, `action_to_stop`, `action_to_source`), checked against the
        layout above."""
        k_max = max(to_k)
        levels = list(dict.fromkeys(to_stop))
        sources = list(dict.fromkeys(to_source)) if to_source else [None]
        table = cls(k_max, levels, sources)
        if table.to_k != list(to_k) or table.to_stop != list(to_stop) or (to_source and table.to_source != list(to_source)):
            raise SpecPilotError("action_to_k / action_to_stop / action_to_source do not follow the layout "
                                 "(source x levels + level) x (k_max + 1) + k")
        return table

    def source(self, action: int, default: str | None = None) -> str | None:
        """The draft source of an action (`default` for a table without sources, or an int beyond the table)."""
        a = int(action)
        return self.to_source[a] if 0 <= a < len(self.to_source) and self.to_source[a] is not None else default

    def __len__(self) -> int:
        return len(self.to_k)

    def decode(self, action: int, stop: StopRule | None = None) -> tuple[int, StopRule | None]:
        """(k, stop rule) of an action: its level's rule, else `stop`. An int beyond the table (a k asked past k_max)
        is k with `stop`."""
        a = int(action)
        if 0 <= a < len(self.to_k):
            return self.to_k[a], self._rules[a] or stop
        return a, stop


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

    @property
    def stop(self) -> StopRule | None:
        """The stop rule of the policy that decided the last batch (one that adapts it keeps it current)."""
        return getattr(self, "_deciding", None) and self._deciding.stop

    @property
    def source(self) -> str | None:
        """The draft source of the policy that decided the last batch."""
        return getattr(self, "_deciding", None) and self._deciding.source

    def policy_for(self, batch: int) -> LengthPolicy:
        return at_or_below(self.policies, batch)

    def reset(self) -> None:
        for policy in self.policies.values():
            policy.reset()

    def choose_k(self, obs) -> int:
        self._deciding = self.policy_for(batch_of(obs))
        return self._deciding.choose_k(obs)

    def update(self, step) -> None:
        for policy in self.policies.values():
            policy.update(step)
