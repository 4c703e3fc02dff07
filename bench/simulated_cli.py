"""The GPU regime on paper: `python scripts/simulated_report.py` compares k policies on SIMULATED GPU cost
profiles (scripts/profile_device.py --simulate) over a grid of batch size x context length, in the noise-free
replay env with the CPU's acceptance traces of the test split: static k, vLLM's per-batch-size table, the
same table with a context axis, SGLang's EMA rule, the learned policy of that chip (trained with
--allow-simulated) and the oracle (one row)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.decoding.config import parse_config, parse_ints
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.paths import atomic_write_text, policy_dir, relative, traces_path
from specpilot.decoding.policies import StaticK
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import (
    CostModel, load_draft_traces, load_profile, oracle_schedule, plain_seconds, profile_hardware, truncate,
)
from specpilot.env.replay_env import replay_evaluate

from .batch_table import BatchContextTableK, BatchTableK, goodput_table
from .report import provenance_line, source_commit


@dataclass
class SimulatedReportConfig:
    """Compare k policies on simulated GPU cost profiles over batch size x context length (replay, SIMULATED)."""

    devices: str = "a100,h100"
    """Comma-separated chips with a profiles/DEVICE-simulated.json."""
    batch_sizes: str = "1,8,32,128"
    """Batch sizes of the grid."""
    context_lens: str = "512,4096,16384"
    """Context lengths of the grid (each row's context starts there; its trace's tokens follow)."""
    split: str = "test"
    """Traces scored: test | ood (the tables and the learned policy saw the train split only)."""
    max_new_tokens: int = 48
    """Tokens per row."""
    k_max: int = 8
    """Largest k."""
    draft: str = "ngram:3"
    """Draft whose acceptance traces are replayed (profiles/traces-DRAFT.json)."""
    draft_shape: str = ""
    """The draft's cost shape the simulated profiles price (profiles/DEVICE-SHAPE-simulated.json, written by
    profile_device.py --simulate DEVICE --draft-config configs/SHAPE); '' = prompt lookup's (no draft cost)."""
    profiles: str = "profiles"
    """Folder of the simulated profiles."""
    policies: str = "policies"
    """Root of the learned policies (POLICIES/DEVICE/DRAFT)."""
    report: str = "reports/simulated-gpu.md"
    """Report page (+ .json and .png beside it)."""


def split_traces(cfg, split):
    """The recorded traces of `cfg.draft` in one split, cut to `cfg.max_new_tokens`."""
    traces, meta = load_draft_traces(traces_path(cfg.draft), cfg.draft, cfg.max_new_tokens)
    splits = meta.get("splits") or {}
    chosen = [truncate(t, cfg.max_new_tokens) for t in traces if splits.get(t.question_id) == split]
    if not chosen:
        raise SpecPilotError(f"no traces of the {split} split in {traces_path(cfg.draft)}")
    return chosen


def best_static(profile: dict, traces, k_max: int, sizes: list[int], contexts: list[int]) -> int:
    """The one k best over the whole grid on the train traces (goodput relative to plain, averaged over cells)."""
    cost, score = CostModel.from_profile(profile), np.zeros(k_max + 1)
    for c in contexts:
        for goodput in goodput_table(cost, traces, k_max, c, sizes).values():
            score += goodput / goodput[0]
    return int(np.argmax(score))


CONFIDENCE_GRID = [f"confidence:{p}:{k}" for p in (0.3, 0.5, 0.7) for k in (4, 8)]
"""llama.cpp's p-min rule, the spellings the simulated report tunes over (the whole grid at once, on train traces)."""


def best_confidence_rule(profile: dict, traces, k_max: int, sizes: list[int], contexts: list[int]) -> str:
    """The p-min spelling with the best mean log speedup over the grid's cells on these (train) traces."""
    cost, hardware = CostModel.from_profile(profile), profile_hardware(profile)
    names = [n for n in CONFIDENCE_GRID if int(n.rsplit(":", 1)[1]) <= k_max]
    score = dict.fromkeys(names, 0.0)
    for b in sizes:
        for c in contexts:
            rows = replay_evaluate({n: parse_policy(n, k_max) for n in names}, traces, cost, k_max, hardware, b,
                                   context_len=c)
            for n in names:
                score[n] += float(np.log(rows[n]["speedup"]))
    return max(names, key=score.get)


def oracle_speedup(traces, cost: CostModel, k_max: int, context: int) -> float:
    """The hindsight optimum at one row, each trace's context starting at `context`."""
    offsets = [max(0, context - len(t.prompt_ids)) for t in traces]
    best = sum(oracle_schedule(t, cost, k_max, context_offset=o)[0] for t, o in zip(traces, offsets))
    return sum(plain_seconds(t, cost, o) for t, o in zip(traces, offsets)) / best


def simulated_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(SimulatedReportConfig, argv)
    sizes, contexts = parse_ints(cfg.batch_sizes, "--batch-sizes"), parse_ints(cfg.context_lens, "--context-lens")
    train, test = split_traces(cfg, "train"), split_traces(cfg, cfg.split)
    results = {}
    for device in [d.strip() for d in cfg.devices.split(",") if d.strip()]:
        path = Path(cfg.profiles) / f"{device}{'-' + cfg.draft_shape if cfg.draft_shape else ''}-simulated.json"
        profile = load_profile(path)
        if not profile.get("simulated"):
            raise SpecPilotError(f"{path} is not a simulated profile")
        cost = CostModel.from_profile(profile)
        k = best_static(profile, train, cfg.k_max, sizes, contexts)
        policies = {f"static:{k}": StaticK(k),
                    "batch-table": BatchTableK.from_profile(profile, train, cfg.k_max, contexts),
                    "batch-context-table": BatchContextTableK.from_profile(profile, train, cfg.k_max, contexts),
                    "sglang-adaptive": parse_policy("sglang-adaptive", cfg.k_max)}
        if any(c != 1.0 for t in train for cs in t.confidences for c in cs):  # a model draft: its confidence rule
            name = best_confidence_rule(profile, train, cfg.k_max, sizes, contexts)
            policies[f"p-min ({name})"] = parse_policy(name, cfg.k_max)
        folder = policy_dir(device, cfg.draft, cfg.policies)
        if (folder / "policy.json").exists():
            policies["learned"] = LearnedK.load(folder, allow_device_mismatch=True, draft=cfg.draft, replay=True)
        else:
            print(f"no learned policy for {device} in {folder} (train one: python scripts/train_policy.py --device {device} "
                  f"--allow-simulated --profile {path})", file=sys.stderr)
        cells = {}
        for b in sizes:
            for c in contexts:
                row = replay_evaluate(policies, test, cost, cfg.k_max, profile_hardware(profile), b, cfg.max_new_tokens,
                                      context_len=c)
                cell = {name: r["speedup"] for name, r in row.items()}
                if b == 1:
                    cell["oracle"] = oracle_speedup(test, cost, cfg.k_max, c)
                cell["best_k_table"] = policies["batch-context-table"].k_for(b, c)
                cells[f"{b}x{c}"] = cell
                print(f"{device} B={b:<4} context {c:<6} " + " ".join(f"{n} {v:.3f}" for n, v in cell.items()
                                                                           if n != "best_k_table"), file=sys.stderr)
        results[device] = {"profile": relative(path), "hardware_name": profile["hardware_name"], "cells": cells,
                           **({"weights": policies["learned"].meta.get("weights")} if "learned" in policies else {}),
                           "policies": list(policies), "batch_table": policies["batch-table"].table,
                           "context_table": {f"{b}x{c}": k for (b, c), k in policies["batch-context-table"].table.items()}}
    doc = {"provenance": {"commit": source_commit(), "policy_weights": {
               f"learned ({d})": r.get("weights") for d, r in results.items() if "weights" in r}},
           "simulated": True, "split": cfg.split, "batch_sizes": sizes, "context_lens": contexts,
           "max_new_tokens": cfg.max_new_tokens, "draft": cfg.draft, "draft_shape": cfg.draft_shape, "results": results}
    report = Path(cfg.report)
    atomic_write_text(report.with_suffix(".json"), json.dumps(doc, indent=1))
    _plot(doc, report.with_suffix(".png"))
    atomic_write_text(report, _markdown(doc, report.with_suffix(".png").name, argv))
    print(_markdown(doc, report.with_suffix(".png").name, argv))
    return 0


def _markdown(doc: dict, png: str, argv) -> str:
    sizes, contexts = doc["batch_sizes"], doc["context_lens"]
    lines = ["# SIMULATED GPU regime: k policies over batch size x context length", "",
             "**Simulated**: step costs from a roofline model of Llama-3.1-8B (bf16) on each chip's published numbers "
             "(`env/simulate.py`, `scripts/profile_device.py --simulate`"
             + (f", a drafted token priced as the `configs/{doc['draft_shape']}` shape" if doc.get("draft_shape") else "")
             + f"), acceptance from the embedded pair's `{doc['draft']}` traces recorded on the CPU ({doc['split']} split; "
             "the tables, the tuned rules and the learned policy saw the train split). "
             "Noise-free replay; speedup over plain decoding in each cell; each row's context starts at the cell's length.", "",
             provenance_line(doc["provenance"]), "",
             f"Regenerate with: `python scripts/simulated_report.py {' '.join(argv or sys.argv[1:])}`", ""]
    for device, res in doc["results"].items():
        lines += [f"## {res['hardware_name']}", "",
                  "| policy | " + " | ".join(f"B={b} c={c}" for b in sizes for c in contexts) + " | mean |",
                  "|---|" + "---|" * (len(sizes) * len(contexts) + 1)]
        names = [n for n in res["policies"]] + ["oracle"]
        for name in names:
            vals = [res["cells"][f"{b}x{c}"].get(name) for b in sizes for c in contexts]
            shown = [v for v in vals if v is not None]
            lines.append(f"| {name} | " + " | ".join("" if v is None else f"{v:.3f}" for v in vals)
                         + f" | {np.mean(shown):.3f} |" if shown else "")
        if "learned" in res["policies"]:
            ratios = [res["cells"][f"{b}x{c}"]["learned"] / res["cells"][f"{b}x{c}"]["batch-table"] for b in sizes for c in contexts]
            lines += ["| learned / batch-table | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {np.mean(ratios):.3f} |"]
        lines += ["", "Best k of the context table per cell: " + ", ".join(
            f"B={b} c={c}: {res['cells'][f'{b}x{c}']['best_k_table']}" for b in sizes for c in contexts), ""]
    lines += [f"![heat maps]({png})", ""]
    return "\n".join(lines)


def _plot(doc: dict, path: Path) -> None:
    from .plots import _pyplot

    plt = _pyplot()
    devices = list(doc["results"])
    sizes, contexts = doc["batch_sizes"], doc["context_lens"]
    fig, axes = plt.subplots(2, len(devices), figsize=(4.5 * len(devices), 7), squeeze=False)
    for j, device in enumerate(devices):
        cells = doc["results"][device]["cells"]
        best = np.array([[cells[f"{b}x{c}"]["best_k_table"] for c in contexts] for b in sizes])
        panels = [(best, "best k (context table)", "viridis")]
        if "learned" in cells[f"{sizes[0]}x{contexts[0]}"]:
            ratio = np.array([[cells[f"{b}x{c}"]["learned"] / cells[f"{b}x{c}"]["batch-table"] for c in contexts] for b in sizes])
            panels.append((ratio, "learned / batch-table", "RdYlGn"))
        for i, (data, title, cmap) in enumerate(panels):
            ax = axes[i][j]
            im = ax.imshow(data, cmap=cmap, aspect="auto")
            ax.set_xticks(range(len(contexts)), [str(c) for c in contexts])
            ax.set_yticks(range(len(sizes)), [str(b) for b in sizes])
            ax.set_xlabel("context length")
            ax.set_ylabel("batch size")
            ax.set_title(f"{device} (simulated): {title}", fontsize=9)
            for (r, c), v in np.ndenumerate(data):
                ax.text(c, r, f"{v:.2f}" if data.dtype.kind == "f" else str(v), ha="center", va="center", fontsize=8)
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
