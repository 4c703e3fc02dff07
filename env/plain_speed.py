"""Plain (k = 0) decoding speed of a target on this device, as a function of context length.

The env divides each step's tokens/s by this, so that its reward is a speedup over plain decoding and
comparable across devices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np



@dataclass
class PlainSpeed:
    """Measured seconds of one plain step at a few context lengths, linearly interpolated."""

    context_lens: list[int]
    seconds: list[float]
    meta: dict = field(default_factory=dict)

    def step_seconds(self, context_len: int) -> float:
        return float(np.interp(context_len, self.context_lens, self.seconds))

    def tokens_per_s(self, context_len: int) -> float:
        return 1.0 / self.step_seconds(context_len)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"context_lens": self.context_lens, "seconds": self.seconds, "meta": self.meta}))

    @classmethod
    def load(cls, path: str | Path) -> "PlainSpeed":
        data = json.loads(Path(path).read_text())
        return cls(data["context_lens"], data["seconds"], data.get("meta", {}))


def measure_plain_speed(target, prompt_ids: list[int], context_lens=(32, 256, 1024), repeats: int = 6) -> PlainSpeed:
    """Median seconds of a plain (k = 0) step at each context length: the device profiler's k = 0 column."""
    from decoding.profile import profile_costs

    profile = profile_costs(target, None, prompt_ids, k_max=0, context_lens=context_lens, repeats=repeats)
    return PlainSpeed(profile["context_lens"], [row[0] for row in profile["verify_s"]],
                      {"target": target.name, "repeats": repeats})
