"""Report pages: a markdown file with its plot and JSON beside it (reports/NAME.{md,png,json})."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable


def write_report(report: str | Path, plot: str | Path, meta: dict, summary: dict, markdown: Callable[[str], str]) -> Path:
    """Write REPORT (markdown made by `markdown(plot file name)`), a copy of the plot beside it and the
    run's meta and summary as REPORT.json."""
    report = Path(report)
    report.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(plot, report.with_suffix(".png"))
    report.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    report.write_text(markdown(report.with_suffix(".png").name))
    return report
