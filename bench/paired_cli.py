"""One policy against another from a benchmark's results JSON: `python -m bench.paired_cli RESULTS --policy learned
--versus best-rule`. Per (load, batch size), the ratio of the two policies' tokens/s within each repeat (their
runs of the same batches in the same pass, so the machine's slow drift cancels), the geometric mean and an
approximate 95% interval, exp(mean log +- 2 standard errors). Prints a table and writes JSON beside RESULTS."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from decoding.config import parse_config, run_cli
from decoding.errors import SpecPilotError
from decoding.paths import atomic_write_text, read_json_file

from .benchmark import paired_ratio


@dataclass
class PairedConfig:
    """Paired ratio of two policies' speed from a results JSON of scripts/benchmark.py."""

    results: str = "runs/benchmark/batch_results.json"
    """The benchmark's results JSON (batch_results.json, load_results.json or results.json)."""
    policy: str = "learned"
    """The policy compared."""
    versus: str = "best-rule"
    """The policy it is compared with."""


def paired_ratios(runs: list[dict], policy: str, versus: str) -> dict[str, dict]:
    """{"LOAD B=b" ("B=b" when no run had a load): {"per_repeat", "ratio", "interval"}}: policy / versus tokens/s
    within each repeat."""
    totals: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for run in runs:
        cell = totals[(run.get("load", "none"), run["batch_size"], run["repeat"])][run["policy"]]
        cell[0] += run["new_tokens"]
        cell[1] += run["seconds"]
    by_cell: dict[tuple, list[float]] = defaultdict(list)
    for (load, b, _), pol in sorted(totals.items()):
        if policy in pol and versus in pol and pol[policy][1] > 0 and pol[versus][1] > 0:
            by_cell[(load, b)].append((pol[policy][0] / pol[policy][1]) / (pol[versus][0] / pol[versus][1]))
    out = {}
    loaded = any(load != "none" for load, _ in by_cell)  # without loads a cell is just its batch size
    for (load, b), ratios in by_cell.items():
        mean, interval = paired_ratio(ratios)
        out[f"{load} B={b}" if loaded else f"B={b}"] = {"per_repeat": ratios, "ratio": mean, "interval": interval}
    return out


def versus_markdown(versus: str, table: dict[str, dict[str, dict]]) -> str:
    """A report section: each policy over `versus`, paired within each repeat, per (load, batch size) cell."""
    cells = list(next(iter(table.values()), {}))
    lines = ["", f"Each policy over `{versus}`, tokens/s paired within each repeat: geometric mean [approx. 95% interval].",
             "", "| policy | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{row[c]['ratio']:.3f}" + (" [{:.3f}, {:.3f}]".format(*row[c]["interval"]) if row[c]["interval"] else "")
            if c in row else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def paired_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PairedConfig, argv)
    doc = read_json_file(cfg.results, "benchmark results", keys=("runs",))
    names = {run["policy"] for run in doc["runs"]}
    for name in (cfg.policy, cfg.versus):
        if name not in names:
            raise SpecPilotError(f"{cfg.results} has no runs of '{name}'; it has {', '.join(sorted(names))}")
    cells = paired_ratios(doc["runs"], cfg.policy, cfg.versus)
    print(f"{cfg.policy} / {cfg.versus}, tokens/s paired within each repeat: geometric mean [approx. 95% interval]")
    for cell, row in cells.items():
        interval = row["interval"]
        print(f"  {cell:<16} {row['ratio']:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
              + "  per repeat " + " ".join(f"{r:.3f}" for r in row["per_repeat"]))
    path = Path(cfg.results).with_name(f"paired_{cfg.policy}_vs_{cfg.versus}.json".replace(":", "-").replace("/", "-"))
    atomic_write_text(path, json.dumps({"results": cfg.results, "policy": cfg.policy, "versus": cfg.versus,
                                        "cells": cells}, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(paired_main))
