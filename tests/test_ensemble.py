"""Seed ensembles (agents.ensemble): one MLP whose logits are the mean of its members', written and read back."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specpilot.agents.ensemble import ensemble_main, merge, sample_inside
from specpilot.agents.export import write_policy
from specpilot.agents.improve import as_policy
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.observation import FEATURES


def member(seed: int, pinned: tuple[int, ...] = (), hidden=(16, 12), k_max: int = 8) -> LearnedK:
    """A random policy with its own normalisation (and some features pinned), as a seed's training leaves it."""
    rng = np.random.default_rng(seed)
    n = len(FEATURES)
    sizes = [n, *hidden, k_max + 1]
    layers = [(rng.standard_normal((b, a)) / np.sqrt(a), rng.standard_normal(b) * 0.1) for a, b in zip(sizes, sizes[1:])]
    mean = rng.standard_normal(n)
    var = rng.uniform(0.2, 2.0, n)
    var[list(pinned)] = 0.0
    low, high = mean - 3 * np.sqrt(var) - 0.1, mean + 3 * np.sqrt(var) + 0.1
    norm = {"mean": mean.tolist(), "var": var.tolist(), "epsilon": 1e-8, "clip": 10.0, "low": low.tolist(),
            "high": high.tolist()}
    return as_policy(layers, norm, "tanh", k_max, {"device": "cpu", "draft": "ngram:3", "seed": seed})


def test_merged_logits_are_the_members_mean():
    members = [member(0, pinned=(0, 1)), member(1, pinned=(0, 5)), member(2, pinned=(0,), hidden=(8, 20))]
    layers, norm = merge(members)
    merged = as_policy(layers, norm, "tanh", 8)
    obs = sample_inside(members, n=400)
    mean = np.mean([m.logits(obs) for m in members], axis=0)
    assert np.abs(merged.logits(obs) - mean).max() < 1e-4  # float32 layers
    # a feature every member pinned stays pinned; one a member reads stays read
    read = merged.input_bounds()[2]
    assert not read[0] and read[1] and read[5]
    # the merged policy is not just one of its members
    assert (np.argmax(merged.logits(obs), -1) != np.argmax(members[0].logits(obs), -1)).any()


def test_merge_refuses_policies_that_are_not_one_devices_seeds():
    with pytest.raises(SpecPilotError, match="at least two"):
        merge([member(0)])
    with pytest.raises(SpecPilotError, match="k_max"):
        merge([member(0), member(1, k_max=4)])
    other = member(1)
    other.meta["draft"] = "default"
    with pytest.raises(SpecPilotError, match="draft"):
        merge([member(0), other])
    apart = member(1)
    lo, hi, _ = member(0).input_bounds()
    apart._lo, apart._hi = hi + 1.0, hi + 2.0  # trained on inputs the other never saw
    with pytest.raises(SpecPilotError, match="do not overlap"):
        merge([member(0), apart])


def test_ensemble_command_writes_a_policy_learnedk_reads(tmp_path):
    paths = []
    for seed in (0, 1):
        m = member(seed, pinned=(2,))
        layers = [(wt.T, b) for wt, b in m.layers]  # transposed views (Fortran order): must be stored as they read
        paths.append(write_policy(tmp_path / f"s{seed}", layers, m.meta["normalization"], "tanh", 8, "cpu", "test", 10,
                                  {"draft": "ngram:3", "seed": seed}))
        back = LearnedK.load(paths[-1], device="cpu")
        obs = sample_inside([m])
        assert np.abs(back.logits(obs) - m.logits(obs)).max() < 1e-4
    assert ensemble_main(["--policies", ",".join(str(p) for p in paths), "--out", str(tmp_path / "ens")]) == 0
    merged = LearnedK.load(tmp_path / "ens", device="cpu")
    members = [LearnedK.load(p, device="cpu") for p in paths]
    obs = sample_inside(members)
    assert np.abs(merged.logits(obs) - np.mean([m.logits(obs) for m in members], axis=0)).max() < 1e-4
    meta = json.loads((tmp_path / "ens" / "policy.json").read_text())
    assert [m["seed"] for m in meta["ensemble"]] == [0, 1] and meta["draft"] == "ngram:3"
    assert meta["training_steps"] == 20
