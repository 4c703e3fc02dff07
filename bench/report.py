"""Report pages: a markdown file with its plot and JSON beside it (reports/NAME.{md,png,json})."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import specpilot
from specpilot.decoding.paths import atomic_write_text


RUN_TIMING = ("policy", "batch_size", "batch_index", "question_ids", "repeat", "new_tokens", "seconds", "steps",
              "drafted", "accepted", "policy_s", "category", "load")
"""What a report's JSON keeps of each run: its timing and counts, not its token ids (`python -m specpilot.bench.paired_cli
--results reports/NAME.json` re-reads them, per category too)."""


def run_timings(runs: list[dict]) -> list[dict]:
    """The runs (bench.benchmark.BatchRun as dicts) cut to RUN_TIMING."""
    return [{key: run[key] for key in RUN_TIMING if key in run} for run in runs]


def source_commit() -> str:
    """The commit this code runs at ('<hash>', '+dirty' with uncommitted changes) when it runs from a git checkout,
    else the installed version ('specpilot==X')."""
    root = Path(specpilot.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and (root / ".git").exists():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"specpilot=={specpilot.__version__}"


def provenance(meta: dict) -> dict:
    """What a report scored: the commit (`source_commit`) and, per learned policy in meta["policies"] ({name: its
    policy.json path}), the weights file that policy.json names (its hash is the policy's identity)."""
    weights = {}
    for name, source in (meta.get("policies") or {}).items():
        if isinstance(source, str) and source.endswith(".json") and Path(source).is_file():
            try:
                weights[name] = json.loads(Path(source).read_text()).get("weights")
            except (OSError, ValueError):
                weights[name] = None
    return {"commit": source_commit(), "policy_weights": weights}


def provenance_line(prov: dict) -> str:
    """The report page's line saying what it scored."""
    w = "; ".join(f"{n} = {str(v).removesuffix('.safetensors')}" for n, v in prov["policy_weights"].items())
    return f"Provenance: ran at commit {prov['commit']}; {w or 'no learned policy'}."


def write_report(report: str | Path, plot: str | Path, meta: dict, summary: dict, markdown: Callable[[str], str],
                 runs: list[dict] | None = None) -> Path:
    """Write REPORT (markdown made by `markdown(plot file name)`, with the provenance line under its title), a copy
    of the plot beside it and the run's provenance, meta, summary and run timings (`run_timings`) as REPORT.json."""
    report = Path(report)
    report.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(plot, report.with_suffix(".png"))
    prov = provenance(meta)
    doc = {"provenance": prov, "meta": meta, "summary": summary} | ({"runs": run_timings(runs)} if runs is not None else {})
    atomic_write_text(report.with_suffix(".json"), json.dumps(doc, indent=1))
    page = markdown(report.with_suffix(".png").name).split("\n", 1)
    atomic_write_text(report, "\n".join([page[0], "", provenance_line(prov)] + page[1:]))
    return report
