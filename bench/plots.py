"""PNG plots: a device's cost curve and a benchmark's speedups."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib  # slow to import: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(profile: dict, path: str | Path) -> None:
    """Step cost vs k (verify pass and verify + k draft tokens), one line per context length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ks = profile["k"]
    for c, row, draft in zip(profile["context_lens"], profile["verify_s"], profile["draft_s_per_token"]):
        line, = ax.plot(ks, [1000 * s for s in row], marker="o", label=f"verify, context {c}")
        ax.plot(ks, [1000 * (s + draft * k) for k, s in zip(ks, row)], ls="--", color=line.get_color(),
                label=f"draft + verify, context {c}")
    ax.set_xlabel("k (drafted tokens verified in one target pass)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{profile.get('device', '?')} ({profile.get('hardware_name', '')}): step cost vs k\n"
                 f"target {profile.get('target', '')[:40]}, draft {profile.get('draft')}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_benchmark(summary: dict, runs, path: str | Path) -> None:
    """Left: speedup over plain per category per policy. Right: histogram of the k each policy chose."""
    plt = _pyplot()
    policies = [p for p in summary["policies"] if p != "none"]
    colors = plt.get_cmap("tab20").colors
    cats = summary["categories"] + ["overall"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / max(1, len(policies))
    x = np.arange(len(cats))
    for j, policy in enumerate(policies):
        row = summary["table"][policy]
        ax1.bar(x + j * width, [row[c]["speedup"] if c in row else 0 for c in cats], width, label=policy,
                color=colors[j % len(colors)])
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.set_xticks(x + width * (len(policies) - 1) / 2, cats, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("speedup over plain decoding")
    ax1.legend(fontsize=7, ncol=2)
    ax1.grid(axis="y", alpha=0.3)
    for j, policy in enumerate(policies):
        counts = Counter(k for r in runs if r.policy == policy for k in r.ks)
        total = sum(counts.values()) or 1
        ks = sorted(counts)
        ax2.plot(ks, [counts[k] / total for k in ks], marker="o", label=policy, color=colors[j % len(colors)])
    ax2.set_xlabel("k chosen (drafted)")
    ax2.set_ylabel("share of steps")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch_benchmark(summary: dict, path: str | Path) -> None:
    """Left: tokens/s of all rows vs batch size per policy. Right: speedup over plain at each batch size."""
    plt = _pyplot()
    sizes = summary["batch_sizes"]
    colors = plt.get_cmap("tab20").colors
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for j, policy in enumerate(summary["policies"]):
        cells = [summary["table"][str(b)][policy] for b in sizes]
        style = {"marker": "o", "color": colors[j % len(colors)], "label": policy, "lw": 2.2 if policy == "learned" else 1.2}
        ax1.plot(sizes, [c["tokens_per_s"] for c in cells], **style)
        ax2.plot(sizes, [c["speedup"] for c in cells], **style)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("tokens/s (all rows)")
    ax2.set_ylabel("speedup over plain decoding at that batch size")
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load_benchmark(summary: dict, path: str | Path) -> None:
    """One panel per batch size: the paired speedup over plain (same load) of each policy, grouped by load."""
    plt = _pyplot()
    sizes, loads, policies = summary["batch_sizes"], summary["loads"], summary["policies"]
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    width = 0.8 / len(policies)
    for ax, b in zip(axes[0], sizes):
        for j, policy in enumerate(policies):
            cells = [summary["by_load"][load]["table"][str(b)][policy] for load in loads]
            values = [c.get("speedup_paired", c["speedup"]) for c in cells]
            lows = [v - (c.get("speedup_paired_interval") or [v, v])[0] for v, c in zip(values, cells)]
            highs = [(c.get("speedup_paired_interval") or [v, v])[1] - v for v, c in zip(values, cells)]
            ax.bar(np.arange(len(loads)) + j * width, values, width, yerr=[lows, highs], capsize=2,
                   color=colors[j % len(colors)], label=policy)
        ax.set_xticks(np.arange(len(loads)) + 0.4 - width / 2, loads)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"B = {b}")
        ax.set_ylabel("speedup over plain, same load (paired)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
