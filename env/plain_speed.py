"""Plain (k = 0) decoding speed of a target on this device, as a function of context length.

The env divides each step's tokens/s by this, so that its reward is a speedup over plain decoding and
comparable across devices.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from decoding.loop import speculative_step, start


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


def measure_plain_speed(target, prompt_ids: list[int], context_lens=(32, 256, 1024), steps: int = 6) -> PlainSpeed:
    """Median seconds of a k = 0 step of the target at each context length (prompt ids tiled to length)."""
    window = target.context_window or 10**9
    lens, secs = [], []
    for n in context_lens:
        if n + steps + 1 >= window:
            continue
        ids = (list(prompt_ids) * (n // max(1, len(prompt_ids)) + 1))[:n]
        state = start(target, None, ids, steps + 2)
        speculative_step(state, 0)  # warm-up
        times = [speculative_step(state, 0).seconds for _ in range(steps)]
        lens.append(n)
        secs.append(statistics.median(times))
    return PlainSpeed(lens, secs, {"target": target.name, "steps": steps})
