"""Device cost profile: seconds of a draft token and of a target verify pass over k + 1 tokens.

Measured through the one loop (`speculative_step`) with a drafter that proposes k random tokens at no
cost, so verify_s is exactly the target pass + verification + cache rollback of a real step; the
draft's own cost per token is timed by calling its `propose`. Medians of repeats, GPU synchronised.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import torch

from .drafters import Draft
from .loop import speculative_step, start, synchronize
from .sampling import Sampling


class RandomDrafter:
    """Proposes k random tokens (profiling only: measures the verify cost of k drafted tokens)."""

    name = "random"
    needs_hidden = False

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self, prompt):
        pass

    def rollback(self, length):
        pass

    def reset_batch(self, contexts):
        pass

    def rollback_batch(self, lengths, rows):
        pass

    def propose(self, context, k, sampling, generator, stop_below=None, target_hidden=None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (k,), generator=self.generator).to(context.device)
        return Draft(tokens=tokens, confidences=[1.0] * k, entropies=[0.0] * k)

    def propose_batch(self, contexts, k, sampling, generator, stop_below=None, target_hidden=None, rows=None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (len(contexts), k), generator=self.generator).to(contexts[0].device)
        return Draft(tokens=tokens, confidences=[1.0] * k, entropies=[0.0] * k)


def filler_ids(prompt_ids: list[int], length: int) -> list[int]:
    return (list(prompt_ids) * (length // max(1, len(prompt_ids)) + 1))[:length]


def profile_costs(target, draft, prompt_ids: list[int], k_max: int = 8, context_lens=(64, 256, 1024),
                  repeats: int = 5, progress=None, batch_sizes=()) -> dict:
    """{context_lens, k, verify_s[c][k], draft_s_per_token[c], noise}: medians over `repeats`; with
    `batch_sizes`, also batch_verify_s[b][k] and batch_draft_s_per_token[b] at the first context length."""
    target = dataclasses.replace(target, eos_ids=frozenset())  # an EOS must not end a timing sequence
    window = target.context_window or 10**9
    lens = [c for c in context_lens if c + repeats * (k_max + 2) * (k_max + 1) < window]
    from .hardware import shared_monitor

    monitor = shared_monitor(str(target.device))
    verify, draft_cost, spreads, hardware = [], [], [], []
    randomizer = RandomDrafter(target.vocab_size)
    greedy = Sampling()
    device = target.device
    for c in lens:
        budget = repeats * (k_max + 1) * (k_max + 2) + 4
        state = start(target, randomizer, filler_ids(prompt_ids, c), budget)
        speculative_step(state, k_max)  # warm-up
        samples: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
        for r in range(repeats):
            order = list(range(k_max + 1))
            order = order[r % len(order):] + order[: r % len(order)]
            for k in order:
                samples[k].append(speculative_step(state, k).verify_s)
                hardware.append(monitor.read())
                if progress:
                    progress.update()
        row = [statistics.median(samples[k]) for k in range(k_max + 1)]
        verify.append(row)
        spreads += [float(np.std(np.log(samples[k]))) for k in range(k_max + 1)]
        draft_cost.append(_draft_cost(draft, state, k_max, repeats, greedy, device) if draft is not None else 0.0)
    profile = {"context_lens": lens, "k": list(range(k_max + 1)), "verify_s": verify, "draft_s_per_token": draft_cost,
               "noise": float(np.median(spreads)) if spreads else 0.0, "repeats": repeats,
               "hardware": np.mean(hardware, axis=0).round(4).tolist() if hardware else None}
    if batch_sizes and lens:
        profile.update(profile_batches(target, draft, prompt_ids, k_max, lens[0], repeats, batch_sizes, progress))
    return profile


def profile_batches(target, draft, prompt_ids, k_max: int, context_len: int, repeats: int, batch_sizes, progress=None) -> dict:
    """Step seconds of a batch of b rows verifying k drafted tokens each (b in batch_sizes), and the
    draft's seconds per drafted token at that batch size: what batch-size-keyed tables are built from."""
    randomizer = RandomDrafter(target.vocab_size)
    verify, draft_cost = [], []
    for b in batch_sizes:
        budget = repeats * (k_max + 1) * (k_max + 2) + 4
        state = start(target, randomizer, [filler_ids(prompt_ids, context_len)] * b, budget)
        speculative_step(state, k_max)  # warm-up
        samples: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
        for r in range(repeats):
            order = list(range(k_max + 1))
            order = order[r % len(order):] + order[: r % len(order)]
            for k in order:
                samples[k].append(speculative_step(state, k).verify_s)
                if progress:
                    progress.update()
        verify.append([statistics.median(samples[k]) for k in range(k_max + 1)])
        draft_cost.append(_draft_cost_batch(draft, state, k_max, repeats) if draft is not None and b > 1
                          else (_draft_cost(draft, state, k_max, repeats, Sampling(), target.device) if draft is not None else 0.0))
    return {"batch_sizes": list(batch_sizes), "batch_context_len": context_len, "batch_verify_s": verify,
            "batch_draft_s_per_token": draft_cost}


def _draft_cost_batch(draft, state, k_max: int, repeats: int) -> float:
    """Seconds per drafted position (all rows together) of a batch proposal."""
    if not hasattr(draft, "propose_batch"):
        return 0.0
    contexts = [r.context for r in state.active_rows]
    hidden = None
    if draft.needs_hidden:
        with torch.inference_mode():
            out = state.target.model(input_ids=torch.stack([c[:-1] for c in contexts]), output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
    draft.reset_batch(contexts)
    rows = list(range(len(contexts)))
    confirmed = [c.shape[0] - 1 for c in contexts]
    draft.propose_batch(contexts, 1, Sampling(), None, target_hidden=hidden, rows=rows)  # the draft's own prefill
    draft.rollback_batch(confirmed, rows)
    per_token = []
    for _ in range(repeats):
        synchronize(state.target.device)
        t0 = time.perf_counter()
        proposal = draft.propose_batch(contexts, k_max, Sampling(), None, target_hidden=hidden, rows=rows)
        synchronize(state.target.device)
        if proposal.tokens.shape[1]:
            per_token.append((time.perf_counter() - t0) / proposal.tokens.shape[1])
        draft.rollback_batch(confirmed, rows)
    return statistics.median(per_token) if per_token else 0.0


def _draft_cost(draft, state, k_max: int, repeats: int, sampling: Sampling, device) -> float:
    context = state.active_rows[0].context
    hidden = None
    if draft.needs_hidden:  # the target's hidden state at the last processed position, as in the loop
        with torch.inference_mode():
            out = state.target.model(input_ids=context[None, :-1], output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1]
    draft.reset(context)
    draft.propose(context, 1, sampling, None, target_hidden=hidden)  # prefill the draft's own cache
    draft.rollback(context.shape[0] - 1)
    per_token = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        proposal = draft.propose(context, k_max, sampling, None, target_hidden=hidden)
        synchronize(device)
        if proposal.tokens.shape[0]:
            per_token.append((time.perf_counter() - t0) / proposal.tokens.shape[0])
        draft.rollback(context.shape[0] - 1)
    return statistics.median(per_token) if per_token else 0.0
