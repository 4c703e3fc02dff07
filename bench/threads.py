"""Torch's CPU threads beside a co-running load: `python -m specpilot.bench.threads` (about 2 minutes on 2 cores).

Decodes one prompt greedily with plain decoding, once with the thread governor (`--threads auto`: torch's threads
follow the cores other processes leave free, decoding/threads.py) and once with torch's own count (`fixed`), under
each background load (env/load.py), the two alternating within each repeat. Reports per load the median ms per token
of each, their paired ratio with an interval, the threads the governor ended on, and whether the tokens agree with
the idle run's. Prints a table and writes JSON."""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from specpilot.decoding.config import at_least, parse_config, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import cpu_key
from specpilot.decoding.loop import generate
from specpilot.decoding.models import load_target
from specpilot.decoding.paths import atomic_write_text
from specpilot.decoding.policies import NoSpeculation
from specpilot.decoding.prompts import load_prompts
from specpilot.env.load import LOADS, background_load

from .benchmark import paired_ratio


@dataclass
class ThreadsConfig:
    """Plain decoding's ms per token with the thread governor and with torch's own thread count, beside each load."""

    loads: str = "none,compute,memory"
    """Comma-separated background loads (env/load.py)."""
    max_new_tokens: int = 32
    """Tokens per run."""
    repeats: int = 3
    """Repeats; in each, both modes run once per load, in alternating order."""
    settle_s: float = 1.5
    """Seconds a load runs before timing (the monitor's rates cover about a second)."""
    out: str = "runs/threads.json"
    """JSON written with every run and the summary."""


def threads_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ThreadsConfig, argv)
    at_least(1, max_new_tokens=cfg.max_new_tokens, repeats=cfg.repeats)
    loads = [x.strip() for x in cfg.loads.split(",") if x.strip()]
    if not loads or any(x not in LOADS for x in loads):
        raise SpecPilotError(f"--loads takes names of {', '.join(LOADS)}, got '{cfg.loads}'")
    target = load_target("embedded", "float32", "cpu", threads="auto")
    governor = target.threads
    prompt = target.encode(load_prompts(None, "test")[0].text, chat=True)
    seconds = {(load, mode): [] for load in loads for mode in ("auto", "fixed")}
    ended, tokens = {}, {}
    for r in range(cfg.repeats):
        for load in loads:
            with background_load(load):
                time.sleep(cfg.settle_s)
                for mode in (("auto", "fixed") if r % 2 == 0 else ("fixed", "auto")):
                    target.threads = governor if mode == "auto" else None
                    if mode == "fixed":
                        governor.restore()
                    out = generate(target, None, NoSpeculation(), prompt, cfg.max_new_tokens)
                    seconds[(load, mode)].append(out.stats.seconds / len(out.token_ids))
                    tokens[(load, mode)] = out.token_ids
                    if mode == "auto":
                        ended[load] = torch.get_num_threads()
    target.threads = governor
    governor.restore()
    reference = tokens.get(("none", "fixed"), tokens[(loads[0], "fixed")])
    summary = {}
    print(f"plain decoding ms/token ({cpu_key()}, {governor.most} threads at most, {cfg.repeats} repeats, median); "
          "fixed / auto = how much faster the governor is")
    print(f"{'load':<10}{'auto ms':>9}{'fixed ms':>10}{'fixed / auto [interval]':>28}{'threads':>9}{'same tokens':>13}")
    for load in loads:
        a, f = seconds[(load, "auto")], seconds[(load, "fixed")]
        ratio, interval = paired_ratio([x / y for x, y in zip(f, a)])
        same = tokens[(load, "auto")] == reference and tokens[(load, "fixed")] == reference
        summary[load] = {"auto_ms": 1000 * statistics.median(a), "fixed_ms": 1000 * statistics.median(f),
                         "fixed_over_auto": ratio, "interval": interval, "threads_auto": ended[load], "same_tokens": same}
        iv = f"[{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
        print(f"{load:<10}{summary[load]['auto_ms']:>9.1f}{summary[load]['fixed_ms']:>10.1f}{ratio:>12.2f} {iv:>15}"
              f"{ended[load]:>9}{str(same):>13}")
    atomic_write_text(cfg.out, json.dumps({"config": dataclasses.asdict(cfg), "device": cpu_key(), "summary": summary,
                                           "seconds_per_token": {f"{k[0]} {k[1]}": v for k, v in seconds.items()}}, indent=1))
    print(f"written: {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(threads_main))
