"""Export an SB3 PPO policy to the lightweight format `decoding.learned.LearnedK` reads."""
from __future__ import annotations

import json
import platform
import shutil
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np
import stable_baselines3
import torch
import transformers
from safetensors.numpy import save_file

from decoding.errors import SpecPilotError
from decoding.learned import FORMAT_VERSION, LearnedK, pinned_mask
from decoding.observation import FEATURES
from decoding.paths import atomic_write_text


def _linear_layers(model) -> list[torch.nn.Linear]:
    policy = model.policy
    layers = [m for m in policy.mlp_extractor.policy_net if isinstance(m, torch.nn.Linear)]
    return layers + [policy.action_net]


def _versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "stable_baselines3": stable_baselines3.__version__,
            "gymnasium": gymnasium.__version__, "numpy": np.__version__, "python": platform.python_version()}


def write_policy(out_dir: str | Path, layers: list[tuple[np.ndarray, np.ndarray]], normalization: dict, activation: str,
                 k_max: int, device: str, hardware_name: str, training_steps: int, provenance: dict) -> Path:
    """Write policy.safetensors + policy.json (the format `LearnedK` reads) for an MLP given as (W, b) layers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"layer{i}" for i in range(len(layers))]
    weights = {}
    for name, (w, b) in zip(names, layers):
        weights[f"{name}.weight"] = np.asarray(w, dtype=np.float32)
        weights[f"{name}.bias"] = np.asarray(b, dtype=np.float32)
    meta = {
        "format_version": FORMAT_VERSION,
        "features": list(FEATURES),
        # `pinned` is for reading: the features held at their training mean (std < MIN_FEATURE_STD); LearnedK
        # derives them from `var`, as agents.ppo.PinnedVecNormalize does in training
        "normalization": {**normalization, "pinned": [f for f, p in zip(FEATURES, pinned_mask(normalization["var"])) if p]},
        "activation": activation,
        "layers": names,
        "action_to_k": list(range(k_max + 1)),
        "k_max": k_max,
        "device": device,
        "hardware_name": hardware_name,
        "training_steps": int(training_steps),
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **provenance,
    }
    keep_previous(out)
    save_file(weights, str(out / "policy.safetensors"))
    meta_path = out / "policy.json"
    atomic_write_text(meta_path, json.dumps(meta, indent=1))
    return meta_path


def keep_previous(out: Path) -> None:
    """A policy already in `out` is kept as policy.prev.{json,safetensors} (restore: rename them back)."""
    if (out / "policy.json").exists() and (out / "policy.safetensors").exists():
        for suffix in ("safetensors", "json"):
            shutil.copyfile(out / f"policy.{suffix}", out / f"policy.prev.{suffix}")
        print(f"specpilot: the previous policy in {out} is kept as policy.prev.json / policy.prev.safetensors",
              file=sys.stderr)


def export_policy(model, venv, out_dir: str | Path, device: str, hardware_name: str, k_max: int, provenance: dict,
                  check_obs: np.ndarray | None = None, activation: str = "tanh") -> Path:
    """Write policy.safetensors + policy.json; verify LearnedK picks SB3's actions on a batch of observations."""
    layers = [(layer.weight.detach().cpu().numpy(), layer.bias.detach().cpu().numpy()) for layer in _linear_layers(model)]
    normalization = {"mean": venv.obs_rms.mean.tolist(), "var": venv.obs_rms.var.tolist(),
                     "epsilon": float(venv.epsilon), "clip": float(venv.clip_obs)}
    meta_path = write_policy(out_dir, layers, normalization, activation, k_max, device, hardware_name,
                             model.num_timesteps, provenance)
    check_export(model, venv, meta_path, device, check_obs)
    return meta_path


def check_export(model, venv, meta_path: Path, device: str, obs: np.ndarray | None = None, n: int = 512) -> float:
    """Fraction of observations on which the export agrees with SB3 (must be 1.0, else an error)."""
    rng = np.random.default_rng(0)
    std = np.sqrt(venv.obs_rms.var)
    synthetic = venv.obs_rms.mean + std * rng.standard_normal((n, len(FEATURES)))
    synthetic[: n // 2, pinned_mask(venv.obs_rms.var)] += 1.0  # pinned features far from their training values: still agree
    batch = synthetic if obs is None or len(obs) == 0 else np.concatenate([np.asarray(obs), synthetic])
    batch = batch.astype(np.float32)
    sb3_actions, _ = model.predict(venv.normalize_obs(batch), deterministic=True)
    learned = LearnedK.load(meta_path, device=device)
    ours = np.argmax(learned.logits(batch), axis=-1)
    agree = float(np.mean(ours == sb3_actions))
    if agree < 1.0:
        raise SpecPilotError(f"export check failed: the exported policy agrees with SB3 on {agree:.1%} of observations")
    return agree
