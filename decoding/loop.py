"""Layers 3 and 4: one `speculative_step` and the one `generate` loop (gpt-fast style).

Invariant between steps: the target's KV cache holds every confirmed token but the last one, which
is fed again (with the k drafted tokens) in the next verify pass. So k = 0 is exactly a plain decode
step, and after verification the cache is cropped to the accepted length: the accepted prefix is
never recomputed. The same code decodes a batch: one k per step, each row accepting its own number
of tokens (see DecodeState). The env, the benchmark and the CLIs all drive this loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .drafters import Draft, Drafter, StopRule, cache_kwarg, crop_cache, hidden_features
from .errors import SpecPilotError
from .observation import ObservationBuilder
from .sampling import Sampling, probs_from_logits
from .stats import Generation, GenerationStats
from .verify import verify_greedy_rows, verify_sampling

if TYPE_CHECKING:
    from .models import Target
    from .policies import LengthPolicy


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that the clock measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepResult:
    """One draft-verify step (of one sequence, or of a batch: one k, each row its own accepted count)."""

    k: int
    """Tokens actually drafted and verified per row (may be below the requested k)."""
    k_requested: int
    accepted: float
    """Drafted tokens the target kept (an int for one sequence; the mean over the rows of a batch)."""
    new_tokens: list[int]
    """Tokens appended (accepted + 1 per row, fewer if EOS or the budget ended it); all rows concatenated."""
    draft_s: float
    verify_s: float
    confidences: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    match_len: float = 0
    context_len: int = 0
    """Confirmed tokens before the step (the mean over a batch's rows)."""
    accepted_rows: list[int] = field(default_factory=list)
    """Per active row: drafted tokens kept."""
    new_rows: list[list[int]] = field(default_factory=list)
    """Per active row: tokens appended."""
    source: str | None = None
    """The draft source of the step where the drafter has several (`hybrid.HybridDrafter`): lookup, head, extend."""

    def __post_init__(self) -> None:
        if not self.accepted_rows:
            self.accepted_rows = [int(self.accepted)]
        if not self.new_rows:
            self.new_rows = [list(self.new_tokens)]

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s

    @property
    def batch_size(self) -> int:
        return len(self.accepted_rows)


class RowView:
    """What a row (buffer, length, prompt_len, max_new_tokens) derives; shared with the replay env."""

    @property
    def context(self):
        return self.buffer[: self.length]

    @property
    def generated(self) -> list[int]:
        return self.buffer[self.prompt_len : self.length].tolist()

    @property
    def host_context(self):
        """The context as a numpy view where the row has one (a CPU buffer's `host`), else `context`: what the
        observation's free reads of a drafter (`peek`, `match_stats`) take."""
        host = getattr(self, "host", None)
        return self.context if host is None else host[: self.length]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (self.length - self.prompt_len)

    context_offset = 0
    """Tokens before the prompt that the row does not hold (a replay row at a simulated context length)."""

    @property
    def context_len(self) -> int:
        """The context the row's next step runs at (what a step costs and what the observation reads)."""
        return self.context_offset + self.length


class BatchView:
    """A batch of `rows` with the `active` ones in cache order; one sequence reads like its row.
    Shared by DecodeState and the replay env's state, so the observation builder sees one shape."""

    @property
    def active_rows(self) -> list:
        return [self.rows[i] for i in self.active]

    @property
    def batch_size(self) -> int:
        return len(self.active)

    @property
    def done(self) -> bool:
        return not self.active

    @property
    def remaining(self) -> int:
        return max(self.rows[i].remaining for i in self.active) if self.active else 0

    @property
    def buffer(self):
        return self.rows[0].buffer

    @property
    def length(self) -> int:
        return self.rows[0].length

    @property
    def prompt_len(self) -> int:
        return self.rows[0].prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.rows[0].max_new_tokens

    @property
    def context(self):
        return self.rows[0].context

    @property
    def generated(self) -> list[int]:
        return self.rows[0].generated


@dataclass
class Row(RowView):
    """One sequence of a batch: its confirmed tokens."""

    buffer: torch.Tensor
    length: int
    prompt_len: int
    max_new_tokens: int
    done: bool = False
    host: np.ndarray | None = field(default=None, repr=False)
    """A CPU buffer's numpy view (the same memory): a step appends its tokens through it, without a torch call
    (each costs 20-45 us on the cold caches a decode leaves, against 5-10 for numpy's)."""

    def __post_init__(self) -> None:
        if self.host is None:
            self.rebind(self.buffer)

    def rebind(self, buffer: torch.Tensor) -> None:
        """Hold `buffer` (and its host view) from now on."""
        self.buffer = buffer
        self.host = buffer.numpy() if buffer.device.type == "cpu" else None


@dataclass
class DecodeState(BatchView):
    """B sequences decoded together (B = 1 is the common case) and both models' caches.

    The target's KV cache is shared by the active rows and has the same number of slots in each. A
    row that accepts fewer drafted tokens than another leaves its rejected slots in the cache, masked
    out by `slot_mask` forever (positions come from the row's own length, so the holes are invisible
    to it); slots rejected by every row are cropped, so with one row there are never holes and no
    mask. Finished rows are dropped from the cache (`active` maps cache rows to `rows`).
    """

    target: Any
    draft: Drafter | None
    sampling: Sampling
    rows: list[Row]
    cache: Any
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None
    """(active rows, hidden) the target's last hidden state per row (drafts that need it only)."""
    active: list[int] = field(default_factory=list)
    slot_mask: torch.Tensor | None = None
    """(active rows, cache slots) 1 = a confirmed token of that row; None for a single sequence."""
    batched: bool = False
    prefill_s: float = 0.0
    no_tokens: torch.Tensor | None = None
    """The empty draft of a plain step (`_no_tokens`)."""


def _target_forward(state: DecodeState, ids: torch.Tensor, positions: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None):
    model = state.target.model
    threads = getattr(state.target, "threads", None)
    if threads is not None:  # the CPU's threads follow the cores a co-running load leaves free (decoding/threads.py)
        threads.apply()
    extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
    return model(
        input_ids=ids,
        use_cache=True,
        output_hidden_states=bool(state.draft is not None and state.draft.needs_hidden),
        **{cache_kwarg(model): state.cache},
        **extra,
    )


def _as_rows(prompt_ids) -> tuple[list[torch.Tensor], bool]:
    """Prompts as 1-D tensors, and whether a batch (a list of prompts) was given."""
    if isinstance(prompt_ids, torch.Tensor):
        return ([prompt_ids.flatten()] if prompt_ids.dim() < 2 else list(prompt_ids)), prompt_ids.dim() == 2
    prompt_ids = list(prompt_ids)
    if prompt_ids and isinstance(prompt_ids[0], (list, tuple, torch.Tensor)):
        return [torch.as_tensor(p, dtype=torch.long, device="cpu").flatten() for p in prompt_ids], True
    return [torch.as_tensor(prompt_ids, dtype=torch.long, device="cpu").flatten()], False


@torch.inference_mode()
def start(
    target: "Target",
    draft: Drafter | None,
    prompt_ids,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int | None = 0,
) -> DecodeState:
    """Prefill the target (all prompt tokens but the last) and reset the draft.

    `prompt_ids`: one prompt (a list of ids or a 1-D tensor) or a batch (a list of such lists).
    """
    prompts, batched = _as_rows(prompt_ids)
    if not prompts:
        raise SpecPilotError("no prompts given")
    if max_new_tokens < 1:
        raise SpecPilotError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    window = target.context_window
    for prompt in prompts:
        if prompt.numel() == 0:
            raise SpecPilotError("the prompt is empty")
        if window and prompt.numel() >= window:
            raise SpecPilotError(f"the prompt has {prompt.numel()} tokens; the target's context window is {window}")
    device = target.device
    rows = []
    for prompt in prompts:
        buffer = torch.zeros(prompt.numel() + max_new_tokens, dtype=torch.long, device=device)
        buffer[: prompt.numel()] = prompt.to(device)
        rows.append(Row(buffer, prompt.numel(), prompt.numel(), max_new_tokens))
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    state = DecodeState(
        target=target, draft=draft, sampling=sampling, rows=rows,
        cache=target.new_cache(), generator=generator,
        active=list(range(len(rows))), batched=batched,
    )
    if draft is not None and batched and not hasattr(draft, "propose_batch"):
        raise SpecPilotError(f"the draft '{draft.name}' does not support batched decoding; use ngram or the draft head")
    synchronize(device)
    t0 = time.perf_counter()
    if len(rows) == 1:
        if rows[0].length > 1:
            out = _target_forward(state, rows[0].buffer[None, : rows[0].length - 1])
            if out.hidden_states is not None:
                state.hidden = hidden_features(out.hidden_states, state.draft)[:, -1]
    else:
        _prefill_batch(state)
    if draft is not None:
        if batched:
            draft.reset_batch([r.context for r in rows])
        else:
            draft.reset(state.context)
    synchronize(device)
    state.prefill_s = time.perf_counter() - t0
    return state


def _prefill_batch(state: DecodeState) -> None:
    """Left-padded prefill of every row's prompt but its last token; pads are masked slots."""
    rows = state.rows
    width = max(r.length - 1 for r in rows)
    device = rows[0].buffer.device
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    state.slot_mask = mask
    if width == 0:
        return
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        n = r.length - 1
        if n:
            ids[i, width - n :] = r.buffer[:n]
            mask[i, width - n :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    out = _target_forward(state, ids, positions, mask)
    if out.hidden_states is not None:
        state.hidden = hidden_features(out.hidden_states, state.draft)[:, -1]


def _no_tokens(state: DecodeState) -> torch.Tensor:
    """An empty (active rows, 0) draft, made once per batch size (a plain step allocates nothing)."""
    rows = len(state.active)
    if state.no_tokens is None or state.no_tokens.shape[0] != rows:
        state.no_tokens = torch.empty(rows, 0, dtype=torch.long, device=state.rows[0].buffer.device)
    return state.no_tokens


def _propose(state: DecodeState, k: int, stop: StopRule | None, source: str | None = None) -> Draft:
    """The draft's proposal for every active row: tokens (rows, n), probs (rows, n, V) or None. `source` goes to a
    drafter with several (`hybrid.HybridDrafter`)."""
    if k <= 0 or state.draft is None:
        return Draft(tokens=_no_tokens(state))
    extra = {"source": source} if source is not None else {}
    if not state.batched and len(state.active) == 1:
        draft = state.draft.propose(state.context, k, state.sampling, state.generator, stop=stop,
                                    target_hidden=state.hidden, **extra)
        draft.tokens = draft.tokens[None]
        if draft.probs is not None:
            draft.probs = draft.probs[None]
        return draft
    return state.draft.propose_batch([r.context for r in state.active_rows], k, state.sampling, state.generator,
                                     stop=stop, target_hidden=state.hidden, rows=list(state.active), **extra)


@torch.inference_mode()
def speculative_step(state: DecodeState, k: int, stop: StopRule | None = None, source: str | None = None) -> StepResult:
    """Draft up to k tokens per active row (from `source`, for a drafter with several), verify them in one target
    pass, keep each row's accepted prefix + 1 token."""
    return _step(state, k, stop, source)


def _step(state: DecodeState, k: int, stop: StopRule | None = None, source: str | None = None) -> StepResult:
    """`speculative_step` inside an inference_mode the caller entered (`generate`: one for the whole loop)."""
    if state.done:
        raise SpecPilotError("the sequence is finished; start a new one")
    k_requested = k
    rows = state.active_rows
    k = max(0, min(k, state.remaining - 1)) if state.draft is not None else 0
    device = rows[0].buffer.device
    synchronize(device)
    t0 = time.perf_counter()
    draft = _propose(state, k, stop, source)
    synchronize(device)
    t1 = time.perf_counter()
    k = draft.tokens.shape[1]
    if len(rows) == 1:  # a view of the row's last token, no copy
        last = rows[0].buffer[None, rows[0].length - 1 : rows[0].length]
    else:
        last = torch.stack([r.buffer[r.length - 1] for r in rows])[:, None]
    feed = torch.cat([last, draft.tokens], dim=1) if k else last
    slots = state.cache.get_seq_length()
    if state.slot_mask is None:
        out = _target_forward(state, feed)
    else:
        lengths = torch.tensor([r.length for r in rows], device=device)
        positions = (lengths - 1)[:, None] + torch.arange(k + 1, device=device)
        mask = torch.cat([state.slot_mask, torch.ones_like(feed)], dim=1)
        out = _target_forward(state, feed, positions, mask)
    if state.sampling.greedy:  # every row at once, one transfer to the host
        # a target that reads the argmax off its own buffer gives it (decoding/llama_cpp.py), else the logits
        tokens = getattr(out, "greedy_tokens", None)
        accepted_rows, new_lists, kept = verify_greedy_rows(draft.tokens, out.logits if tokens is None else tokens)
        new_rows = [kept[i, : len(new)] for i, new in enumerate(new_lists)] if rows[0].host is None else new_lists
    else:
        accepted_rows, new_rows, new_lists = [], [], []
        for i in range(len(rows)):
            tokens = draft.tokens[i]
            target_probs = probs_from_logits(out.logits[i], state.sampling)
            draft_probs = draft.probs[i] if draft.probs is not None else None
            if draft_probs is None:  # a deterministic drafter: q is a point mass on each drafted token
                draft_probs = torch.nn.functional.one_hot(tokens, target_probs.shape[-1]).float()
            accepted, new = verify_sampling(tokens, draft_probs, target_probs, state.generator)
            accepted_rows.append(accepted)
            new_rows.append(new)
        new_lists = [new.tolist() for new in new_rows]
    # the cache gained k + 1 slots per row; a row keeps its fed token + its accepted drafts (its newest
    # token is fed next step); slots no row keeps are cropped
    crop_cache(state.cache, slots + max(accepted_rows) + 1)
    if state.slot_mask is not None:
        kept = torch.arange(k + 1, device=device)[None] <= torch.tensor(accepted_rows, device=device)[:, None]
        state.slot_mask = torch.cat([state.slot_mask, kept.long()], dim=1)[:, : slots + max(accepted_rows) + 1]
    if out.hidden_states is not None:
        index = torch.tensor(accepted_rows, device=device)
        state.hidden = hidden_features(out.hidden_states, state.draft)[torch.arange(len(rows), device=device), index]
    lengths_before = [r.length for r in rows]
    if state.draft is not None:
        if len(rows) == 1 and not state.batched:
            state.draft.rollback(lengths_before[0] + accepted_rows[0])
        else:
            state.draft.rollback_batch([n + a for n, a in zip(lengths_before, accepted_rows)], list(state.active))
    eos = state.target.eos_ids
    appended = []
    for r, new, listed in zip(rows, new_rows, new_lists):
        tokens = listed[: r.remaining]
        for j, token in enumerate(tokens):
            if token in eos:
                tokens = tokens[: j + 1]
                r.done = True
                break
        n = len(tokens)
        if r.host is not None:  # the host view, from the host list
            r.host[r.length : r.length + n] = tokens
        else:
            r.buffer[r.length : r.length + n] = new[:n]
        r.length += n
        r.done = r.done or r.remaining <= 0
        appended.append(tokens)
    if any(r.done for r in rows):
        _drop_finished(state)
    synchronize(device)
    t2 = time.perf_counter()
    n_rows = len(rows)
    return StepResult(
        k=k, k_requested=k_requested,
        accepted=accepted_rows[0] if n_rows == 1 else sum(accepted_rows) / n_rows,
        new_tokens=[t for tokens in appended for t in tokens],
        draft_s=t1 - t0, verify_s=t2 - t1, confidences=draft.confidences,
        entropies=draft.entropies, match_len=draft.match_len,
        context_len=round(sum(lengths_before) / n_rows),
        accepted_rows=accepted_rows, new_rows=appended, source=getattr(state.draft, "last_source", None) if k else None,
    )


def _drop_finished(state: DecodeState) -> None:
    keep = [j for j, i in enumerate(state.active) if not state.rows[i].done]
    if keep and len(keep) < len(state.active):
        index = torch.tensor(keep, device=state.rows[0].buffer.device)
        state.cache.batch_select_indices(index)
        if state.slot_mask is not None:
            state.slot_mask = state.slot_mask[index]
        if state.hidden is not None:
            state.hidden = state.hidden[index]
    state.active = [state.active[j] for j in keep]


def generate(
    target: "Target",
    draft: Drafter | None,
    policy: "LengthPolicy",
    prompt_ids,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int | None = 0,
    observer: "ObservationBuilder | None" = None,
    on_step: Callable[[StepResult], None] | None = None,
) -> Generation:
    """Decode one prompt (a list of ids) or a batch (a list of prompts): per step observe, choose k,
    run one speculative step, update."""
    if policy.k_max > 0 and draft is None:
        raise SpecPilotError(f"policy '{policy.name}' drafts tokens but no draft was given")
    observer = observer or ObservationBuilder(k_max=policy.k_max)
    state = start(target, draft, prompt_ids, max_new_tokens, sampling, seed)
    policy.reset()
    observer.reset(state)
    steps: list[StepResult] = []
    policy_s = 0.0
    clock = time.perf_counter
    synchronize(state.buffer.device)
    with torch.inference_mode():
        t0 = clock()
        while not state.done:
            t_obs = clock()
            k = policy.choose_k(observer.build(state))
            policy_s += clock() - t_obs
            step = _step(state, k, policy.stop, getattr(policy, "source", None))  # set by choose_k, per step
            policy.update(step)
            observer.push(step)
            steps.append(step)
            if on_step is not None:
                on_step(step)
        seconds = clock() - t0
    token_ids = [r.generated for r in state.rows] if state.batched else state.generated
    return Generation(token_ids, steps, GenerationStats.from_steps(steps, seconds, state.prefill_s, policy_s))
