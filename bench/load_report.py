"""Does a busy machine change the *shape* of the cost curve? `python -m specpilot.bench.load_report` reads the profiles
`scripts/profile_device.py --out profiles/load --background-load KIND` wrote (DEVICE-DRAFT-load-KIND.json, and
DEVICE-DRAFT.json for no load) and reports, per condition, the plain
step, the verify / plain ratio per k, the best k per batch size for the draft's recorded acceptance
(train-split traces) and what the hardware counters read under it; a plot beside the report."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specpilot.decoding.hardware import CO_RUNNING, HW_FEATURES
from specpilot.decoding.paths import atomic_write_text, slug, traces_path
from specpilot.env.oracle import CostModel, load_profile, load_traces, profile_hardware, train_traces

from .batch_table import goodput_table
from specpilot.env.load import LOADS

COUNTERS = ("hw_cpu_util", "hw_cpu_freq_ratio", "hw_load_per_core") + CO_RUNNING


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft", default="ngram:3")
    parser.add_argument("--profiles", default="profiles/load")
    parser.add_argument("--report", default="reports/cpu-load.md")
    args = parser.parse_args(argv)
    stem = f"{args.device}-{slug(args.draft)}"
    traces, meta = load_traces(traces_path(args.draft))
    k_max = traces[0].k_max
    train = train_traces(traces, meta)
    rows = {}
    for kind in LOADS:
        path = Path(args.profiles) / (f"{stem}.json" if kind == "none" else f"{stem}-load-{kind}.json")
        if not path.exists():
            continue
        profile = load_profile(path)
        cost = CostModel.from_profile(profile)
        context = profile.get("batch_context_len") or profile["context_lens"][0]
        sizes = profile.get("batch_sizes") or [1]
        per_batch = {}
        for b, goodput in goodput_table(cost, train, k_max, context, sizes).items():
            seconds = cost.step_costs(context, b)[0][: k_max + 1]
            per_batch[b] = {"plain_ms": 1000 * seconds[0], "ratio": (seconds / seconds[0]).round(3).tolist(),
                            "best_k": int(np.argmax(goodput)), "gain": float(goodput.max() / goodput[0])}
        recorded = profile_hardware(profile)
        hw = dict(zip(HW_FEATURES, recorded.tolist())) if recorded is not None else {}
        rows[kind] = {"profile": str(path), "context": context, "batches": per_batch,
                      "counters": {c: hw.get(c) for c in COUNTERS}}
    if not rows:
        raise SystemExit(f"no {stem}-load-*.json profiles in {args.profiles}; run scripts/profile_device.py --background-load KIND")
    report = Path(args.report)
    atomic_write_text(report.with_suffix(".json"), json.dumps(rows, indent=1))
    lines = [f"# Cost curve under background load ({args.device}, {args.draft})", "",
             "Regenerate: `python scripts/profile_device.py --device cpu --draft ngram --no-traces --context-lens 256 "
             "--batch-sizes 1,4,16 --repeats 3 --out profiles/load --background-load KIND` for each KIND, then "
             "`python -m specpilot.bench.load_report`.",
             "Best k: the k of the best goodput for the draft's recorded train-split acceptance.", "",
             "| load | B | plain step ms | verify/plain for k = 1, 2, 4, 8 | best k | gain over plain | cpu util | load/core | freq ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, row in rows.items():
        c = row["counters"]
        for b, cell in row["batches"].items():
            r = cell["ratio"]
            lines.append(f"| {kind} | {b} | {cell['plain_ms']:.1f} | {r[1]:.2f}, {r[2]:.2f}, {r[4]:.2f}, {r[min(8, len(r) - 1)]:.2f} | "
                         f"{cell['best_k']} | {cell['gain']:.3f}x | {_num(c['hw_cpu_util'])} | {_num(c['hw_load_per_core'])} | "
                         f"{_num(c['hw_cpu_freq_ratio'])} |")
    atomic_write_text(report, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
