"""Device cost profile: seconds of a draft token and of a target verify pass over k + 1 tokens.

Measured through the one loop (`speculative_step`) with a drafter that proposes k random tokens at no
cost, so verify_s is exactly the target pass + verification + cache rollback of a real step; the
draft's own cost per token is timed by calling its `propose`. Medians of repeats, GPU synchronised.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np
import torch

from specpilot.decoding.drafters import Draft, hidden_features
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import HW_FEATURES, WINDOW_S, shared_monitor
from specpilot.decoding.loop import speculative_step, start, synchronize
from specpilot.decoding.sampling import Sampling


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

    def propose(self, context, k, sampling, generator, stop=None, target_hidden=None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (k,), generator=self.generator, device="cpu").to(context.device)
        return Draft(tokens=tokens, confidences=[1.0] * k, entropies=[0.0] * k)

    def propose_batch(self, contexts, k, sampling, generator, stop=None, target_hidden=None, rows=None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (len(contexts), k), generator=self.generator, device="cpu").to(contexts[0].device)
        return Draft(tokens=tokens, confidences=[1.0] * k, entropies=[0.0] * k)


def filler_ids(prompt_ids: list[int], length: int) -> list[int]:
    return (list(prompt_ids) * (length // max(1, len(prompt_ids)) + 1))[:length]


def steps_budget(k_max: int, repeats: int) -> int:
    """The most tokens `_timed_steps` appends (every draft accepted): per repeat a plain step and, per k, a plain step,
    the k step (k + 1 tokens) and a plain step; the warm-up's k_max + 2."""
    return repeats * (1 + 3 * k_max + k_max * (k_max + 1) // 2) + k_max + 2


def profile_costs(target, draft, prompt_ids: list[int], k_max: int = 8, context_lens=(64, 256, 1024),
                  repeats: int = 5, progress=None, batch_sizes=(), grid_context_lens=()) -> dict:
    """{context_lens, k, verify_s[c][k], draft_s_per_token[c], noise}: medians over `repeats`; with
    `batch_sizes`, also batch_verify_s[b][k] and batch_draft_s_per_token[b] at the first context length, and
    with `grid_context_lens` too the full grid: every batch size at each of those context lengths."""
    target = dataclasses.replace(target, eos_ids=frozenset())  # an EOS must not end a timing sequence
    window = target.context_window or 10**9
    lens = [c for c in context_lens if c + steps_budget(k_max, repeats) < window]
    if not lens:
        raise SpecPilotError(f"every --context-lens value {list(context_lens)} leaves no room in the target's context "
                             f"window ({window} tokens) for {repeats} repeats of k = 0..{k_max}; use shorter contexts")
    if len(lens) < len(context_lens):
        print(f"warning: context lengths {sorted(set(context_lens) - set(lens))} do not fit the target's context window "
              f"({window} tokens) with room to time every k; profiling {lens}", file=sys.stderr)
    monitor = shared_monitor(str(target.device))
    verify, draft_cost, spreads, hardware = [], [], [], []
    randomizer = RandomDrafter(target.vocab_size)
    for c in lens:
        budget = steps_budget(k_max, repeats)
        state = start(target, randomizer, filler_ids(prompt_ids, c), budget)
        samples = _timed_steps(state, k_max, repeats, progress, lambda: hardware.append(monitor.read()))
        verify.append([statistics.median(samples[k]) for k in range(k_max + 1)])
        spreads += [float(np.std(np.log(samples[k]))) for k in range(k_max + 1)]
        draft_cost.append(_draft_cost(draft, state, k_max, repeats) if draft is not None else 0.0)
    profile = {"context_lens": lens, "k": list(range(k_max + 1)), "verify_s": verify, "draft_s_per_token": draft_cost,
               "noise": float(np.median(spreads)) if spreads else 0.0, "repeats": repeats,
               "hardware": np.mean(hardware, axis=0).round(4).tolist() if hardware else None,
               "hardware_features": list(HW_FEATURES)}
    if batch_sizes and lens:
        profile.update(profile_batches(target, draft, prompt_ids, k_max, lens[0], repeats, batch_sizes, progress))
    grid_lens = [c for c in grid_context_lens if c + steps_budget(k_max, repeats) < window]
    if batch_sizes and grid_lens:
        profile["grid"] = profile_grid(target, draft, prompt_ids, k_max, grid_lens, repeats, batch_sizes, progress)
    return profile


def profile_grid(target, draft, prompt_ids, k_max: int, context_lens, repeats: int, batch_sizes, progress=None) -> dict:
    """Step seconds of every batch size at every context length (all rows that long: the cache's width,
    which is what a left-padded batch pays for): {batch_sizes, context_lens, verify_s[b][c][k],
    draft_s_per_token[b][c]}, the layout of a simulated profile's grid, which the cost model looks up
    directly (on this CPU a long context costs a batch more than it costs one row)."""
    rows = [profile_batches(target, draft, prompt_ids, k_max, c, repeats, batch_sizes, progress) for c in context_lens]
    return {"batch_sizes": list(batch_sizes), "context_lens": list(context_lens),
            "verify_s": [[row["batch_verify_s"][i] for row in rows] for i in range(len(batch_sizes))],
            "draft_s_per_token": [[row["batch_draft_s_per_token"][i] for row in rows] for i in range(len(batch_sizes))],
            "measured": True}


def fit_grid_in_context(grid: dict) -> dict:
    """The grid with each (batch size, k)'s verify seconds, and each batch size's draft seconds, replaced by their
    least-squares line in the context length: a step reads the cache once, so its cost is linear in the context,
    and one cell's median of a few repeats on a shared CPU is off by a tenth (the profile's `noise`); the line
    through four cells averages that out (a falling line is held flat at the mean). The medians are kept as
    verify_s_measured / draft_s_per_token_measured (a refit starts from them again). Fewer than three context lengths: returned unchanged. Seconds are floored
    at half the smallest measured cell of their row, so that no line goes to zero."""
    contexts = np.asarray(grid["context_lens"], dtype=np.float64)
    if len(contexts) < 3:
        return grid
    design = np.stack([np.ones_like(contexts), contexts], axis=1)

    def fit(values) -> list:
        values = np.asarray(values, dtype=np.float64)  # (batch, context, ...)
        flat = values.reshape(values.shape[0], values.shape[1], -1)
        out = np.empty_like(flat)
        for b in range(flat.shape[0]):
            coef = np.linalg.lstsq(design, flat[b], rcond=None)[0]
            falling = coef[1] < 0  # a longer cache never costs less: a falling line is noise, held flat at the mean
            coef[:, falling] = np.stack([flat[b][:, falling].mean(axis=0), np.zeros(int(falling.sum()))])
            out[b] = np.maximum(design @ coef, 0.5 * flat[b].min(axis=0))
        return out.reshape(values.shape).tolist()

    verify = grid.get("verify_s_measured", grid["verify_s"])
    draft = grid.get("draft_s_per_token_measured", grid["draft_s_per_token"])
    return {**grid, "verify_s": fit(verify), "draft_s_per_token": fit(draft), "verify_s_measured": verify,
            "draft_s_per_token_measured": draft, "context_fit": "linear"}


def profile_batches(target, draft, prompt_ids, k_max: int, context_len: int, repeats: int, batch_sizes, progress=None) -> dict:
    """Step seconds of a batch of b rows verifying k drafted tokens each (b in batch_sizes), and the
    draft's seconds per drafted token at that batch size: what batch-size-keyed tables are built from."""
    randomizer = RandomDrafter(target.vocab_size)
    verify, draft_cost = [], []
    for b in batch_sizes:
        budget = steps_budget(k_max, repeats)
        # one row is timed as `generate` decodes one prompt: unbatched (no slot mask), the path the benchmark's
        # B = 1 runs (a batch of one takes the masked path; their costs measured alike)
        rows = filler_ids(prompt_ids, context_len) if b == 1 else [filler_ids(prompt_ids, context_len)] * b
        state = start(target, randomizer, rows, budget)
        samples = _timed_steps(state, k_max, repeats, progress)
        verify.append([statistics.median(samples[k]) for k in range(k_max + 1)])
        draft_cost.append(_draft_cost(draft, state, k_max, repeats) if draft is not None else 0.0)
    return {"batch_sizes": list(batch_sizes), "batch_context_len": context_len, "batch_verify_s": verify,
            "batch_draft_s_per_token": draft_cost}


def measure_counters(target, prompt_ids: list[int], seconds: float, settle_s: float = 3 * WINDOW_S) -> np.ndarray:
    """The mean of the hardware monitor's counters while the target decodes plainly for `seconds` (from the prompt,
    restarted when a sequence fills its budget); the first `settle_s` (three of the monitor's one-second windows: its
    damped load within 5% of a step) are not counted."""
    monitor = shared_monitor(str(target.device))
    read, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds + settle_s:
        state = start(target, RandomDrafter(target.vocab_size), list(prompt_ids), 64)
        while state.active:
            speculative_step(state, 0)
            if time.perf_counter() - started >= settle_s:
                read.append(monitor.read().copy())
            if time.perf_counter() - started >= seconds + settle_s:
                break
    return np.mean(read, axis=0)


def _timed_steps(state, k_max: int, repeats: int, progress=None, after_step=None) -> dict[int, list[float]]:
    """Verify seconds of `repeats` steps per k = 0..k_max, priced as the loop runs them: a plain step after a plain
    one (as most plain steps come), a drafting step after a plain one plus what it adds to the plain step after it.
    An engine that keeps the graph of the last batch shape (llama.cpp) rebuilds it at every change of shape, about
    a millisecond here: timed in a rotation of k, every step paid it, plain steps included, and a drafting step's
    price left out the plain step's it causes (the loop's drafting steps cost 1.10x their price, relative to plain
    ones, by `benchmark.py --replay-check`). The order of k is rotated every repeat."""
    def step(k: int) -> float:
        seconds = speculative_step(state, k).verify_s
        if after_step:
            after_step()
        return seconds

    step(k_max)  # warm-up
    step(0)
    samples: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
    for r in range(repeats):
        order = list(range(1, k_max + 1))
        order = order[r % len(order):] + order[: r % len(order)] if order else []
        samples[0].append(step(0))
        for k in order:
            before = step(0)
            drafted = step(k)
            samples[0].append(before)
            samples[k].append(drafted + max(0.0, step(0) - before))  # noise can make the plain step after faster
            if progress:
                progress.update()
        if progress:
            progress.update()
    return samples


def _draft_cost(draft, state, k_max: int, repeats: int) -> float:
    """Seconds per drafted position (all rows of `state` together), the draft's own prefill excluded."""
    contexts = [r.context for r in state.active_rows]
    batched = len(contexts) > 1
    if batched and not hasattr(draft, "propose_batch"):
        return 0.0
    hidden = None
    if draft.needs_hidden:  # the target's hidden state at the last processed position, as in the loop
        with torch.inference_mode():
            out = state.target.model(input_ids=torch.stack([c[:-1] for c in contexts]), output_hidden_states=True)
        hidden = hidden_features(out.hidden_states, draft)[:, -1]
    greedy, rows = Sampling(), list(range(len(contexts)))
    confirmed = [c.shape[0] - 1 for c in contexts]
    if batched:
        draft.reset_batch(contexts)

        def propose(k):
            return draft.propose_batch(contexts, k, greedy, None, target_hidden=hidden, rows=rows).tokens.shape[1]

        def rollback():
            draft.rollback_batch(confirmed, rows)
    else:
        draft.reset(contexts[0])

        def propose(k):
            return draft.propose(contexts[0], k, greedy, None, target_hidden=hidden).tokens.shape[0]

        def rollback():
            draft.rollback(confirmed[0])
    propose(1)  # the draft's own prefill
    rollback()
    device = state.target.device
    per_token = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        drafted = propose(k_max)
        synchronize(device)
        if drafted:
            per_token.append((time.perf_counter() - t0) / drafted)
        rollback()
    return statistics.median(per_token) if per_token else 0.0
