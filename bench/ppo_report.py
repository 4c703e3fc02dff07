"""What each phase of training adds, in the real loop: `python -m specpilot.bench.ppo_report --results A,B --warm W
--replay R` builds reports/ppo.md (+ JSON, plot) from load benchmarks (scripts/benchmark.py --background-load
none,compute,memory --batch-sizes 1,4 --repeats 3, one run per split) that ran, side by side, plain decoding, the
warm start alone, the warm start + PPO on the replay env, the exported policy (+ PPO on the real loop), that
policy with its hardware counters pinned to idle (`learned-idle-counters`) and the best tuned rule.

Per split, load and batch size: each policy's speedup over plain decoding under the same load, and the ratios the
training's claims rest on, each paired within a repeat (the policies ran the same batches in the same pass), with
the geometric mean and a 95% Student-t interval: exported / warm start, replay / warm start, exported / best rule,
exported / pinned. Every run's tokens are checked against plain decoding's (greedy: they must be identical).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from specpilot.decoding.config import parse_config, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text, read_json_file, relative
from specpilot.env.load import LOADS

from .paired_cli import paired_ratios
from .report import provenance, provenance_line

ROLES = ("warm", "replay", "real", "committed", "pinned", "rule")
LABELS = {"warm": "warm start alone", "replay": "+ PPO on replay", "real": "+ PPO on the real loop",
          "committed": "exported (per batch size, the phase picked on held-out train prompts)",
          "pinned": "exported, counters pinned to idle", "rule": "best tuned rule"}
RATIOS = (("committed", "warm"), ("replay", "warm"), ("real", "warm"), ("committed", "rule"), ("replay", "rule"), ("real", "rule"),
          ("committed", "pinned"))


@dataclass
class PpoReportConfig:
    """reports/ppo.md from load benchmarks of the training's phases (see the module docstring)."""

    results: str = ""
    """Comma-separated load_results.json files of scripts/benchmark.py, one per split (their meta names it); a run not
    finished yet as SPLIT=OUT/checkpoint.jsonl (its complete repeats; the page says how many)."""
    warm: str = ""
    """The warm start alone, as the benchmark spelt it (e.g. learned:runs/phases/warm-start/policy.json)."""
    replay: str = ""
    """The warm start + PPO on the replay env, as the benchmark spelt it."""
    real: str = ""
    """The warm start + PPO on the replay env + PPO on the real loop, as the benchmark spelt it ('' = the exported
    policy is that phase's: no row of its own)."""
    committed: str = "learned"
    """The exported policy (after PPO on the real loop)."""
    pinned: str = "learned-idle-counters"
    """The exported policy with its counters pinned to idle."""
    rule: str = "best-rule"
    """The best rule tuned on the train split."""
    report: str = "reports/ppo.md"
    """The report page (its JSON and plot beside it)."""
    exported: str = ""
    """The exported policy's policy.json (optional): the page says which phase's network decides which batch size."""


def read_checkpoint(path: str | Path, split: str) -> dict:
    """A load benchmark still running or stopped (OUT/checkpoint.jsonl, resumable with the same command and --resume) as
    a results file of its complete repeats: {"meta", "runs"}, meta["partial"] saying how many of how many repeats. A
    repeat is complete when every load ran every batch of it (so each repeat's ratios pair the same batches)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or "signature" not in lines[0]:
        raise SpecPilotError(f"{path} is not a benchmark checkpoint (its first line holds no signature)")
    sig, rows = lines[0]["signature"], lines[1:]
    loads = sig.get("loads") or ["none"]
    batches = sum(-(-len(sig["prompts"]) // b) for b in sig["batch_sizes"])
    done = {}
    for row in rows:
        done.setdefault(row["repeat"], set()).add((row["load"], row["batch"]))
    complete = sorted(r for r, cells in done.items() if len(cells) == len(loads) * batches)
    if not complete:
        raise SpecPilotError(f"{path}: no repeat has finished yet ({len(rows)} batches run)")
    from specpilot.decoding.hardware import resolve  # the machine reading it: the one that ran it (a checkpoint names none)

    here = resolve("cpu")
    meta = {"split": split, "prompts": len(sig["prompts"]), "max_new_tokens": sig["max_new_tokens"],
            "batch_sizes": sig["batch_sizes"], "loads": loads, "repeats": len(complete), "hardware": here.name,
            "device": here.key, "partial": f"{len(complete)} of {sig['repeats']} repeats (from the checkpoint)"}
    runs = [run for row in rows if row["repeat"] in complete for run in row["runs"]]
    return {"meta": meta, "runs": runs}


def token_mismatches(runs: list[dict]) -> dict[str, int]:
    """{policy: runs whose tokens differ from plain decoding's on the same batch, load and repeat}."""
    plain = {(r["load"], r["batch_size"], r["batch_index"], r["repeat"]): r["token_ids"] for r in runs if r["policy"] == "none"}
    out: dict[str, int] = {}
    for r in runs:
        if r["policy"] == "none":
            continue
        key = (r["load"], r["batch_size"], r["batch_index"], r["repeat"])
        if key not in plain:
            raise SpecPilotError(f"no plain run of batch {r['batch_index']} (load {r['load']}, B={r['batch_size']}, "
                                 f"repeat {r['repeat']}) to check {r['policy']}'s tokens against")
        out[r["policy"]] = out.get(r["policy"], 0) + int(r["token_ids"] != plain[key])
    return out


def split_table(runs: list[dict], names: dict[str, str]) -> dict:
    """{"speedup": {role: {cell: ...}}, "ratios": {"a/b": {cell: ...}}, "mean_over_loads": {"a/b": {B: ratio}}}. A role
    that names the same policy as a role before it (the exported policy when the selection kept the warm start) gets
    no row of its own, nor a ratio to that role."""
    same = {role: next(r for r in names if names[r] == name) for role, name in names.items()}
    speedup = {role: paired_ratios(runs, name, "none") for role, name in names.items() if same[role] == role}
    ratios = {f"{a}/{b}": paired_ratios(runs, names[a], names[b]) for a, b in RATIOS
              if a in names and b in names and names[a] != names[b]}
    mean = {}
    for key, cells in ratios.items():
        by_batch: dict[str, list[float]] = {}
        for cell, row in cells.items():
            by_batch.setdefault(cell.split(" ")[-1], []).append(row["ratio"])
        mean[key] = {b: math.exp(sum(map(math.log, v)) / len(v)) for b, v in by_batch.items()}
    return {"speedup": speedup, "ratios": ratios, "mean_over_loads": mean}


def ordered_cells(cells) -> list[str]:
    """'LOAD B=b' cells in the loads' order (none, compute, memory, both), then by batch size."""
    def key(cell: str):
        load, _, b = cell.rpartition(" B=")
        return (LOADS.index(load) if load in LOADS else len(LOADS), load, int(b) if b.isdigit() else 0)
    return sorted(cells, key=key)


def _fmt(row: dict | None) -> str:
    if not row:
        return "-"
    iv = row.get("interval")
    return f"{row['ratio']:.3f}" + (f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "")


def targets(tables: dict[str, dict]) -> list[tuple[str, str, bool | None]]:
    """The issue's targets on the test split at one row: (target, measured, met)."""
    t = tables.get("test")
    if t is None:
        return []
    r = t["ratios"]
    cell = lambda key, load: r[key].get(f"{load} B=1")  # noqa: E731
    rows = []
    if "committed/warm" not in r:  # the exported policy is the warm start: PPO's phases lost the selection
        return [("exported / warm start >= 1.03 at B=1, mean over loads", "1 (the exported policy is the warm start)", False)] \
            + _rule_and_pinned_rows(r, cell)
    mean = t["mean_over_loads"]["committed/warm"].get("B=1")
    if mean is not None:
        rows.append(("exported / warm start >= 1.03 at B=1, mean over loads", f"{mean:.3f}", mean >= 1.03))
    per_load = {load: cell("committed/warm", load) for load in ("none", "compute", "memory")}
    present = {k: v for k, v in per_load.items() if v}
    if present:
        above = [k for k, v in present.items() if v["interval"] and v["interval"][0] > 1.0]
        rows.append(("... interval above 1 under at least one load", ", ".join(above) or "none", bool(above)))
        worst = min(v["ratio"] for v in present.values())
        rows.append(("... >= 0.99 under every load", f"worst {worst:.3f}", worst >= 0.99))
    return rows + _rule_and_pinned_rows(r, cell)


def _rule_and_pinned_rows(r: dict, cell) -> list[tuple[str, str, bool]]:
    rows = []
    for load, goal in (("compute", 1.05), ("memory", 1.05), ("none", 1.0)):
        row = cell("committed/rule", load)
        if row:
            rows.append((f"exported / best rule >= {goal:.2f} at B=1 ({load})", f"{row['ratio']:.3f}", row["ratio"] >= goal))
    for load in ("compute", "memory"):
        row = cell("committed/pinned", load)
        if row:
            rows.append((f"pinned counters lose >= 3% at B=1 ({load}): exported / pinned >= 1.03", f"{row['ratio']:.3f}",
                         row["ratio"] >= 1.03))
    return rows


def markdown(doc: dict, png: str) -> str:
    lines = ["# What each phase of training adds, in the real loop", ""]
    lines += [provenance_line(doc["provenance"]), ""]
    for split, meta in doc["meta"].items():
        lines.append(f"- {split}: {meta['prompts']} prompts, {meta['max_new_tokens']} tokens, batch sizes "
                     f"{meta.get('batch_sizes')}, loads {', '.join(meta.get('loads') or ['none'])}, {meta['repeats']} "
                     f"paired repeats, {meta['hardware']} ({meta['device']}); from `{doc['results'][split]}`"
                     + (f" (**partial: {meta['partial']}**; the benchmark's command with --resume finishes it)"
                        if meta.get("partial") else ""))
    same = doc["names"].get("committed") == doc["names"].get("warm")
    lines += ["", "Policies: " + "; ".join(f"{LABELS[role]} = `{name}`" for role, name in doc["names"].items()), ""]
    if doc.get("by_batch"):
        lines += ["The exported policy runs, per batch size, the network of the phase that replayed best on the held-out "
                  "train prompts: " + ", ".join(f"B >= {b} {name}" for b, name in doc["by_batch"].items()) + ". Where it "
                  "runs a phase's network, its row and that phase's row are the same network measured apart (with live "
                  "counters, not always the same decisions): their gap is the benchmark's noise.", ""]
    if same:
        lines += ["The exported policy is the warm start: on the held-out train prompts each seed's PPO phases replayed "
                  "below it, so the selection kept it. The PPO phases' rows are the merged policies of `phases/`.", ""]
    lines += ["Tokens against plain decoding's: " + (", ".join(f"{p} {n} of its runs differ" for p, n in doc["mismatches"].items() if n)
                                                      or "every run token-identical to plain decoding (greedy)"), ""]
    rows = targets(doc["tables"])
    if rows:
        lines += ["## Targets (test split, one row)", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {name} | {value} | {'yes' if ok else 'no'} |" for name, value, ok in rows]
        lines.append("")
    for split, table in doc["tables"].items():
        cells = ordered_cells(next(iter(table["speedup"].values())))
        lines += [f"## {split} split", "", "Speedup over plain decoding under the same load, paired within each repeat "
                  "(geometric mean [95% interval]):", "", "| policy | " + " | ".join(cells) + " |", "|---|" + "---|" * len(cells)]
        for role, row in table["speedup"].items():
            lines.append(f"| {LABELS[role]} | " + " | ".join(_fmt(row.get(c)) for c in cells) + " |")
        lines += ["", "Ratios, paired within each repeat:", "", "| ratio | " + " | ".join(cells) + " | mean over loads |",
                  "|---|" + "---|" * (len(cells) + 1)]
        for key, row in table["ratios"].items():
            a, b = key.split("/")
            mean = ", ".join(f"{k} {v:.3f}" for k, v in table["mean_over_loads"][key].items())
            lines.append(f"| {LABELS[a]} / {LABELS[b]} | " + " | ".join(_fmt(row.get(c)) for c in cells) + f" | {mean} |")
        lines.append("")
    lines += [f"![speedups]({png})", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = doc["tables"]
    fig, axes = plt.subplots(1, len(tables), figsize=(6.5 * len(tables), 4), squeeze=False)
    for ax, (split, table) in zip(axes[0], tables.items()):
        cells = ordered_cells(next(iter(table["speedup"].values())))
        width = 0.8 / len(table["speedup"])
        for i, (role, row) in enumerate(table["speedup"].items()):
            xs = [j + i * width for j in range(len(cells))]
            ys = [row[c]["ratio"] if c in row else float("nan") for c in cells]
            err = [[y - (row[c]["interval"] or [y, y])[0] if c in row else 0 for c, y in zip(cells, ys)],
                   [(row[c]["interval"] or [y, y])[1] - y if c in row else 0 for c, y in zip(cells, ys)]]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=LABELS[role])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], cells, rotation=30, fontsize=8)
        ax.set_ylabel("speedup over plain (same load)")
        ax.set_title(f"{split} split")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ppo_report_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PpoReportConfig, argv)
    files = [p.strip() for p in cfg.results.split(",") if p.strip()]
    if not files or not cfg.warm or not cfg.replay:
        raise SpecPilotError("--results (the load benchmarks), --warm and --replay (their policy names) are required")
    names = {role: getattr(cfg, role) for role in ROLES if getattr(cfg, role)}
    tables, metas, sources, mismatches, policies = {}, {}, {}, {}, {}
    for file in files:
        split_of, _, path = file.rpartition("=")
        doc = read_checkpoint(path, split_of) if path.endswith(".jsonl") else \
            read_json_file(path, "benchmark results", keys=("meta", "runs"))
        file = path
        split, runs = doc["meta"]["split"], doc["runs"]
        missing = [n for n in names.values() if n not in {r["policy"] for r in runs}]
        if missing:
            raise SpecPilotError(f"{file} has no runs of {', '.join(missing)}")
        if split in tables:
            raise SpecPilotError(f"two results files of the {split} split")
        tables[split], metas[split], sources[split] = split_table(runs, names), doc["meta"], relative(file)
        for policy, n in token_mismatches(runs).items():
            mismatches[policy] = mismatches.get(policy, 0) + n
        policies.update(doc["meta"].get("policies") or {})
    report = Path(cfg.report)
    out = {"provenance": provenance({"policies": policies}), "names": names, "results": sources, "meta": metas,
           "mismatches": mismatches, "tables": tables, "targets": [list(t) for t in targets(tables)]}
    if cfg.exported:
        meta = read_json_file(cfg.exported, "exported policy", keys=("weights",))
        out["by_batch"] = (meta.get("selection") or {}).get("by_batch") or {}
    report.parent.mkdir(parents=True, exist_ok=True)
    plot(out, report.with_suffix(".png"))
    atomic_write_text(report.with_suffix(".json"), json.dumps(out, indent=1))
    atomic_write_text(report, markdown(out, report.with_suffix(".png").name))
    print(markdown(out, report.with_suffix(".png").name))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(ppo_report_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
