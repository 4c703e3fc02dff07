"""Layers 3 and 4: one `speculative_step` and the one `generate` loop (gpt-fast style).

Invariant between steps: the target's KV cache holds every confirmed token but the last one, which
is fed again (with the k drafted tokens) in the next verify pass. So k = 0 is exactly a plain decode
step, and after verification the cache is cropped to the accepted length: the accepted prefix is
never recomputed. The env, the benchmark and the CLIs all drive this loop.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .drafters import Draft, Drafter, cache_kwarg, crop_cache, empty_draft
from .errors import SpecPilotError
from .sampling import Sampling, probs_from_logits
from .verify import verify_greedy, verify_sampling

if TYPE_CHECKING:
    from .models import Target
    from .observation import ObservationBuilder
    from .policies import LengthPolicy


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that the clock measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepResult:
    """One draft-verify step."""

    k: int
    """Tokens actually drafted and verified (may be below the requested k)."""
    k_requested: int
    accepted: int
    """Drafted tokens the target kept."""
    new_tokens: list[int]
    """Tokens appended to the sequence (accepted + 1, fewer if EOS or the budget ended it)."""
    draft_s: float
    verify_s: float
    confidences: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    match_len: int = 0
    context_len: int = 0
    """Confirmed tokens before the step."""

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s


@dataclass
class DecodeState:
    """One sequence being decoded: the confirmed tokens and both models' caches."""

    target: Any
    draft: Drafter | None
    sampling: Sampling
    buffer: torch.Tensor
    length: int
    prompt_len: int
    max_new_tokens: int
    cache: Any
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None
    done: bool = False
    prefill_s: float = 0.0

    @property
    def context(self) -> torch.Tensor:
        return self.buffer[: self.length]

    @property
    def generated(self) -> list[int]:
        return self.buffer[self.prompt_len : self.length].tolist()

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (self.length - self.prompt_len)


def _target_forward(state: DecodeState, ids: torch.Tensor):
    model = state.target.model
    return model(
        input_ids=ids[None],
        use_cache=True,
        output_hidden_states=bool(state.draft is not None and state.draft.needs_hidden),
        **{cache_kwarg(model): state.cache},
    )


@torch.inference_mode()
def start(
    target: "Target",
    draft: Drafter | None,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int | None = 0,
) -> DecodeState:
    """Prefill the target (all prompt tokens but the last) and reset the draft."""
    from transformers import DynamicCache

    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise SpecPilotError("the prompt is empty")
    if max_new_tokens < 1:
        raise SpecPilotError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    window = target.context_window
    if window and prompt.numel() >= window:
        raise SpecPilotError(f"the prompt has {prompt.numel()} tokens; the target's context window is {window}")
    device = target.device
    buffer = torch.zeros(prompt.numel() + max_new_tokens, dtype=torch.long, device=device)
    buffer[: prompt.numel()] = prompt.to(device)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    state = DecodeState(
        target=target, draft=draft, sampling=sampling, buffer=buffer, length=prompt.numel(),
        prompt_len=prompt.numel(), max_new_tokens=max_new_tokens,
        cache=DynamicCache(config=target.model.config), generator=generator,
    )
    synchronize(device)
    t0 = time.perf_counter()
    if prompt.numel() > 1:
        out = _target_forward(state, state.buffer[: prompt.numel() - 1])
        if out.hidden_states is not None:
            state.hidden = out.hidden_states[-1][0]
    if draft is not None:
        draft.reset(state.context)
    synchronize(device)
    state.prefill_s = time.perf_counter() - t0
    return state


@torch.inference_mode()
def speculative_step(state: DecodeState, k: int, stop_below: float | None = None) -> StepResult:
    """Draft up to k tokens, verify them in one target pass, keep the accepted prefix + 1 token."""
    if state.done:
        raise SpecPilotError("the sequence is finished; start a new one")
    k_requested = k
    k = max(0, min(k, state.remaining - 1)) if state.draft is not None else 0
    context = state.context
    length = state.length
    device = state.buffer.device
    synchronize(device)
    t0 = time.perf_counter()
    draft: Draft = (
        state.draft.propose(context, k, state.sampling, state.generator, stop_below=stop_below, target_hidden=state.hidden)
        if k > 0
        else empty_draft(device)
    )
    synchronize(device)
    t1 = time.perf_counter()
    k = draft.tokens.shape[0]
    out = _target_forward(state, torch.cat([context[-1:], draft.tokens]))
    logits = out.logits[0]
    if state.sampling.greedy:
        accepted, new = verify_greedy(draft.tokens, logits)
    else:
        target_probs = probs_from_logits(logits, state.sampling)
        draft_probs = draft.probs
        if draft_probs is None:  # a deterministic drafter: q is a point mass on each drafted token
            draft_probs = torch.nn.functional.one_hot(draft.tokens, target_probs.shape[-1]).float()
        accepted, new = verify_sampling(draft.tokens, draft_probs, target_probs, state.generator)
    # the cache now holds length-1+k+1 positions; keep the confirmed ones except the newest token
    crop_cache(state.cache, length + accepted)
    if out.hidden_states is not None:
        state.hidden = out.hidden_states[-1][0, : accepted + 1]
    if state.draft is not None:
        state.draft.rollback(length + accepted)
    new_tokens = new.tolist()
    eos = state.target.eos_ids
    for i, token in enumerate(new_tokens):
        if token in eos:
            new_tokens = new_tokens[: i + 1]
            state.done = True
            break
    n = len(new_tokens)
    state.buffer[length : length + n] = new[:n]
    state.length = length + n
    if state.remaining <= 0:
        state.done = True
    synchronize(device)
    t2 = time.perf_counter()
    return StepResult(
        k=k, k_requested=k_requested, accepted=accepted, new_tokens=new_tokens,
        draft_s=t1 - t0, verify_s=t2 - t1, confidences=draft.confidences,
        entropies=draft.entropies, match_len=draft.match_len, context_len=length,
    )


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
        drafted = sum(s.k for s in steps)
        accepted = sum(s.accepted for s in steps)
        return cls(
            steps=n,
            new_tokens=new,
            seconds=seconds,
            tokens_per_s=new / seconds if seconds > 0 else 0.0,
            mean_k=drafted / n if n else 0.0,
            mean_accepted=accepted / n if n else 0.0,
            accept_rate=accepted / drafted if drafted else 0.0,
            accept_counts=dict(sorted(Counter(s.accepted for s in steps).items())),
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
    token_ids: list[int]
    steps: list[StepResult]
    stats: GenerationStats


def generate(
    target: "Target",
    draft: Drafter | None,
    policy: "LengthPolicy",
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int | None = 0,
    observer: "ObservationBuilder | None" = None,
    on_step: Callable[[StepResult], None] | None = None,
) -> Generation:
    """Decode one sequence: per step observe, choose k, run one speculative step, update."""
    from .observation import ObservationBuilder

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
    t0 = clock()
    while not state.done:
        t_obs = clock()
        k = policy.choose_k(observer.build(state))
        policy_s += clock() - t_obs
        step = speculative_step(state, k, stop_below=policy.stop_below)
        policy.update(step)
        observer.push(step)
        steps.append(step)
        if on_step is not None:
            on_step(step)
    seconds = clock() - t0
    return Generation(state.generated, steps, GenerationStats.from_steps(steps, seconds, state.prefill_s, policy_s))
