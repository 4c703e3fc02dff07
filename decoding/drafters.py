"""Drafters: one protocol, three kinds (prompt lookup, a draft LM with its own KV cache, EAGLE-style).

A drafter sees the whole confirmed context each step and proposes up to k tokens; after verification
the loop tells it how long a prefix of the new context it may keep (`rollback`). A drafter that
reads the target's hidden states (EAGLE-style) sets `needs_hidden = True` and receives the target's hidden
states at the last confirmed position in `propose(..., target_hidden=...)`: the layers it lists in `hidden_layers`,
concatenated (`hidden_features`; the last layer by default). A model draft may stop inside its draft where a
`StopRule` says so (its top-1 probability or entropy), which the length policy sets per step.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .errors import SpecPilotError
from .sampling import Sampling, probs_from_logits, sample


@dataclass
class Draft:
    """What a drafter proposes for one step."""

    tokens: torch.Tensor
    """(n,) proposed token ids, n <= k; (rows, n) from propose_batch."""
    probs: torch.Tensor | None = None
    """(n, V) the draft distributions the tokens were sampled from (sampling only; None = deterministic);
    (rows, n, V) from propose_batch."""
    confidences: list[float] = field(default_factory=list)
    """Top-1 probability of the draft at each proposed position."""
    entropies: list[float] = field(default_factory=list)
    """Entropy (nats) of the draft distribution at each proposed position."""
    match_len: float = 0
    """Prompt-lookup drafters: length of the n-gram that matched (0 = none; the mean over a batch)."""


@dataclass(frozen=True)
class StopRule:
    """When a model draft stops inside its draft, before proposing the next token: its top-1 probability is
    below `min_confidence` (llama.cpp's `--spec-draft-p-min`, transformers' `assistant_confidence_threshold`) or
    its entropy in nats is above `max_entropy` (SVIP's and AdaEDL's entropy bounds). A batch stops when every
    row would. Prompt lookup has no distribution and never stops. Lossless: it only shortens the draft."""

    min_confidence: float = 0.0
    max_entropy: float = math.inf

    def __post_init__(self):
        if not 0.0 <= self.min_confidence <= 1.0 or not self.max_entropy >= 0.0:
            raise SpecPilotError(f"a stop rule needs a confidence in [0, 1] and an entropy >= 0, got "
                                 f"{self.min_confidence}, {self.max_entropy}")

    def stops(self, confidences: list[float], entropies: list[float]) -> bool:
        """Whether to stop before drafting a token whose rows have these top-1 probabilities and entropies."""
        return all(c < self.min_confidence or e > self.max_entropy for c, e in zip(confidences, entropies))


def row_entropies(p: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of (rows, V) probabilities."""
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


class Drafter(Protocol):
    name: str
    needs_hidden: bool

    def reset(self, prompt: torch.Tensor) -> None:
        """Start a new sequence whose context is `prompt` (1-D ids)."""

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None,
        stop: "StopRule | None" = None,
        target_hidden: torch.Tensor | None = None,
    ) -> Draft:
        """Up to k tokens continuing `context`; a model draft stops early where `stop` says so."""

    def rollback(self, length: int) -> None:
        """The first `length` tokens of the context are confirmed; forget any state beyond them."""

    # optional: `peek(context, k) -> (match_len, available)`, what the drafter could propose now without
    # running a model (the observation builder reads it; prompt-lookup drafters have it for free), and
    # `match_stats(context, row) -> (suffix, occurrences, agreement)` (`match_statistics`)
    # optional, for batched decoding (B > 1): `reset_batch(contexts)`, `rollback_batch(lengths, rows)`
    # and `propose_batch(contexts, k, sampling, generator, stop, target_hidden, rows) -> Draft`
    # with tokens (rows, n) (a row with fewer proposals pads: padding is rejected like any wrong guess)


def reports_confidence(draft) -> bool:
    """Whether a drafter's proposals carry a probability and entropy that a stop rule can read (a model draft's do;
    prompt lookup's are always 1 and 0)."""
    return bool(getattr(draft, "reports_confidence", True))


def hidden_features(hidden_states, draft) -> torch.Tensor:
    """What a draft that reads the target's hidden states gets from a forward's `hidden_states` tuple: the
    layers it lists in `hidden_layers` (EAGLE-3's low / middle / high features), concatenated on the last
    axis; a draft without the attribute gets the last one (after the final norm)."""
    layers = getattr(draft, "hidden_layers", (-1,))
    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def entropy_of(p: torch.Tensor) -> float:
    """Entropy in nats of a probability vector."""
    return float(-(p * torch.log(p.clamp_min(1e-30))).sum())


def empty_draft(device: torch.device | str) -> Draft:
    return Draft(tokens=torch.empty(0, dtype=torch.long, device=device))


def cache_kwarg(model) -> str:
    """The forward() keyword for the KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    name = getattr(model, "_specpilot_cache_kwarg", None)
    if name is None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model._specpilot_cache_kwarg = name
    return name


def crop_cache(cache, keep: int) -> None:
    """Drop cached positions beyond the first `keep` (transformers' crop takes a negative count)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


MATCH_CAP = 32
"""The n-gram match statistics count up to this many tokens (or occurrences)."""


def ngram_search(context: np.ndarray, max_n: int, min_n: int = 1) -> tuple[int, int, np.ndarray]:
    """(start of the continuation, matched n, the start of every earlier occurrence of the last n tokens) of
    the most recent earlier match (n from max_n down to min_n); (len, 0, empty) when nothing matches."""
    length = context.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = context[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)  # end before the last token
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            return int(hits[-1]) + n, n, hits
    return length, 0, np.empty(0, dtype=np.int64)


def match_statistics(context: np.ndarray, max_n: int, min_n: int = 1) -> tuple[int, int, float]:
    """(suffix, occurrences, agreement) of the context's current prompt-lookup match: how many tokens before
    the continuation agree with the context's last tokens (the n-gram and beyond, up to MATCH_CAP), how
    often the n-gram occurred before (up to MATCH_CAP), and the share of those occurrences followed by the
    token the draft proposes. A long suffix and agreeing occurrences mean a copy; a short one, a coincidence.
    (0, 0, 0.0) when nothing matches."""
    return statistics_of_match(context, *ngram_search(context, max_n, min_n))


def statistics_of_match(context: np.ndarray, start: int, n: int, hits: np.ndarray) -> tuple[int, int, float]:
    """`match_statistics` of a search already made (`ngram_search`'s result)."""
    if not n:
        return 0, 0, 0.0
    length, suffix = context.shape[0], n
    while suffix < MATCH_CAP and start - 1 - suffix >= 0 and context[start - 1 - suffix] == context[length - 1 - suffix]:
        suffix += 1
    agreement = float((context[hits + n] == context[start]).mean())
    return suffix, min(int(hits.size), MATCH_CAP), agreement


class NgramIndex:
    """The positions of every n-gram (n = min_n..max_n) of one growing token sequence, so that a prompt-lookup
    search costs a dictionary lookup, not a scan of the whole context: `search()` is `ngram_search` of the tokens
    given so far (the same start, n and occurrences), `extend` indexes only the tokens added since the last call."""

    def __init__(self, max_n: int, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tables: dict[int, dict[bytes, list[int]]] = {n: {} for n in range(min_n, max_n + 1)}
        self._buffer = np.empty(256, dtype=np.int64)  # grown by doubling: appending a step's tokens copies nothing else
        self.length = 0

    @property
    def tokens(self) -> np.ndarray:
        """The indexed tokens (a view)."""
        return self._buffer[: self.length]

    def extend(self, new_tokens: np.ndarray) -> None:
        """Append `new_tokens` to the sequence and index the n-grams they complete."""
        old, new = self.length, self.length + len(new_tokens)
        if new > self._buffer.shape[0]:
            grown = np.empty(max(new, 2 * self._buffer.shape[0]), dtype=np.int64)
            grown[:old] = self._buffer[:old]
            self._buffer = grown
        self._buffer[old:new] = new_tokens
        self.length = new
        tokens = self._buffer
        for n, table in self.tables.items():
            # an occurrence at p counts once its continuation exists: p + n <= length - 1 (as ngram_search)
            for p in range(max(0, old - n), new - n):
                table.setdefault(tokens[p : p + n].tobytes(), []).append(p)

    def search(self) -> tuple[int, int, np.ndarray]:
        """`ngram_search(tokens, max_n, min_n)` of the indexed tokens."""
        length = self.length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = self.tables[n].get(self.tokens[length - n :].tobytes())
            if hits:
                return hits[-1] + n, n, np.asarray(hits, dtype=np.int64)
        return length, 0, np.empty(0, dtype=np.int64)


class NgramDrafter:
    """Model-free prompt-lookup drafting: find the most recent earlier occurrence of the context's
    last n tokens (n from `max_n` down to `min_n`) and propose the tokens that followed it."""

    needs_hidden = False
    reports_confidence = False  # a proposal's probability is 1 and its entropy 0: no stop rule has anything to read

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise SpecPilotError(f"ngram drafter needs 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = f"ngram:{max_n}"
        self._last: dict[int, tuple] = {}  # row -> (context length, start, n, earlier occurrences, host tokens)
        # each row's confirmed tokens on the host, indexed by n-gram (NgramIndex): a step copies only the tokens
        # confirmed since the last one from the device (one small transfer) and indexes only those, so a search
        # costs the same at 100 tokens of context as at 100,000
        self._index: dict[int, NgramIndex] = {}

    def reset(self, prompt: torch.Tensor) -> None:
        self._last, self._index = {}, {}

    def reset_batch(self, contexts: list[torch.Tensor]) -> None:
        self._last, self._index = {}, {}

    def rollback(self, length: int) -> None:
        pass

    def rollback_batch(self, lengths: list[int], rows: list[int]) -> None:
        pass

    def peek(self, context: torch.Tensor | np.ndarray, k: int, row: int = 0) -> tuple[int, int]:
        """(matched n-gram length, tokens available to propose) for the current context (a tensor, or its numpy
        view: the observation builder's, without a torch call)."""
        tokens, n = self.lookup(context, k, row)
        return n, tokens.shape[0]

    def lookup(self, context: torch.Tensor, k: int, row: int = 0) -> tuple[torch.Tensor, int]:
        """(continuation of at most k tokens, matched n-gram length); empty when nothing matches.

        The match for the last context length of each row is kept, so a peek followed by a propose on
        the same context searches once (within a sequence the context at a given length never changes).
        """
        length = context.shape[0]
        last = self._last.get(row) if self._last else None
        if last is None or last[0] != length:
            index = self._indexed(context, row)
            last = self._last[row] = (length, *index.search(), index.tokens)
        _, start, n, _, _ = last
        return context[start : start + k], n

    def _indexed(self, context: torch.Tensor, row: int) -> NgramIndex:
        """The row's n-gram index, extended by the tokens the context gained since the last call (built anew for a
        context shorter than the one indexed: another sequence)."""
        index = self._index.get(row)
        length = context.shape[0]
        if index is None or index.length > length:
            index = self._index[row] = NgramIndex(self.max_n, self.min_n)
        if index.length < length:
            new = context[index.length :]
            index.extend(new if isinstance(new, np.ndarray) else new.cpu().numpy())
        return index

    def match_stats(self, context: torch.Tensor, row: int = 0) -> tuple[int, int, float]:
        """How trustworthy the current match is (`match_statistics`), for the observation builder; from the
        search `lookup` made (or makes) for this context, not a second one."""
        self.lookup(context, 0, row)
        _, start, n, hits, host = self._last[row]
        return statistics_of_match(host, start, n, hits)

    def propose(self, context, k, sampling, generator, stop=None, target_hidden=None) -> Draft:
        if k <= 0:
            return empty_draft(context.device)
        tokens, n = self.lookup(context, k)
        ones = [1.0] * tokens.shape[0]
        return Draft(tokens=tokens, probs=None, confidences=ones, entropies=[0.0] * len(ones), match_len=n)

    def propose_batch(self, contexts, k, sampling, generator, stop=None, target_hidden=None, rows=None) -> Draft:
        rows = rows if rows is not None else list(range(len(contexts)))
        found = [self.lookup(c, k, row) for c, row in zip(contexts, rows)]
        width = max((t.shape[0] for t, _ in found), default=0) if k > 0 else 0
        tokens = torch.empty(len(contexts), width, dtype=torch.long, device=contexts[0].device)
        for i, ((t, _), context) in enumerate(zip(found, contexts)):
            tokens[i, : t.shape[0]] = t
            tokens[i, t.shape[0] :] = context[-1]  # padding: a guess like any other
        ones = [1.0] * width
        return Draft(tokens=tokens, confidences=ones, entropies=[0.0] * width,
                     match_len=sum(n for _, n in found) / len(found))


class ModelDrafter:
    """A causal LM that shares the target's tokenizer, with its own KV cache.

    `vocab_size` is the width of the target's logits: draft logits are cut or padded to it so that
    draft and target distributions live on the same support.
    """

    needs_hidden = False
    reports_confidence = True

    def __init__(self, model, name: str, vocab_size: int):
        # transformers loads in seconds: only when a model runs
        from transformers import DynamicCache

        self.model = model.eval()
        self.name = name
        self.vocab_size = vocab_size
        self._cache_cls = DynamicCache
        self.cache = None
        self.cached = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self, prompt: torch.Tensor) -> None:
        self.cache = self._cache_cls(config=self.model.config)
        self.cached = 0

    def rollback(self, length: int) -> None:
        if self.cached > length:
            crop_cache(self.cache, length)
            self.cached = length

    # batched decoding: the draft's own cache has one row per active sequence and, like the target's,
    # masked holes where a row's tokens were rejected (or padded); `_pos` holds each slot's sequence
    # position (-1 = hole), `_valid[i]` how many leading tokens of row i the cache holds
    def reset_batch(self, contexts: list[torch.Tensor]) -> None:
        self.cache = self._cache_cls(config=self.model.config)
        n = len(contexts)
        self._rows = list(range(n))
        self._valid = [0] * n
        self._mask = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(n, 0, dtype=torch.long, device=self.device)

    def _select(self, rows: list[int]) -> None:
        """Follow the loop's active rows (finished rows are dropped from the cache)."""
        if rows == self._rows:
            return
        index = [self._rows.index(r) for r in rows]
        at = torch.tensor(index, device=self.device)
        self.cache.batch_select_indices(at)
        self._mask, self._pos = self._mask[at], self._pos[at]
        self._valid = [self._valid[i] for i in index]
        self._rows = list(rows)

    def _batch_logits(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = torch.cat([self._mask, valid], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions.clamp_min(0), use_cache=True,
                         logits_to_keep=1, **{cache_kwarg(self.model): self.cache})
        self._mask = mask
        self._pos = torch.cat([self._pos, positions.masked_fill(valid == 0, -1)], dim=1)
        return self._fit(out.logits[:, -1].float())

    def rollback_batch(self, lengths: list[int], rows: list[int]) -> None:
        self._select(rows)
        keep = torch.tensor(lengths, device=self.device)[:, None]
        beyond = self._pos >= keep
        self._mask = self._mask.masked_fill(beyond, 0)
        self._pos = self._pos.masked_fill(beyond, -1)
        self._valid = [min(v, n) for v, n in zip(self._valid, lengths)]
        used = self._mask.any(dim=0).nonzero()
        slots = int(used[-1]) + 1 if used.numel() else 0
        if slots < self._mask.shape[1]:
            crop_cache(self.cache, slots)
            self._mask, self._pos = self._mask[:, :slots], self._pos[:, :slots]

    @torch.inference_mode()
    def propose_batch(self, contexts, k, sampling, generator, stop=None, target_hidden=None, rows=None) -> Draft:
        rows = list(rows) if rows is not None else list(range(len(contexts)))
        self._select(rows)
        device = contexts[0].device
        n = len(contexts)
        if k <= 0:
            return Draft(tokens=torch.empty(n, 0, dtype=torch.long, device=device))
        feeds = [c[v:].to(self.device) for c, v in zip(contexts, self._valid)]
        width = max(f.shape[0] for f in feeds)
        ids = torch.zeros(n, width, dtype=torch.long, device=self.device)
        valid = torch.zeros_like(ids)
        positions = torch.zeros_like(ids)
        for i, (f, v) in enumerate(zip(feeds, self._valid)):  # right-aligned: pads (holes) first
            m = f.shape[0]
            ids[i, width - m :] = f
            valid[i, width - m :] = 1
            positions[i, width - m :] = torch.arange(v, v + m, device=self.device)
        logits = self._batch_logits(ids, valid, positions)
        self._valid = [c.shape[0] for c in contexts]
        tokens, probs, confidences, entropies = [], [], [], []
        for j in range(k):
            p = probs_from_logits(logits, sampling)
            top, entropy = p.max(dim=-1).values.tolist(), row_entropies(p).tolist()
            if stop is not None and stop.stops(top, entropy):
                break
            token = p.argmax(dim=-1) if sampling.greedy else sample(p, generator)
            tokens.append(token)
            confidences.append(sum(top) / n)
            entropies.append(sum(entropy) / n)
            if not sampling.greedy:
                probs.append(p)
            if j == k - 1:
                break
            at = torch.tensor(self._valid, device=self.device)[:, None]
            logits = self._batch_logits(token[:, None], torch.ones_like(token)[:, None], at)
            self._valid = [v + 1 for v in self._valid]
        if not tokens:
            return Draft(tokens=torch.empty(n, 0, dtype=torch.long, device=device))
        return Draft(tokens=torch.stack(tokens, dim=1).to(device),
                     probs=torch.stack(probs, dim=1).to(device) if probs else None,
                     confidences=confidences, entropies=entropies)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Cut or pad the draft's logits to the target's vocabulary width."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids[None].to(self.device), use_cache=True, logits_to_keep=1,
                         **{cache_kwarg(self.model): self.cache})
        self.cached += ids.shape[0]
        return self._fit(out.logits[0, -1].float())

    @torch.inference_mode()
    def propose(self, context, k, sampling, generator, stop=None, target_hidden=None) -> Draft:
        if k <= 0:
            return empty_draft(context.device)
        feed = context[self.cached :]
        tokens, probs, confidences, entropies = [], [], [], []
        for _ in range(k):
            p = probs_from_logits(self._logits(feed), sampling)
            conf, ent = float(p.max()), entropy_of(p)
            if stop is not None and stop.stops([conf], [ent]):
                break
            token = p.argmax() if sampling.greedy else sample(p, generator)
            tokens.append(token.reshape(1))
            confidences.append(conf)
            entropies.append(ent)
            if not sampling.greedy:
                probs.append(p)
            feed = token.reshape(1)
        if not tokens:
            return Draft(tokens=context[:0], confidences=[], entropies=[])
        return Draft(
            tokens=torch.cat(tokens).to(context.device),
            probs=torch.stack(probs).to(context.device) if probs else None,
            confidences=confidences,
            entropies=entropies,
        )
