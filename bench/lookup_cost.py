"""What prompt lookup costs the host per row and step: `python -m specpilot.bench.lookup_cost` (seconds).

The n-gram drafter's search runs on the host for every row of every step. This times one step's lookup
(`NgramDrafter.lookup` on a context that grew by a step's tokens: the copy of the new tokens and the search of
its n-gram index) against the full scan of the context (`ngram_search`, what the drafter ran before it kept
an index), at several context lengths, on real token sequences: the recorded traces' prompts and answers, one
after the other. A table on stdout, JSON in --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specpilot.decoding.config import parse_config, parse_ints, run_cli
from specpilot.decoding.drafters import NgramDrafter, ngram_search
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text, traces_path
from specpilot.env.oracle import load_traces


@dataclass
class LookupCostConfig:
    """Host seconds of one prompt-lookup search per row and step, indexed vs a full scan, by context length."""

    context_lens: str = "1000,4000,16000,32000"
    """Comma-separated context lengths (tokens) to time at."""
    steps: int = 50
    """Steps timed at each length (each adds 2 tokens to the context, as a step that kept one draft)."""
    repeats: int = 5
    """Repeats of each timing; the median is reported."""
    draft: str = "ngram:3"
    """The prompt-lookup draft (its n), and whose traces give the token sequence."""
    traces: str | None = None
    """Trace file whose tokens are used (default: the draft's)."""
    out: str = "runs/lookup-cost"
    """Folder for lookup_cost.json."""


def token_stream(path, length: int) -> np.ndarray:
    """`length` real tokens: the traces' prompts and answers one after the other (repeated when too few)."""
    traces, _ = load_traces(path)
    stream = np.concatenate([np.asarray(t.prompt_ids + t.output_ids, dtype=np.int64) for t in traces])
    return np.resize(stream, length)


def time_lookups(tokens: np.ndarray, length: int, steps: int, max_n: int) -> tuple[float, float]:
    """(seconds of one indexed lookup, seconds of one full scan) per step, starting at `length` tokens."""
    context = torch.from_numpy(tokens)
    drafter = NgramDrafter(max_n)
    drafter.lookup(context[:length], 8)  # the prompt, indexed once (as its prefill is run once)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        drafter.lookup(context[: length + 2 * step], 8)
    indexed = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        ngram_search(tokens[: length + 2 * step], max_n)
    return indexed, (time.perf_counter() - t0) / steps


def lookup_cost_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(LookupCostConfig, argv, description=__doc__.splitlines()[0])
    lengths = parse_ints(cfg.context_lens, "--context-lens")
    if not cfg.draft.startswith("ngram:"):
        raise SpecPilotError(f"--draft is a prompt-lookup draft ngram:N, got '{cfg.draft}'")
    max_n = int(cfg.draft.split(":")[1])
    tokens = token_stream(cfg.traces or traces_path(cfg.draft), max(lengths) + 2 * cfg.steps + 1)
    rows = []
    print(f"{'context':>8}{'indexed us':>12}{'full scan us':>14}")
    for length in lengths:
        runs = [time_lookups(tokens, length, cfg.steps, max_n) for _ in range(cfg.repeats)]
        row = {"context": length, "indexed_us": 1e6 * statistics.median(r[0] for r in runs),
               "scan_us": 1e6 * statistics.median(r[1] for r in runs)}
        rows.append(row)
        print(f"{length:>8}{row['indexed_us']:>12.0f}{row['scan_us']:>14.0f}")
    out = Path(cfg.out)
    atomic_write_text(out / "lookup_cost.json", json.dumps({"draft": cfg.draft, "steps": cfg.steps,
                                                             "repeats": cfg.repeats, "rows": rows}, indent=1))
    print(f"per row and step, median of {cfg.repeats} x {cfg.steps} steps; results: {out / 'lookup_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lookup_cost_main))
