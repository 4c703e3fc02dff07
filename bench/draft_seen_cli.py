"""How much a trained head's own training prompts flatter it: `python -m specpilot.bench.draft_seen_cli`.

A head distilled on the target's answers to some prompts accepts more of its drafts there than on prompts it never
saw, so a rule or policy tuned on those would draft too much (`HeadConfig.distilled_on` leaves them out of the train
split). This reads the head's greedy traces and prints, per group of prompts, the mean tokens a greedy verify keeps
per step at k = 1, 2 and 4 (each position's match length capped at k): the prompts whose answers the head learned
from, the other prompts of the synthetic generator it drew from, the rest of the train split (what its policy
trains on), and the test, ood and outside splits. A table on stdout, JSON in --out.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.decoding.config import parse_config, parse_ints, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import head_config_of
from specpilot.decoding.paths import atomic_write_text, traces_path
from specpilot.env.oracle import Trace, load_draft_traces

GROUPS = ("learned from", "same generator", "train (kept)", "test", "ood", "outside")


@dataclass
class DraftSeenConfig:
    """Tokens accepted per step by a trained head on the prompts it learned from against those it never saw."""

    draft: str = "default"
    """A trained draft head: `default` or a head's folder (its traces name it)."""
    traces: str | None = None
    """Greedy traces of that head (default: profiles/traces-DRAFT.json)."""
    ks: str = "1,2,4"
    """Comma-separated draft lengths k to report."""
    out: str = "runs/draft-seen"
    """Folder for draft_seen.json."""


def group_of(trace: Trace, split: str, learned_ids: set[str]) -> str:
    """Which GROUPS entry a trace belongs to, given its split as the loaded traces mark it."""
    if split != "draft-train":
        return "train (kept)" if split == "train" else split
    return "learned from" if trace.question_id in learned_ids else "same generator"


def accepted_by_group(traces: list[Trace], splits: dict[str, str], learned_ids: set[str],
                      ks: list[int]) -> dict[str, dict]:
    """{group: {"prompts": n, "k=K": mean tokens kept per step at draft length K}} (position-weighted)."""
    table = {}
    for group in GROUPS:
        members = [t for t in traces if group_of(t, splits.get(t.question_id, "train"), learned_ids) == group]
        if not members:
            continue
        matches = np.concatenate([np.asarray(t.matches, dtype=np.int64) for t in members])
        table[group] = {"prompts": len(members), **{f"k={k}": round(float(np.minimum(matches, k).mean()), 3) for k in ks}}
    return table


def draft_seen_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(DraftSeenConfig, argv, description=__doc__.splitlines()[0])
    ks = parse_ints(cfg.ks, "--ks")
    head = head_config_of(cfg.draft)
    if head is None:
        raise SpecPilotError(f"--draft '{cfg.draft}' is not a trained draft head (default, or a head's folder)")
    traces, meta = load_draft_traces(cfg.traces or traces_path(cfg.draft), cfg.draft)
    table = accepted_by_group(traces, meta.get("splits") or {}, set(head.trained.get("prompt_ids") or ()), ks)
    print(f"{'prompts':<16}{'n':>5}" + "".join(f"{'k=' + str(k):>8}" for k in ks))
    for group, row in table.items():
        print(f"{group:<16}{row['prompts']:>5}" + "".join(f"{row[f'k={k}']:>8.3f}" for k in ks))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "draft_seen.json", json.dumps({"draft": cfg.draft, "draft_weights": meta.get("draft_weights"),
                                                          "groups": table}, indent=1))
    print(f"tokens a greedy verify keeps per step (trace positions); results: {out / 'draft_seen.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(draft_seen_main))
