"""Plain (k = 0) decoding speed of a target on this device, as a function of context length.

The env divides each step's tokens/s by this, so that its reward is a speedup over plain decoding and
comparable across devices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from decoding.errors import SpecPilotError
from decoding.paths import atomic_write_text, read_json_file

from .profile import profile_costs


@dataclass
class PlainSpeed:
    """Measured seconds of one plain step at a few context lengths, linearly interpolated; with
    `batch_scale`, the cost of a plain step of b rows relative to one row (interpolated in log b)."""

    context_lens: list[int]
    seconds: list[float]
    meta: dict = field(default_factory=dict)
    batch_scale: dict[int, float] = field(default_factory=lambda: {1: 1.0})

    def step_seconds(self, context_len: int, batch: int = 1) -> float:
        seconds = float(np.interp(context_len, self.context_lens, self.seconds))
        if batch == 1:
            return seconds
        sizes = sorted(self.batch_scale)
        if batch > sizes[-1] and len(sizes) == 1:
            raise ValueError(f"no plain-step cost measured for batch size {batch}")
        scale = np.interp(np.log(batch), np.log(sizes), [self.batch_scale[b] for b in sizes])
        return seconds * float(scale)

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps({"context_lens": self.context_lens, "seconds": self.seconds, "meta": self.meta,
                                            "batch_scale": {str(b): v for b, v in self.batch_scale.items()}}))

    @classmethod
    def load(cls, path: str | Path) -> "PlainSpeed":
        data = read_json_file(path, "plain-speed file", keys=("context_lens", "seconds"))
        try:
            scale = {int(b): float(v) for b, v in data.get("batch_scale", {"1": 1.0}).items()}
            return cls([int(c) for c in data["context_lens"]], [float(x) for x in data["seconds"]], data.get("meta", {}),
                       scale)
        except (TypeError, ValueError, AttributeError) as exc:
            raise SpecPilotError(f"corrupt plain-speed file {path}: {exc}") from None


def measure_plain_speed(target, prompt_ids: list[int], context_lens=(32, 256, 1024), repeats: int = 6,
                        batch_sizes=(1,)) -> PlainSpeed:
    """Median seconds of a plain (k = 0) step at each context length: the device profiler's k = 0 column
    (and, for batch sizes > 1, its batch columns)."""
    sizes = sorted(set(batch_sizes) | {1})
    profile = profile_costs(target, None, prompt_ids, k_max=0, context_lens=context_lens, repeats=repeats,
                            batch_sizes=sizes if len(sizes) > 1 else ())
    scale = {1: 1.0}
    if len(sizes) > 1:
        base = profile["batch_verify_s"][sizes.index(1)][0]
        scale = {b: row[0] / base for b, row in zip(profile["batch_sizes"], profile["batch_verify_s"])}
    return PlainSpeed(profile["context_lens"], [row[0] for row in profile["verify_s"]],
                      {"target": target.name, "repeats": repeats}, scale)
