"""One policy against another from a benchmark's results JSON: `python -m specpilot.bench.paired_cli RESULTS --policy learned
--versus best-rule`. Per (load, batch size), the ratio of the two policies' tokens/s within each repeat (their
runs of the same batches in the same pass, so the machine's slow drift cancels), the geometric mean and a 95%
interval, exp(mean log +- t(n-1) standard errors). Prints a table and writes JSON beside a results file. A report's
JSON (reports/*.json) keeps its runs' timings (bench.report.run_timings); an older one without them is read from
the per-repeat ratios its summary kept (each policy over plain decoding, and over its --versus policy)."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specpilot.decoding.config import parse_config, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text, read_json_file

from .benchmark import paired_ratio


@dataclass
class PairedConfig:
    """Paired ratio of two policies' speed from a results JSON of scripts/benchmark.py."""

    results: str = "runs/benchmark/batch_results.json"
    """The benchmark's results JSON (batch_results.json, load_results.json or results.json), or a report's JSON
    (reports/*.json: from the per-repeat ratios it kept); several, comma-separated, pool their repeats (runs of
    the same command: each repeat is paired within itself, so repeats of separate runs add up)."""
    policy: str = "learned"
    """The policy compared."""
    versus: str = "best-rule"
    """The policy it is compared with."""
    by_category: bool = False
    """Also split each cell by the prompts' category (runs of one prompt each, --batch-sizes 1; results JSON only)."""


def paired_ratios(runs: list[dict], policy: str, versus: str, by_category: bool = False) -> dict[str, dict]:
    """{"LOAD B=b" ("B=b" when no run had a load; " CATEGORY" appended with by_category): {"per_repeat", "ratio",
    "interval"}}: policy / versus tokens/s within each repeat."""
    totals: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for run in runs:
        group = run.get("category", "") if by_category else ""
        cell = totals[(run.get("load", "none"), run["batch_size"], group, run["repeat"])][run["policy"]]
        cell[0] += run["new_tokens"]
        cell[1] += run["seconds"]
    by_cell: dict[tuple, list[float]] = defaultdict(list)
    for (load, b, group, _), pol in sorted(totals.items()):
        if policy in pol and versus in pol and pol[policy][1] > 0 and pol[versus][1] > 0:
            by_cell[(load, b, group)].append((pol[policy][0] / pol[policy][1]) / (pol[versus][0] / pol[versus][1]))
    out = {}
    loaded = any(load != "none" for load, _, _ in by_cell)  # without loads a cell is just its batch size
    for (load, b, group), ratios in by_cell.items():
        mean, interval = paired_ratio(ratios)
        name = (f"{load} B={b}" if loaded else f"B={b}") + (f" {group}" if group else "")
        out[name] = {"per_repeat": ratios, "ratio": mean, "interval": interval}
    return out


def versus_markdown(versus: str, table: dict[str, dict[str, dict]]) -> str:
    """A report section: each policy over `versus`, paired within each repeat, per (load, batch size) cell."""
    cells = list(next(iter(table.values()), {}))
    lines = ["", f"Each policy over `{versus}`, tokens/s paired within each repeat: geometric mean [95% interval, Student's t].",
             "", "| policy | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{row[c]['ratio']:.3f}" + (" [{:.3f}, {:.3f}]".format(*row[c]["interval"]) if row[c]["interval"] else "")
            if c in row else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def report_ratios(summary: dict, policy: str, versus: str) -> dict[str, list[float]]:
    """{"B=b": per-repeat ratios} from what an older report's summary kept (no runs): the ratios over the report's
    --versus policy, or else each policy's speedups over plain decoding in the same repeat divided (exact: plain's
    tokens/s cancels, leaving the two policies' ratio within that repeat)."""
    kept = summary.get("versus") or {}
    if kept.get("policy") == versus:
        cells = {cell: row["per_repeat"] for cell, row in kept.get("cells", {}).get(policy, {}).items()}
    else:
        cells = {}
        for b, row in summary.get("table", {}).items():
            mine, theirs = (row.get(name) if isinstance(row, dict) else None for name in (policy, versus))
            if isinstance(mine, dict) and isinstance(theirs, dict) and "speedup_per_repeat" in mine | theirs:
                pairs = list(zip(mine.get("speedup_per_repeat", []), theirs.get("speedup_per_repeat", [])))
                if pairs:
                    cells[f"B={b}"] = [x / y for x, y in pairs]
    if not cells:
        raise SpecPilotError(f"the report kept no per-repeat ratios of both '{policy}' and '{versus}'")
    return cells


def _cells_of(path: str, policy: str, versus: str, by_category: bool = False) -> tuple[dict[str, list[float]], bool]:
    """({"B=b": per-repeat ratios} of policy over versus in one results or report JSON, whether it is a
    benchmark's results file (OUT/*results.json), beside which the paired JSON is written)."""
    doc = read_json_file(path, "benchmark results")
    if "runs" in doc:
        names = {run["policy"] for run in doc["runs"]}
        for name in (policy, versus):
            if name not in names:
                raise SpecPilotError(f"{path} has no runs of '{name}'; it has {', '.join(sorted(names))}")
        cells = paired_ratios(doc["runs"], policy, versus)
        if by_category:
            cells |= paired_ratios(doc["runs"], policy, versus, by_category=True)
    elif by_category:
        raise SpecPilotError(f"--by-category needs the runs; {path} holds only a summary (a report from before they were kept)")
    elif "summary" in doc:
        return report_ratios(doc["summary"], policy, versus), False
    else:
        raise SpecPilotError(f"{path} is neither a benchmark's results (runs) nor a report's JSON (summary)")
    return {cell: row["per_repeat"] for cell, row in cells.items()}, Path(path).name.endswith("results.json")


def paired_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PairedConfig, argv)
    paths = [x.strip() for x in cfg.results.split(",") if x.strip()]
    if not paths:
        raise SpecPilotError("--results names no file")
    pooled: dict[str, list[float]] = {}
    for path in paths:
        found, is_results = _cells_of(path, cfg.policy, cfg.versus, cfg.by_category)
        for cell, ratios in found.items():
            pooled.setdefault(cell, []).extend(ratios)
    cells = {cell: dict(zip(("ratio", "interval"), paired_ratio(ratios)), per_repeat=ratios) for cell, ratios in pooled.items()}
    print(f"{cfg.policy} / {cfg.versus}, tokens/s paired within each repeat: geometric mean [95% interval, Student's t]"
          + (f", the repeats of {len(paths)} runs pooled" if len(paths) > 1 else ""))
    for cell, row in cells.items():
        interval = row["interval"]
        print(f"  {cell:<28} {row['ratio']:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
              + "  per repeat " + " ".join(f"{r:.3f}" for r in row["per_repeat"]))
    if len(paths) > 1 or not is_results:
        return 0  # pooled, or a committed report: print only, write nothing beside it
    path = Path(paths[0]).with_name(f"paired_{cfg.policy}_vs_{cfg.versus}.json".replace(":", "-").replace("/", "-"))
    atomic_write_text(path, json.dumps({"results": paths[0], "policy": cfg.policy, "versus": cfg.versus,
                                        "cells": cells}, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(paired_main))
