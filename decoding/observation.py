"""The one observation builder, used by the env (training) and the decoder (inference).

A fixed, named float32 vector: hardware counters (from the background monitor), the measured cost of
recent draft and verify passes, the acceptance history, and context features. An exported policy
records `FEATURES`; `LearnedK` reads its features by name (a policy from before features were added reads
its subset) and refuses one with a name this version does not know.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from .drafters import MATCH_CAP
from .hardware import HW_FEATURES, HardwareMonitor, shared_monitor

HISTORY = 8
COST_FEATURES = ("draft_ms_per_token_log", "verify_ms_per_token_log", "plain_ms_log", "draft_verify_cost_ratio")
ACCEPT_FEATURES = tuple(f"accept_ratio_{i}" for i in range(1, HISTORY + 1)) + (
    "accept_history_len",
    "accept_rate_ema",
    "last_k_frac",
    "last_accepted_frac",
)
CONTEXT_FEATURES = (
    "context_len_log",
    "remaining_frac",
    "draft_confidence_last",
    "draft_confidence_min",
    "draft_entropy_last",
    "ngram_match_len",
    "draft_available_frac",
    "repetition_rate",
    "batch_size_log",
    "behind_available_frac",
    "remaining_spread",
    "ngram_suffix_log",
    "ngram_occurrences_log",
    "ngram_agreement",
)
SOURCE_FEATURES = tuple(f"{s}_accept_ema" for s in ("lookup", "head", "extend")) + tuple(
    f"last_source_{s}" for s in ("lookup", "head", "extend"))
"""A hybrid drafter's per-source acceptance (each source's accepted / k, averaged as `accept_rate_ema`, 0.5 before its
first step) and the source of the last drafting step (one-hot); constant for a drafter of one source."""
FEATURES = HW_FEATURES + COST_FEATURES + ACCEPT_FEATURES + CONTEXT_FEATURES + SOURCE_FEATURES
EMA = 0.3
REPETITION_WINDOW = 128
LOG_CAP = math.log1p(MATCH_CAP)
_AT = {name: i for i, name in enumerate(FEATURES)}
"""Each feature's position in the vector: `build` writes every feature by its name."""
_HW = slice(_AT[HW_FEATURES[0]], _AT[HW_FEATURES[-1]] + 1)
_HISTORY = slice(_AT["accept_ratio_1"], _AT[f"accept_ratio_{HISTORY}"] + 1)


class ObservationBuilder:
    """Keeps the running statistics of one sequence and turns them into the observation vector."""

    names = FEATURES

    def __init__(self, k_max: int, monitor: HardwareMonitor | None = None, device: str | None = None):
        self.k_max = max(1, k_max)
        self._monitor = monitor
        self._device = device
        self._vec = np.zeros(len(FEATURES), dtype=np.float32)
        self.reset()

    def reset(self, state=None) -> None:
        """Start a new sequence: every statistic restarts, in training and at inference alike."""
        if state is not None and self._monitor is None:
            self._monitor = shared_monitor(self._device or str(state.buffer.device))
        self.ratios: list[float] = []
        self.accept_ema = 0.5
        self.source_ema = {"lookup": 0.5, "head": 0.5, "extend": 0.5}
        self.last_source: str | None = None
        self.last_k = 0
        self.last_accepted = 0
        self.confidence_last = 1.0
        self.confidence_min = 1.0
        self.entropy_last = 0.0
        self.match_len = 0
        self.draft_ms = math.nan
        self.verify_ms = math.nan
        self.plain_ms = math.nan
        # the last REPETITION_WINDOW tokens of each row on the host, kept up to date from the steps' new tokens
        # (already on the host), so the repetition feature costs no device-to-host copy per step
        self._tails: dict[int, tuple[int, RepetitionWindow]] = {}
        self._keys: list[int] = []

    def push(self, step) -> None:
        """Fold one StepResult into the statistics."""
        if step.k:
            self.ratios.append(step.accepted / step.k)
            if len(self.ratios) > HISTORY:
                del self.ratios[0]
            self.accept_ema += EMA * (step.accepted / step.k - self.accept_ema)
            source = getattr(step, "source", None)
            if source in self.source_ema:
                self.source_ema[source] += EMA * (step.accepted / step.k - self.source_ema[source])
                self.last_source = source
            draft_ms = 1000.0 * step.draft_s / step.k
            self.draft_ms = draft_ms if math.isnan(self.draft_ms) else self.draft_ms + EMA * (draft_ms - self.draft_ms)
        verify_ms = 1000.0 * step.verify_s / (step.k + 1)
        self.verify_ms = verify_ms if math.isnan(self.verify_ms) else self.verify_ms + EMA * (verify_ms - self.verify_ms)
        if step.k == 0:
            plain = 1000.0 * step.verify_s
            self.plain_ms = plain if math.isnan(self.plain_ms) else self.plain_ms + EMA * (plain - self.plain_ms)
        self.last_k, self.last_accepted = step.k, step.accepted
        if step.confidences:
            self.confidence_last = step.confidences[-1]
            self.confidence_min = min(step.confidences)
        if step.entropies:
            self.entropy_last = step.entropies[-1]
        self.match_len = step.match_len
        if len(step.new_rows) == len(self._keys):
            for key, new in zip(self._keys, step.new_rows):
                if key in self._tails:
                    length, window = self._tails[key]
                    window.extend(new)
                    self._tails[key] = (length + len(new), window)

    def build(self, state) -> np.ndarray:
        """The observation before the next step of `state` (a copy, safe to keep), filled feature by feature by name."""
        v, at = self._vec, _AT
        v[_HW] = self._monitor.read() if self._monitor is not None else 0.0
        draft_ms, verify_ms, plain_ms = (0.0 if math.isnan(x) else x for x in (self.draft_ms, self.verify_ms, self.plain_ms))
        v[at["draft_ms_per_token_log"]] = math.log1p(draft_ms)
        v[at["verify_ms_per_token_log"]] = math.log1p(verify_ms)
        v[at["plain_ms_log"]] = math.log1p(plain_ms)
        v[at["draft_verify_cost_ratio"]] = draft_ms / verify_ms if verify_ms > 0 else 0.0
        # the last HISTORY accepted / k ratios, oldest first, right-aligned (zeros before a sequence has them)
        n = len(self.ratios)
        v[_HISTORY] = 0.0
        if n:
            v[_HISTORY.stop - n : _HISTORY.stop] = self.ratios
        v[at["accept_history_len"]] = n / HISTORY
        v[at["accept_rate_ema"]] = self.accept_ema
        v[at["last_k_frac"]] = self.last_k / self.k_max
        v[at["last_accepted_frac"]] = self.last_accepted / self.k_max
        for source, ema in self.source_ema.items():
            v[at[f"{source}_accept_ema"]] = ema
            v[at[f"last_source_{source}"]] = 1.0 if self.last_source == source else 0.0
        self._keys = []
        # a batch is described by the mean over its active rows (one sequence: that sequence)
        # the rows' own ids: a batch's last running row need not be row 0 (after the last step: every row)
        ids = list(state.active) or list(range(len(state.rows)))
        rows = [state.rows[i] for i in ids]
        n = len(rows)
        v[at["context_len_log"]] = sum(math.log1p(r.context_len) for r in rows) / n
        v[at["remaining_frac"]] = sum(r.remaining / r.max_new_tokens for r in rows) / n
        v[at["draft_confidence_last"]] = self.confidence_last
        v[at["draft_confidence_min"]] = self.confidence_min
        v[at["draft_entropy_last"]] = self.entropy_last
        # what the drafter could propose right now (prompt lookup: the current n-gram match), else last step's
        # a batch lasts as long as its row with the most tokens left: what that row can draft decides
        # whether a step saves time (behind_available_frac), and how far behind it is (remaining_spread)
        remaining = [r.remaining for r in rows]
        most = max(remaining)
        behind = [j for j, left in enumerate(remaining) if left == most]
        peek = getattr(getattr(state, "draft", None), "peek", None)
        if peek is not None:
            peeks = [peek(r.host_context, self.k_max, row) for r, row in zip(rows, ids)]
            v[at["ngram_match_len"]] = sum(m for m, _ in peeks) / n
            v[at["draft_available_frac"]] = sum(a for _, a in peeks) / n / self.k_max
            v[at["behind_available_frac"]] = sum(peeks[j][1] for j in behind) / len(behind) / self.k_max
        else:
            v[at["ngram_match_len"]] = self.match_len
            v[at["draft_available_frac"]] = v[at["behind_available_frac"]] = 1.0
        v[at["repetition_rate"]] = sum(self._tail(r).rate for r in rows) / n
        v[at["batch_size_log"]] = math.log(n)
        v[at["remaining_spread"]] = (most - sum(remaining) / n) / rows[0].max_new_tokens
        # how far the current match is to be trusted (prompt lookup): bounded, whatever the context's length
        stats = getattr(getattr(state, "draft", None), "match_stats", None)
        if stats is not None:
            found = [stats(r.host_context, row) for r, row in zip(rows, ids)]
            v[at["ngram_suffix_log"]] = sum(math.log1p(s) for s, _, _ in found) / n / LOG_CAP
            v[at["ngram_occurrences_log"]] = sum(math.log1p(o) for _, o, _ in found) / n / LOG_CAP
            v[at["ngram_agreement"]] = sum(a for _, _, a in found) / n
        else:
            v[at["ngram_suffix_log"]] = v[at["ngram_occurrences_log"]] = v[at["ngram_agreement"]] = 0.0
        return v.copy()

    def _tail(self, row) -> "RepetitionWindow":
        """The row's last REPETITION_WINDOW tokens from the host copy; read from the device only when the copy
        does not cover the row's length (a new row, or steps this builder did not see)."""
        key = id(row.buffer)
        self._keys.append(key)
        cached = self._tails.get(key)
        if cached is None or cached[0] != row.length:
            window = row.buffer[max(0, row.length - REPETITION_WINDOW) : row.length]
            window = window.cpu().numpy() if hasattr(window, "cpu") else np.asarray(window)
            cached = self._tails[key] = (row.length, RepetitionWindow(window.tolist()))
        return cached[1]


class RepetitionWindow:
    """The last REPETITION_WINDOW tokens of a row with a count of each, so that `rate` (`repetition_rate` of the
    window) costs O(new tokens) per step, not a sort of the window."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: deque[int] = deque()
        self.counts: dict[int, int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        window, counts = self.tokens, self.counts
        for token in tokens:
            token = int(token)
            window.append(token)
            counts[token] = counts.get(token, 0) + 1
            if len(window) > REPETITION_WINDOW:
                old = window.popleft()
                if counts[old] == 1:
                    del counts[old]
                else:
                    counts[old] -= 1

    @property
    def rate(self) -> float:
        size = len(self.tokens)
        return 0.0 if size < 2 else 1.0 - len(self.counts) / size


def repetition_rate(tokens) -> float:
    """Share of the window's tokens that repeat an earlier token of the window (0 = all distinct)."""
    window = tokens.cpu().numpy() if hasattr(tokens, "cpu") else np.asarray(tokens)
    if window.size < 2:
        return 0.0
    return 1.0 - np.unique(window).size / window.size

