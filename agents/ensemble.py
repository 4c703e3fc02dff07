"""Seed ensembles: `python -m specpilot.agents.ensemble --policies A,B,C --out DIR` merges policies trained with different
seeds (same device, draft and features) into one MLP whose logits are the mean of theirs.

Policies trained alike but from other seeds differ by 1-2% at one row (reports/README.md); the mean of their
logits keeps what they agree on and averages out what each learned from its own sample of states. The merged
network is the members side by side: their first layers stacked (each member's normalisation folded into its
rows, under one common normalisation), the hidden layers block-diagonal, the last layers side by side and
divided by the number of members. So `LearnedK` runs it unchanged, and the file says which policies it holds.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.decoding.config import parse_config, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.paths import relative

from .export import provenance_of, write_policy


@dataclass
class EnsembleConfig:
    """Merge policies of one device and draft (e.g. several --seed runs) into one whose logits are their mean."""

    policies: str = ""
    """Comma-separated policy.json paths (or their folders), at least two."""
    out: str = ""
    """Folder of the merged policy (policy.json + weights; a policy already there is kept as policy.prev.json)."""


def merge(members: list[LearnedK]) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
    """(layers as (W, b) with W of shape (out, in), normalisation) of the MLP computing the mean of the
    members' logits, for inputs within every member's clipping bounds (the merged policy clips to the
    tightest of them)."""
    if len(members) < 2:
        raise SpecPilotError("an ensemble needs at least two policies")
    first = members[0]
    for m in members:
        if m.by_batch:
            raise SpecPilotError(f"policy {m.path} runs a network per batch size (by_batch): merge the phases' policies "
                                 "(OUT/phases/NAME, or the seeds' run/candidates/NAME) instead")
    for m in members[1:]:
        for what in ("k_max", "action_to_k", "action_to_stop", "features"):
            if getattr(m, what) != getattr(first, what):
                raise SpecPilotError(f"policies {first.path} and {m.path} differ in {what}: not one device's seeds")
        for what in ("device", "draft", "activation"):
            if m.meta.get(what) != first.meta.get(what):
                raise SpecPilotError(f"policies {first.path} and {m.path} differ in {what}: not one device's seeds")
        if len(m.layers) != len(first.layers):
            raise SpecPilotError(f"policies {first.path} and {m.path} differ in depth")
    if first.features != list(FEATURES):
        raise SpecPilotError(f"policy {first.path} reads an older feature list; retrain it before merging")
    n = len(members)
    mean = np.mean([m.mean for m in members], axis=0)
    # a feature stays read when any member reads it (pinned only where every member pinned it)
    reads = [m.input_bounds()[2] for m in members]
    var = np.max([np.where(r, 1.0 / np.where(r, m.inv_std, 1.0) ** 2, 0.0) for m, r in zip(members, reads)], axis=0)
    epsilon = 1e-8
    still = ~np.any(reads, axis=0)
    inv_std = np.where(still, 0.0, 1.0 / np.sqrt(var + epsilon))
    lo, hi = bounds(members)
    if (lo > hi).any():
        names = [f for f, bad in zip(FEATURES, lo > hi) if bad]
        raise SpecPilotError(f"the policies' trained ranges do not overlap in {names[:4]}: not one device's seeds")
    normalization = {"mean": mean.tolist(), "var": np.where(still, 0.0, var).tolist(), "epsilon": epsilon,
                     "clip": 1e6, "low": lo.tolist(), "high": hi.tolist()}
    # member i sees z_i = (x - m_i) * s_i = z * (s_i / s) + (m - m_i) * s_i, z = (x - m) * s the common input
    ratio = [np.where(still, 0.0, m.inv_std / np.where(still, 1.0, inv_std)) for m in members]
    offset = [(mean - m.mean) * m.inv_std for m in members]
    w0 = np.concatenate([m.layers[0][0].T * r[None, :] for m, r in zip(members, ratio)])
    b0 = np.concatenate([m.layers[0][1] + m.layers[0][0].T @ o for m, o in zip(members, offset)])
    layers = [(w0, b0)]
    depth = len(first.layers)
    for i in range(1, depth):
        blocks = [m.layers[i][0].T for m in members]  # (out, in) each
        if i == depth - 1:
            w = np.concatenate(blocks, axis=1) / n
            b = np.mean([m.layers[i][1] for m in members], axis=0)
        else:
            w = np.zeros((sum(x.shape[0] for x in blocks), sum(x.shape[1] for x in blocks)))
            r = c = 0
            for x in blocks:
                w[r : r + x.shape[0], c : c + x.shape[1]] = x
                r, c = r + x.shape[0], c + x.shape[1]
            b = np.concatenate([m.layers[i][1] for m in members])
        layers.append((w, b))
    return layers, normalization


def sample_inside(members: list[LearnedK], n: int = 512, seed: int = 0) -> np.ndarray:
    """Observations within every member's clipping bounds (where the merged policy equals their mean)."""
    rng = np.random.default_rng(seed)
    lo, hi = bounds(members)
    return lo + (hi - lo) * rng.random((n, len(lo)))


def bounds(members: list[LearnedK]) -> tuple[np.ndarray, np.ndarray]:
    """The tightest of the members' input bounds (their trained ranges and +-clip standard deviations), over
    the members that read each feature; a feature none reads: the members' mean."""
    found = [m.input_bounds() for m in members]
    lo = np.max([np.where(read, low, -np.inf) for low, _, read in found], axis=0)
    hi = np.min([np.where(read, high, np.inf) for _, high, read in found], axis=0)
    centre = np.mean([m.mean for m in members], axis=0)
    return np.where(np.isfinite(lo), lo, centre), np.where(np.isfinite(hi), hi, centre)


def check_merged(members: list[LearnedK], meta_path: Path, tolerance: float = 1e-4) -> float:
    """Largest gap between the merged policy's logits and the mean of the members' (an error above `tolerance`)."""
    merged = LearnedK.load(meta_path, allow_device_mismatch=True)
    obs = sample_inside(members)
    gap = float(np.abs(merged.logits(obs) - np.mean([m.logits(obs) for m in members], axis=0)).max())
    if gap > tolerance:
        raise SpecPilotError(f"merge check failed: the merged logits differ from the members' mean by {gap:.2e}")
    return gap


def merge_policies(paths: list, out) -> Path:
    """Merge the policies at `paths` into OUT/policy.json (written atomically, checked against the members'
    mean logits); the members' paths, weights and seeds go into its `ensemble` entry."""
    members = [LearnedK.load(p, allow_device_mismatch=True) for p in paths]
    layers, normalization = merge(members)
    meta = members[0].meta
    provenance = provenance_of(meta, ("seed", "ensemble"))  # what the members share
    provenance["ensemble"] = [{"path": relative(m.path), "weights": m.meta.get("weights"), "seed": m.meta.get("seed")}
                              for m in members]
    return write_policy(out, layers, normalization, meta["activation"], members[0].k_max, meta["device"],
                        meta.get("hardware_name", ""), sum(int(m.meta.get("training_steps", 0)) for m in members),
                        provenance, check=lambda path: check_merged(members, path),
                        stop_levels=members[0].actions.stop_levels, sources=members[0].actions.sources)


def ensemble_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(EnsembleConfig, argv)
    paths = [p.strip() for p in cfg.policies.split(",") if p.strip()]
    if len(paths) < 2 or not cfg.out:
        raise SpecPilotError("--policies needs at least two comma-separated policies, and --out a folder")
    out = merge_policies(paths, cfg.out)
    decision_us = 1e6 * LearnedK.load(out, allow_device_mismatch=True).decision_seconds()
    print(json.dumps({"policy": str(out), "members": paths, "decision_us": round(decision_us, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(ensemble_main))
