"""Plain (k = 0) decoding speed of a target on this device, as a function of context length.

The real-loop env prices plain decoding with it: a step's reward is the plain decoding time it saved, in plain
steps (env.episode.PlainCredit), so that returns compare across devices. A batch is priced at its cache width.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text, read_json_file

from .oracle import grid_lookup
from .profile import profile_costs


@dataclass
class PlainSpeed:
    """Measured seconds of one plain step at a few context lengths, linearly interpolated; for b rows, the
    measured `grid` when there is one, else `batch_scale`: the cost of a plain step of b rows relative to one
    row at one context (interpolated in log b)."""

    context_lens: list[int]
    seconds: list[float]
    meta: dict = field(default_factory=dict)
    batch_scale: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    grid: dict | None = None
    """{"batch_sizes", "context_lens", "seconds"[b][c]}: a plain step of every batch size at every context length
    (the cache's width), looked up bilinearly in (log b, context). On the CPU a long context costs a batch more
    than it costs one row, so one batch factor measured at one context misprices long batches."""

    def step_seconds(self, context_len: int, batch: int = 1) -> float:
        seconds = float(np.interp(context_len, self.context_lens, self.seconds))
        if batch == 1:
            return seconds
        if self.grid:
            return float(grid_lookup(np.log(self.grid["batch_sizes"]), self.grid["context_lens"], self.grid["seconds"],
                                     batch, context_len))
        sizes = sorted(self.batch_scale)
        if batch > sizes[-1] and len(sizes) == 1:
            raise ValueError(f"no plain-step cost measured for batch size {batch}")
        scale = np.interp(np.log(batch), np.log(sizes), [self.batch_scale[b] for b in sizes])
        return seconds * float(scale)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps({"context_lens": self.context_lens, "seconds": self.seconds, "meta": self.meta,
                                            "batch_scale": {str(b): v for b, v in self.batch_scale.items()},
                                            "grid": self.grid}))

    @classmethod
    def load(cls, path: str | Path) -> "PlainSpeed":
        data = read_json_file(path, "plain-speed file", keys=("context_lens", "seconds"))
        try:
            scale = {int(b): float(v) for b, v in data.get("batch_scale", {"1": 1.0}).items()}
            grid = data.get("grid")
            if grid is not None:
                grid = {"batch_sizes": [int(b) for b in grid["batch_sizes"]],
                        "context_lens": [int(c) for c in grid["context_lens"]],
                        "seconds": [[float(x) for x in row] for row in grid["seconds"]]}
                if len(grid["seconds"]) != len(grid["batch_sizes"]) or any(
                        len(row) != len(grid["context_lens"]) for row in grid["seconds"]):
                    raise ValueError("its grid's rows do not match its batch sizes and context lengths")
            return cls([int(c) for c in data["context_lens"]], [float(x) for x in data["seconds"]], data.get("meta", {}),
                       scale, grid)
        except (TypeError, ValueError, AttributeError) as exc:
            raise SpecPilotError(f"corrupt plain-speed file {path}: {exc}") from None


def measure_plain_speed(target, prompt_ids: list[int], context_lens=(32, 256, 1024), repeats: int = 6,
                        batch_sizes=(1,)) -> PlainSpeed:
    """Median seconds of a plain (k = 0) step at each context length: the device profiler's k = 0 column
    (and, for batch sizes > 1, its batch x context grid at the same context lengths)."""
    sizes = sorted(set(batch_sizes) | {1})
    batched = sizes if len(sizes) > 1 else ()
    profile = profile_costs(target, None, prompt_ids, k_max=0, context_lens=context_lens, repeats=repeats,
                            batch_sizes=batched, grid_context_lens=context_lens if batched else ())
    scale, grid = {1: 1.0}, None
    if batched:
        base = profile["batch_verify_s"][sizes.index(1)][0]
        scale = {b: row[0] / base for b, row in zip(profile["batch_sizes"], profile["batch_verify_s"])}
        g = profile["grid"]
        grid = {"batch_sizes": list(g["batch_sizes"]), "context_lens": list(g["context_lens"]),
                "seconds": [[cell[0] for cell in row] for row in g["verify_s"]]}
    return PlainSpeed(profile["context_lens"], [row[0] for row in profile["verify_s"]],
                      {"target": target.name, "repeats": repeats}, scale, grid)
