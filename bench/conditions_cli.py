"""A busy or throttled GPU, on paper: `python scripts/conditions_report.py` compares k policies on SIMULATED
GPU cost profiles under machine conditions (env/simulate.py CONDITIONS: none, power-cap, cotenant, both), over
the grid of batch size x context length, in the noise-free replay env with the CPU's test-split acceptance
traces. Every speedup is over plain decoding *under the same condition*. The rules are tuned without load
(the none profile, train split), as a serving engine's table is; the learned policy of that chip (trained with
--condition-profiles) reads the counters. Ablation: the same policy with its counters pinned to what they
read without load, and for reference the context table re-tuned under each condition."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.decoding.config import parse_config, parse_ints
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.paths import atomic_write_text, policy_dir, relative
from specpilot.decoding.policies import StaticK
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel, load_profile, profile_hardware
from specpilot.env.replay_env import replay_evaluate
from specpilot.env.simulate import CONDITIONS

from .batch_table import BatchContextTableK, BatchTableK, goodput_table
from .report import provenance_line, source_commit
from .simulated_cli import SimulatedReportConfig, best_static, oracle_speedup, split_traces

PINNED = "learned, counters pinned"
RETUNED = "context table re-tuned"


@dataclass
class ConditionsReportConfig(SimulatedReportConfig):
    """Compare k policies under simulated machine conditions (replay, SIMULATED)."""

    conditions: str = "none,power-cap,cotenant,both"
    """Machine conditions (env/simulate.py CONDITIONS); the first is the one the rules are tuned under."""
    policies: str = "policies-simulated"
    """Root of the learned policies (POLICIES/DEVICE/DRAFT)."""
    report: str = "reports/simulated-conditions.md"
    """Report page (+ .json and .png beside it)."""


def condition_profile(folder: str | Path, device: str, condition: str) -> tuple[Path, dict]:
    path = Path(folder) / (f"{device}-simulated.json" if condition == "none" else f"{device}-{condition}-simulated.json")
    profile = load_profile(path, device)
    if not profile.get("simulated"):
        raise SpecPilotError(f"{path} is not a simulated profile")
    return path, profile


def conditions_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ConditionsReportConfig, argv)
    sizes, contexts = parse_ints(cfg.batch_sizes, "--batch-sizes"), parse_ints(cfg.context_lens, "--context-lens")
    conditions = [c.strip() for c in cfg.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        raise SpecPilotError(f"--conditions: unknown {unknown or 'none given'}; known: {', '.join(CONDITIONS)}")
    train, test = split_traces(cfg, "train"), split_traces(cfg, cfg.split)
    results = {}
    for device in [d.strip() for d in cfg.devices.split(",") if d.strip()]:
        base_path, base = condition_profile(cfg.profiles, device, conditions[0])
        base_hw = profile_hardware(base)
        k = best_static(base, train, cfg.k_max, sizes, contexts)
        rules = {f"static:{k}": StaticK(k), "batch-table": BatchTableK.from_profile(base, train, cfg.k_max, contexts),
                 "batch-context-table": BatchContextTableK.from_profile(base, train, cfg.k_max, contexts),
                 "sglang-adaptive": parse_policy("sglang-adaptive", cfg.k_max)}
        folder = policy_dir(device, cfg.draft, cfg.policies)
        learned = LearnedK.load(folder, allow_device_mismatch=True, draft=cfg.draft, replay=True)
        per_condition = {}
        for condition in conditions:
            path, profile = condition_profile(cfg.profiles, device, condition)
            cost, hardware = CostModel.from_profile(profile), profile_hardware(profile)
            retuned = BatchContextTableK.from_profile(profile, train, cfg.k_max, contexts)
            cells = {}
            for b in sizes:
                for c in contexts:
                    policies = {**rules, "learned": learned, RETUNED: retuned}
                    row = replay_evaluate(policies, test, cost, cfg.k_max, hardware, b, cfg.max_new_tokens, context_len=c)
                    cell = {name: r["speedup"] for name, r in row.items()}
                    pinned = replay_evaluate({PINNED: learned}, test, cost, cfg.k_max, base_hw, b, cfg.max_new_tokens,
                                             context_len=c)
                    cell[PINNED] = pinned[PINNED]["speedup"]
                    if b == 1:
                        cell["oracle"] = oracle_speedup(test, cost, cfg.k_max, c)
                    cell["best_k"] = int(np.argmax(goodput_table(cost, train, cfg.k_max, c, [b])[b]))
                    cells[f"{b}x{c}"] = cell
                    print(f"{device} {condition:<9} B={b:<4} c={c:<6} " + " ".join(
                        f"{n} {v:.3f}" for n, v in cell.items() if n != "best_k"), file=sys.stderr)
            per_condition[condition] = {"profile": relative(path), "cells": cells,
                                        "counters": dict(zip(("hw_sm_clock_ratio", "hw_power_ratio", "hw_gpu_mem_util",
                                                              "hw_gpm_dram_bw_util"), _counters(hardware)))}
        results[device] = {"hardware_name": base["hardware_name"], "policy": relative(folder),
                           "weights": learned.meta.get("weights"),
                           "trained_conditions": learned.meta.get("condition_profiles", []),
                           "rules": list(rules), "conditions": per_condition}
    doc = {"provenance": {"commit": source_commit(), "policy_weights": {
               f"learned ({d})": r["weights"] for d, r in results.items()}},
           "simulated": True, "split": cfg.split, "batch_sizes": sizes, "context_lens": contexts,
           "conditions": conditions, "max_new_tokens": cfg.max_new_tokens, "draft": cfg.draft, "results": results}
    report = Path(cfg.report)
    atomic_write_text(report.with_suffix(".json"), json.dumps(doc, indent=1))
    _plot(doc, report.with_suffix(".png"))
    text = _markdown(doc, report.with_suffix(".png").name, argv)
    atomic_write_text(report, text)
    print(text)
    return 0


def _counters(hardware) -> list[float]:
    from specpilot.decoding.hardware import HW_FEATURES

    values = dict(zip(HW_FEATURES, [float(v) for v in hardware]))
    return [values["hw_sm_clock_ratio"], values["hw_power_ratio"], values["hw_gpu_mem_util"], values["hw_gpm_dram_bw_util"]]


def policy_names(res: dict) -> list[str]:
    return res["rules"] + ["learned", PINNED, RETUNED, "oracle"]


def summary(res: dict, condition: str, name: str) -> tuple[float, float] | None:
    """(mean, min) of a policy's speedup over the grid's cells under a condition (None: not run there)."""
    vals = [cell[name] for cell in res["conditions"][condition]["cells"].values() if name in cell]
    return (float(np.mean(vals)), float(np.min(vals))) if vals else None


def ratio_summary(res: dict, condition: str, num: str, den: str) -> tuple[float, float]:
    """(mean, min) over the grid's cells of one policy's speedup over another's."""
    vals = [cell[num] / cell[den] for cell in res["conditions"][condition]["cells"].values()]
    return float(np.mean(vals)), float(np.min(vals))


def _markdown(doc: dict, png: str, argv) -> str:
    conds, sizes, contexts = doc["conditions"], doc["batch_sizes"], doc["context_lens"]
    lines = ["# SIMULATED GPU under machine conditions: k policies when the chip is throttled or shared", "",
             "**Simulated**: step costs from the roofline model of Llama-3.1-8B (bf16) on each chip's published numbers "
             "under each condition (`env/simulate.py` CONDITIONS: `power-cap` runs the SM clock at 55%, `cotenant` "
             "leaves half the HBM bandwidth, `both`), with the NVML counters as they would read under it; acceptance "
             f"from the embedded pair's n-gram traces recorded on the CPU ({doc['split']} split). Noise-free replay. "
             "Each number is the speedup over plain decoding *under the same condition*, as mean over the grid of "
             f"B {'/'.join(map(str, sizes))} x context {'/'.join(map(str, contexts))} (worst cell in brackets). "
             f"The rules are tuned on the train split under `{conds[0]}` only, as an engine's table is; "
             f"`{PINNED}` is the learned policy shown the `{conds[0]}` counters whatever the condition (the ablation); "
             f"`{RETUNED}` is the context table tuned under the condition itself (a reference no deployed rule has).", "",
             f"Regenerate with: `python scripts/conditions_report.py {' '.join(argv or sys.argv[1:])}`", "",
             provenance_line(doc["provenance"]), ""]
    for device, res in doc["results"].items():
        lines += [f"## {res['hardware_name']}", "", f"Policy `{res['policy']}`, trained under: "
                  + (", ".join(f"`{p}`" for p in res["trained_conditions"]) or "its profile only") + ".", "",
                  "| policy | " + " | ".join(conds) + " |", "|---|" + "---|" * len(conds)]
        for name in policy_names(res):
            cells = [summary(res, c, name) for c in conds]
            lines.append(f"| {name} | " + " | ".join("" if s is None else f"{s[0]:.3f} ({s[1]:.3f})" for s in cells) + " |")
        static = res["rules"][0]
        for num, den in (("learned", static), ("learned", "batch-table"), ("learned", "batch-context-table"),
                         ("learned", PINNED), ("learned", RETUNED)):
            lines.append(f"| {num} / {den} | " + " | ".join(
                "{:.3f} ({:.3f})".format(*ratio_summary(res, c, num, den)) for c in conds) + " |")
        lines += ["", "Best k per cell for the traces' acceptance (B x context): " + "; ".join(
            f"{c}: " + " ".join(f"{b}x{x}={res['conditions'][c]['cells'][f'{b}x{x}']['best_k']}" for b in sizes for x in contexts)
            for c in conds), "",
            "Counters under each condition (SM clock ratio, power ratio, memory-busy, GPM DRAM bandwidth): " + "; ".join(
            f"{c}: " + "/".join(f"{v:.2f}" for v in res["conditions"][c]["counters"].values()) for c in conds), ""]
    lines += [f"![mean speedup per condition]({png})", ""]
    return "\n".join(lines)


def _plot(doc: dict, path: Path) -> None:
    from .plots import _pyplot

    plt = _pyplot()
    devices, conds = list(doc["results"]), doc["conditions"]
    fig, axes = plt.subplots(1, len(devices), figsize=(6.5 * len(devices), 4.2), squeeze=False)
    for ax, device in zip(axes[0], devices):
        res = doc["results"][device]
        names = [n for n in policy_names(res) if n not in ("oracle",)]
        width = 0.8 / len(names)
        lowest = 1.0
        for i, name in enumerate(names):
            means = [summary(res, c, name)[0] for c in conds]
            lowest = min(lowest, *means)
            ax.bar(np.arange(len(conds)) + i * width, means, width, label=name)
        ax.set_ylim(max(0.0, lowest - 0.1), None)  # the differences, not the bars' common base
        ax.set_xticks(np.arange(len(conds)) + 0.4 - width / 2, conds)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("speedup over plain, same condition (grid mean)")
        ax.set_title(f"{device} (SIMULATED)", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
