"""Report pages: a markdown file with its plot and JSON beside it (reports/NAME.{md,png,json})."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from specpilot.decoding.paths import atomic_write_text


RUN_TIMING = ("policy", "batch_size", "batch_index", "question_ids", "repeat", "new_tokens", "seconds", "steps",
              "drafted", "accepted", "policy_s", "category", "load")
"""What a report's JSON keeps of each run: its timing and counts, not its token ids (`python -m specpilot.bench.paired_cli
--results reports/NAME.json` re-reads them, per category too)."""


def run_timings(runs: list[dict]) -> list[dict]:
    """The runs (bench.benchmark.BatchRun as dicts) cut to RUN_TIMING."""
    return [{key: run[key] for key in RUN_TIMING if key in run} for run in runs]


def write_report(report: str | Path, plot: str | Path, meta: dict, summary: dict, markdown: Callable[[str], str],
                 runs: list[dict] | None = None) -> Path:
    """Write REPORT (markdown made by `markdown(plot file name)`), a copy of the plot beside it and the
    run's meta, summary and run timings (`run_timings`) as REPORT.json."""
    report = Path(report)
    report.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(plot, report.with_suffix(".png"))
    doc = {"meta": meta, "summary": summary} | ({"runs": run_timings(runs)} if runs is not None else {})
    atomic_write_text(report.with_suffix(".json"), json.dumps(doc, indent=1))
    atomic_write_text(report, markdown(report.with_suffix(".png").name))
    return report
