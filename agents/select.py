"""Which phase's policy a run exports: each phase's policy replayed on train prompts that no phase trained on.

A run holds out a share of its train prompts (`holdout`, the YAML's `select_holdout`): the warm start and every PPO
phase train on the rest, and at the end the warm start and each phase's policy (its MLP, no deferral) are replayed
on the held-out prompts' traces under every machine condition at every batch size. At each batch size the phase with
the highest geometric-mean speedup over plain decoding (over the conditions) decides: the exported policy holds the
one-row winner's network and, where another phase won a batch size, that phase's network for it (`by_batch`). PPO
fine-tuning can gain at some batch sizes and lose at others (its credit in a batch comes later than at one row).
The test and ood splits are never read.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path

from specpilot.decoding.learned import LearnedK
from specpilot.env.replay_env import MachineCondition, replay_evaluate


def held_out(question_ids: list[str], share: float) -> set[str]:
    """The question ids held out for the selection: a fixed share of them, by the CRC-32 of the id (the same ids
    on every machine and every run)."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"the held-out share is in [0, 1), got {share}")
    return {q for q in question_ids if zlib.crc32(q.encode()) % 1000 < round(1000 * share)}


def selection_scores(candidates: dict[str, Path], traces, conditions: list[MachineCondition], k_max: int,
                     batch_sizes: list[int], max_new_tokens: int, device: str, draft: str) -> dict[str, dict]:
    """{candidate: {"score": geometric mean speedup, "cells": {"CONDITION B=b": speedup}}} on the held-out traces."""
    scores = {}
    for name, path in candidates.items():
        mlp = LearnedK.load(path, device=device, draft=draft, defer=False, replay=True)
        cells = {}
        for condition in conditions:
            for b in batch_sizes:
                if len(traces) < b:
                    continue
                result = replay_evaluate({name: mlp}, traces, condition.cost, k_max, condition.hardware, b, max_new_tokens)
                cells[f"{condition.name} B={b}"] = round(result[name]["speedup"], 5)
        scores[name] = {"score": math.exp(sum(math.log(v) for v in cells.values()) / len(cells)), "cells": cells}
    return scores


def batch_choice(scores: dict[str, dict], order: list[str]) -> dict[int, str]:
    """{batch size: the candidate with the highest geometric-mean speedup over the conditions at that batch size}
    from `selection_scores`; a tie goes to the later candidate in `order` (the later phase)."""
    sizes = sorted({int(cell.rsplit("B=", 1)[1]) for v in scores.values() for cell in v["cells"]})

    def at(name: str, b: int) -> float:
        cells = [x for cell, x in scores[name]["cells"].items() if cell.endswith(f" B={b}")]
        return math.exp(sum(math.log(x) for x in cells) / len(cells)) if cells else 0.0

    return {b: max(reversed(order), key=lambda name: at(name, b)) for b in sizes}
