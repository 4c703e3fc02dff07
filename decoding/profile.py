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

    def propose(self, context, k, sampling, generator, stop_below=None, target_hidden=None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (k,), generator=self.generator).to(context.device)
        return Draft(tokens=tokens, confidences=[1.0] * k, entropies=[0.0] * k)


def filler_ids(prompt_ids: list[int], length: int) -> list[int]:
    return (list(prompt_ids) * (length // max(1, len(prompt_ids)) + 1))[:length]


def profile_costs(target, draft, prompt_ids: list[int], k_max: int = 8, context_lens=(64, 256, 1024),
                  repeats: int = 5, progress=None) -> dict:
    """{context_lens, k, verify_s[c][k], draft_s_per_token[c], noise}: medians over `repeats`."""
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
    return {"context_lens": lens, "k": list(range(k_max + 1)), "verify_s": verify, "draft_s_per_token": draft_cost,
            "noise": float(np.median(spreads)) if spreads else 0.0, "repeats": repeats,
            "hardware": np.mean(hardware, axis=0).round(4).tolist() if hardware else None}


def _draft_cost(draft, state, k_max: int, repeats: int, sampling: Sampling, device) -> float:
    context = state.context
    draft.reset(context)
    draft.propose(context, 1, sampling, None)  # prefill the draft's own cache
    draft.rollback(context.shape[0] - 1)
    per_token = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        proposal = draft.propose(context, k_max, sampling, None)
        synchronize(device)
        if proposal.tokens.shape[0]:
            per_token.append((time.perf_counter() - t0) / proposal.tokens.shape[0])
        draft.rollback(context.shape[0] - 1)
    return statistics.median(per_token) if per_token else 0.0
