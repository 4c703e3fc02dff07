"""Export an SB3 PPO policy to the lightweight format `decoding.learned.LearnedK` reads."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import gymnasium
import numpy as np
import stable_baselines3
import torch
import transformers
from safetensors.numpy import save

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import FORMAT_VERSION, LearnedK, pinned_mask
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.paths import atomic_write_text
from specpilot.decoding.policies import ActionTable


def _linear_layers(model) -> list[torch.nn.Linear]:
    policy = model.policy
    layers = [m for m in policy.mlp_extractor.policy_net if isinstance(m, torch.nn.Linear)]
    return layers + [policy.action_net]


def _versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "stable_baselines3": stable_baselines3.__version__,
            "gymnasium": gymnasium.__version__, "numpy": np.__version__, "python": platform.python_version()}


WRITTEN_KEYS = frozenset({"format_version", "weights", "features", "normalization", "activation", "layers", "action_to_k",
                          "action_to_stop", "k_max", "device", "hardware_name", "training_steps", "versions", "created", "by_batch"})
"""The keys `write_policy` writes itself: the rest of a policy's meta is its provenance."""


def provenance_of(meta: dict, also: tuple[str, ...] = ()) -> dict:
    """A written policy's provenance (its meta less what `write_policy` writes, less `also`), to write it again."""
    return {key: value for key, value in meta.items() if key not in WRITTEN_KEYS and key not in also}


def write_policy(out_dir: str | Path, layers: list[tuple[np.ndarray, np.ndarray]], normalization: dict, activation: str,
                 k_max: int, device: str, hardware_name: str, training_steps: int, provenance: dict,
                 check: Callable[[Path], object] | None = None, by_batch: dict[int, tuple] | None = None,
                 stop_levels=(0.0,), sources=(None,)) -> Path:
    """Write policy.json + its weights (the format `LearnedK` reads) for an MLP given as (W, b) layers.

    `by_batch` = {batch size: (phase name, layers, normalization)}: the network that decides batches from that size
    up (to the next listed one), stored beside the main one; (phase name, None, None) is the main network itself.
    `stop_levels`: the networks' actions are (k, stop level) pairs (`decoding.policies.ActionTable`), listed in
    `action_to_k` and `action_to_stop` (only k, as before, with the one level 0); with `sources` (a hybrid drafter's)
    (source, k, stop level) triples, the sources in `action_to_source`.

    Atomic and checked: both files are written to a temporary folder beside `out_dir`, `check(meta_path)`
    runs there, the weights move in under a name of their own (policy-<sha>.safetensors, named in the
    JSON) and one rename of policy.json commits the policy. A failed check or a kill at any point leaves
    the previous policy loadable; the one replaced is kept as policy.prev.json (+ its weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    actions = ActionTable(k_max, stop_levels, sources)
    names = [f"layer{i}" for i in range(len(layers))]
    weights = {}
    for name, (w, b) in zip(names, layers):
        # C order: safetensors writes the buffer as it lies, so a transposed (Fortran-order) view would be stored
        # transposed
        weights[f"{name}.weight"] = np.ascontiguousarray(w, dtype=np.float32)
        weights[f"{name}.bias"] = np.ascontiguousarray(b, dtype=np.float32)
    table = {}
    for size, (phase, sub_layers, sub_norm) in sorted((by_batch or {}).items()):
        table[str(size)] = {"phase": phase}
        if sub_layers is None:
            continue
        sub_names = [f"b{size}.layer{i}" for i in range(len(sub_layers))]
        for name, (w, b) in zip(sub_names, sub_layers):
            weights[f"{name}.weight"] = np.ascontiguousarray(w, dtype=np.float32)
            weights[f"{name}.bias"] = np.ascontiguousarray(b, dtype=np.float32)
        table[str(size)].update(layers=sub_names, normalization={
            **sub_norm, "pinned": [f for f, p in zip(FEATURES, pinned_mask(sub_norm["var"])) if p]})
    blob = save(weights)
    weights_name = f"policy-{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"
    meta = {
        "format_version": FORMAT_VERSION,
        "weights": weights_name,
        "features": list(FEATURES),
        # `pinned` is for reading: the features held at their training mean (std < MIN_FEATURE_STD); LearnedK
        # derives them from `var`, as agents.ppo.PinnedVecNormalize does in training
        "normalization": {**normalization, "pinned": [f for f, p in zip(FEATURES, pinned_mask(normalization["var"])) if p]},
        "activation": activation,
        "layers": names,
        "action_to_k": actions.to_k,
        **({"action_to_stop": actions.to_stop} if len(actions.stop_levels) > 1 or actions.sources != [None] else {}),
        **({"action_to_source": actions.to_source} if actions.sources != [None] else {}),
        "k_max": k_max,
        "device": device,
        "hardware_name": hardware_name,
        "training_steps": int(training_steps),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **provenance,
        **({"by_batch": table} if table else {}),
    }
    for stale in out.glob(".export-*"):  # left by an export that was killed
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        (staging / weights_name).write_bytes(blob)
        (staging / "policy.json").write_text(json.dumps(meta, indent=1))
        if check is not None:
            check(staging / "policy.json")
        os.replace(staging / weights_name, out / weights_name)  # a new name: the live policy is untouched
        keep_previous(out)
        os.replace(staging / "policy.json", out / "policy.json")  # the commit
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _drop_unreferenced_weights(out)
    return out / "policy.json"


def _referenced_weights(meta_path: Path) -> str | None:
    try:
        return json.loads(meta_path.read_text()).get("weights", meta_path.with_suffix(".safetensors").name)
    except (OSError, ValueError, AttributeError):
        return None


def _drop_unreferenced_weights(out: Path) -> None:
    """Weights files that neither policy.json nor policy.prev.json name (left by an interrupted export)."""
    keep = {_referenced_weights(out / name) for name in ("policy.json", "policy.prev.json")}
    for path in [*out.glob("policy-*.safetensors"), out / "policy.safetensors"]:  # (the older layout's name too)
        if path.name not in keep:
            path.unlink(missing_ok=True)


def keep_previous(out: Path) -> None:
    """A policy already in `out` is kept as policy.prev.json (restore: `mv policy.prev.json policy.json`).

    Its weights stay where they are (named in its JSON); a policy of the older layout (weights in
    policy.safetensors) is copied to policy.prev.safetensors, where its JSON finds them."""
    current = out / "policy.json"
    if not current.exists():
        return
    meta_text = current.read_text()
    try:
        meta = json.loads(meta_text)
    except ValueError:
        return  # not a policy: nothing worth keeping
    if "weights" not in meta and (out / "policy.safetensors").exists():  # the older layout: copy, and name it
        tmp = out / ".policy.prev.safetensors.tmp"
        shutil.copyfile(out / "policy.safetensors", tmp)
        os.replace(tmp, out / "policy.prev.safetensors")
        meta_text = json.dumps({**meta, "weights": "policy.prev.safetensors"}, indent=1)
    atomic_write_text(out / "policy.prev.json", meta_text)
    print(f"specpilot: the previous policy in {out} is kept as policy.prev.json "
          f"(restore: mv {out / 'policy.prev.json'} {out / 'policy.json'})", file=sys.stderr)


def export_policy(model, venv, out_dir: str | Path, device: str, hardware_name: str, k_max: int, provenance: dict,
                  check_obs: np.ndarray | None = None, activation: str = "tanh") -> Path:
    """Write the policy; it is committed only once LearnedK picks SB3's actions on a batch of observations. Its
    actions are the env's (k, or (k, stop level) pairs: `ActionTable`), read from the env it trained on."""
    table = env_actions(venv)
    layers = [(layer.weight.detach().cpu().numpy(), layer.bias.detach().cpu().numpy()) for layer in _linear_layers(model)]
    normalization = {"mean": venv.obs_rms.mean.tolist(), "var": venv.obs_rms.var.tolist(),
                     "epsilon": float(venv.epsilon), "clip": float(venv.clip_obs)}
    return write_policy(out_dir, layers, normalization, activation, k_max, device, hardware_name, model.num_timesteps,
                        provenance, check=lambda meta_path: check_export(model, venv, meta_path, device, check_obs),
                        stop_levels=table.stop_levels, sources=table.sources)


def env_actions(venv) -> ActionTable:
    """The action table of the envs a model trained on (a vectorised, possibly normalised env of specpilot envs)."""
    table = venv.get_attr("actions", indices=[0])[0]
    if not isinstance(table, ActionTable):
        raise SpecPilotError(f"the training env has no action table (got {type(table).__name__})")
    return table


def sb3_near_ties(model, normalized_obs: np.ndarray, tie: float = 1e-4) -> np.ndarray:
    """Rows on which SB3's two best action logits are within `tie` of each other."""
    with torch.no_grad():
        obs_t, _ = model.policy.obs_to_tensor(normalized_obs)
        top2 = np.sort(model.policy.get_distribution(obs_t).distribution.logits.cpu().numpy(), axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) <= tie


def check_export(model, venv, meta_path: Path, device: str, obs: np.ndarray | None = None, n: int = 512,
                 tie: float = 1e-4) -> float:
    """Fraction of observations on which the export picks SB3's action; an error unless every disagreement is a
    near-tie of SB3's own two best logits (within `tie`: float32 rounding of the same network may flip it)."""
    rng = np.random.default_rng(0)
    std = np.sqrt(venv.obs_rms.var)
    synthetic = venv.obs_rms.mean + std * rng.standard_normal((n, len(FEATURES)))
    synthetic[: n // 2, pinned_mask(venv.obs_rms.var)] += 1.0  # pinned features far from their training values: still agree
    batch = synthetic if obs is None or len(obs) == 0 else np.concatenate([np.asarray(obs), synthetic])
    batch = batch.astype(np.float32)
    sb3_actions, _ = model.predict(venv.normalize_obs(batch), deterministic=True)
    learned = LearnedK.load(meta_path, device=device)
    ours = np.argmax(learned.logits(batch), axis=-1)
    differ = ours != sb3_actions
    near_tie = sb3_near_ties(model, venv.normalize_obs(batch), tie)
    if np.any(differ & ~near_tie):
        agree = float(np.mean(~differ))
        raise SpecPilotError(f"export check failed: the exported policy agrees with SB3 on {agree:.1%} of observations "
                             f"({int(np.sum(differ & ~near_tie))} disagreements are not near-ties)")
    return float(np.mean(~differ))
