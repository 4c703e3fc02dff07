"""PPO per device (stable-baselines3): hyperparameters, tracking, checkpoints, resume."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import is_cpu_key
from specpilot.decoding.learned import pinned_mask
from specpilot.decoding.tracking import start_tracking

HYPERPARAMS = Path(__file__).with_name("hyperparams.yaml")
PPO_KEYS = ("n_steps", "batch_size", "n_epochs", "learning_rate", "gamma", "gae_lambda", "clip_range", "ent_coef", "vf_coef")


def load_hyperparams(device: str, overrides: list[str] | dict | None = None, path: str | Path = HYPERPARAMS) -> dict:
    """The `default` block, then the device's block (a CPU machine key reads the `cpu` block, then its own block
    if the YAML has one), then KEY=VALUE overrides (values parsed as YAML)."""
    data = yaml.safe_load(Path(path).read_text())
    hp = dict(data["default"])
    if is_cpu_key(device) and device != "cpu":
        hp.update(data.get("cpu") or {})
    hp.update(data.get(device) or {})
    if isinstance(overrides, dict):
        items = overrides.items()
    else:
        items = []
        for text in overrides or []:
            key, sep, value = text.partition("=")
            if not sep:
                raise SpecPilotError(f"--hp expects KEY=VALUE, got '{text}'")
            items.append((key.strip(), yaml.safe_load(value)))
    for key, value in items:
        if key not in hp:
            raise SpecPilotError(f"unknown hyperparameter '{key}'; known: {', '.join(sorted(hp))}")
        hp[key] = value
    return hp


class PinnedVecNormalize(VecNormalize):
    """VecNormalize that holds a feature which barely varied in training at its mean (z = 0).

    The policy cannot learn what a feature means if it hardly moved in training (a hardware counter
    fixed in the replay env, an n-gram drafter's ~0 ms draft cost): its weights stay at their random
    initialisation, and at inference a small real deviation, divided by a ~0 standard deviation, hits
    the clip (10) and swings the decision. Found on the CPU policy, whose k at B = 4 differed between
    the real loop and the replay of the same prompts for that reason alone. Features whose running
    standard deviation is below `decoding.learned.MIN_FEATURE_STD` are therefore pinned; `LearnedK`
    applies the same rule to the exported statistics (the export also lists them, for reading)."""

    def _normalize_obs(self, obs: np.ndarray, obs_rms) -> np.ndarray:
        return np.where(pinned_mask(obs_rms.var), 0.0, super()._normalize_obs(obs, obs_rms))


def load_vecnormalize(path: str | Path, venv) -> PinnedVecNormalize:
    """A saved VecNormalize (a checkpoint's), with pinning (one saved before pinning existed gains it)."""
    loaded = VecNormalize.load(str(path), venv)
    loaded.__class__ = PinnedVecNormalize
    return loaded


class EnvFns(list):
    """The env factories of one phase, one per env: run in this process (`subprocess` False: envs that share
    a model already loaded here) or one process each (SB3 SubprocVecEnv: replay envs on N cores, real envs
    one per GPU)."""

    def __init__(self, fns, subprocess: bool = False):
        super().__init__(fns)
        self.subprocess = subprocess


def _monitored(env_fn):
    return lambda: Monitor(env_fn())


def make_vec_env(env_fns, seed: int):
    """A normalised vector env of the factories (one callable = one env in this process)."""
    fns = env_fns if isinstance(env_fns, EnvFns) else EnvFns([env_fns])
    wrapped = [_monitored(fn) for fn in fns]
    if fns.subprocess and len(fns) > 1:
        from stable_baselines3.common.vec_env import SubprocVecEnv  # spawns processes: only when asked

        venv = SubprocVecEnv(wrapped, start_method="fork")
    else:
        venv = DummyVecEnv(wrapped)
    venv.seed(seed)
    return PinnedVecNormalize(venv, norm_obs=True, norm_reward=False, clip_obs=10.0, gamma=1.0)


def n_envs_of(env_fns) -> int:
    return len(env_fns) if isinstance(env_fns, EnvFns) else 1


def make_ppo(venv, hp: dict, seed: int, tensorboard_log: str | None):
    activation = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[hp["activation"]]
    return PPO(
        "MlpPolicy", venv, seed=seed, verbose=0, tensorboard_log=tensorboard_log, device="cpu",
        policy_kwargs={"net_arch": list(hp["net_arch"]), "activation_fn": activation},
        **{k: hp[k] for k in PPO_KEYS},
    )


def warm_start(model, venv, layers: list[tuple[np.ndarray, np.ndarray]], norm: dict) -> None:
    """Copy an MLP's (W, b) layers into the PPO policy network and its input statistics into VecNormalize."""
    policy = model.policy
    targets = [m for m in policy.mlp_extractor.policy_net if isinstance(m, torch.nn.Linear)] + [policy.action_net]
    if len(targets) != len(layers) or any(t.weight.shape != tuple(w.shape) for t, (w, _) in zip(targets, layers)):
        raise SpecPilotError("the warm-start MLP's shape differs from PPO's policy network (net_arch)")
    with torch.no_grad():
        for target, (w, b) in zip(targets, layers):
            target.weight.copy_(torch.as_tensor(w))
            target.bias.copy_(torch.as_tensor(b))
    venv.obs_rms.mean = np.asarray(norm["mean"], dtype=np.float64)
    venv.obs_rms.var = np.asarray(norm["var"], dtype=np.float64)


def fit_value_to_policy(model, rollouts: int, epochs: int = 10, lr: float | None = None) -> dict:
    """Before PPO's first update from a warm start: collect `rollouts` rollouts with the policy as it is (the warm
    start) and after each fit only the value network to its returns (each rollout's GAE returns bootstrap from the
    value fitted on the ones before), so that the first advantages are measured against that policy's value, not a
    random net's. The policy network is not touched. The env steps count in the run's budget (model.num_timesteps).
    `lr`: the fit's Adam step size (default: PPO's learning rate; a fine-tuning rate such as 1e-4 hardly moves a
    random value net in two rollouts). Returns the value's explained variance of the returns on the first rollout
    before and the last one after."""
    from stable_baselines3.common.utils import explained_variance

    if rollouts < 1:
        return {}
    policy, buffer = model.policy, model.rollout_buffer
    params = list(policy.mlp_extractor.value_net.parameters()) + list(policy.value_net.parameters())
    optimizer = torch.optim.Adam(params, lr=float(model.lr_schedule(1.0) if lr is None else lr))
    _, callback = model._setup_learn(rollouts * model.n_steps * model.n_envs, None, True, "value-prefit", False)
    callback.on_training_start(locals(), globals())
    history = {}
    for _ in range(rollouts):
        model.collect_rollouts(model.env, callback, buffer, n_rollout_steps=model.n_steps)
        history.setdefault("explained_variance_before",
                           float(explained_variance(buffer.values.flatten(), buffer.returns.flatten())))
        for _ in range(epochs):
            for data in buffer.get(model.batch_size):  # (get flattens the buffer; the next rollout resets it)
                loss = torch.nn.functional.mse_loss(policy.predict_values(data.observations).flatten(), data.returns)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    with torch.no_grad():
        obs = torch.as_tensor(buffer.observations.reshape(-1, *buffer.obs_shape), dtype=torch.float32)
        fitted = policy.predict_values(obs).numpy().flatten()
    history["explained_variance_after"] = float(explained_variance(fitted, buffer.returns.flatten()))
    callback.on_training_end()
    return history


def split_budget(total: int, weights: list[float]) -> list[int]:
    """`total` env steps split in proportion to `weights` (all to the last phase when they sum to 0);
    the parts add up to `total` exactly."""
    if total < 0:
        raise SpecPilotError(f"a step budget is >= 0, got {total}")
    weights = [max(0.0, float(w)) for w in weights]
    if not weights:
        return []
    if sum(weights) == 0:
        weights = [0.0] * (len(weights) - 1) + [1.0]
    parts = [int(total * w / sum(weights)) for w in weights]
    last = max(i for i, w in enumerate(weights) if w > 0)
    parts[last] += total - sum(parts)
    return parts


def fit_rollouts(steps: list[int], n_steps: int, batch_size: int, n_envs: int = 1) -> tuple[int, int, list[int]]:
    """(n_steps, batch_size, steps per phase) such that PPO runs no more than asked.

    SB3 collects whole rollouts of `n_steps` per env, n_steps * n_envs env steps, so a phase of `s` steps
    runs ceil(s / rollout) rollouts. `n_steps` is lowered until a rollout fits the smallest non-empty
    phase, each phase is cut to whole rollouts (never more than asked), and `batch_size` becomes a
    divisor of the rollout."""
    asked = [s for s in steps if s > 0]
    if not asked:
        return n_steps, batch_size, list(steps)
    n_steps = max(2, min(n_steps, min(asked) // n_envs))  # PPO's advantage normalisation needs 2 samples
    rollout = n_steps * n_envs
    batch_size = max(d for d in range(1, min(batch_size, rollout) + 1) if rollout % d == 0)
    return n_steps, batch_size, [s // rollout * rollout for s in steps]


CHECKPOINT_RE = re.compile(r"ppo_(\d+)_steps\.zip$")


def checkpoints(folder: str | Path) -> list[tuple[Path, Path, int]]:
    """(model zip, VecNormalize pickle, steps) of every checkpoint with both files, newest first."""
    found = []
    for path in Path(folder).glob("ppo_*_steps.zip"):
        match = CHECKPOINT_RE.search(path.name)
        stats = path.with_name(f"ppo_vecnormalize_{match.group(1)}_steps.pkl") if match else None
        if match and stats.exists():
            found.append((path, stats, int(match.group(1))))
    return sorted(found, key=lambda c: -c[2])


def latest_checkpoint(folder: str | Path) -> tuple[Path, Path, int] | None:
    """(model zip, VecNormalize pickle, steps) of the newest checkpoint with both files, if any."""
    found = checkpoints(folder)
    return found[0] if found else None


def load_checkpoint(folder: str | Path, env_fn, seed: int, log=print):
    """(model, venv, steps) of the newest checkpoint that loads; a torn one (a kill while it was written,
    before checkpoints were atomic) is skipped with a message. None when none loads."""
    for model_path, stats_path, steps in checkpoints(folder):
        try:
            venv = load_vecnormalize(stats_path, make_vec_env(env_fn, seed).venv)
            model = PPO.load(str(model_path), env=venv, device="cpu")
        except Exception as exc:  # a truncated zip or pickle raises whatever its reader raises
            log(f"specpilot: checkpoint {model_path.name} does not load ({type(exc).__name__}); trying an older one")
            continue
        log(f"specpilot: resuming from {model_path.name} ({steps:,} steps)")
        return model, venv, steps
    return None


class AtomicCheckpoint(BaseCallback):
    """Every `every` env steps (all envs together): the VecNormalize statistics, then the model, each
    written to a temporary file and renamed into place, so a kill leaves the previous checkpoints whole
    and loses at most one interval."""

    def __init__(self, every: int, folder: str | Path):
        super().__init__()
        self.every, self.folder = int(every), Path(folder)

    def _on_step(self) -> bool:
        if self.every > 0 and self.num_timesteps % self.every < self.training_env.num_envs:
            steps = self.num_timesteps
            stats = self.folder / f"ppo_vecnormalize_{steps}_steps.pkl"
            vecnorm = self.model.get_vec_normalize_env()
            if vecnorm is not None:
                vecnorm.save(str(stats) + ".tmp")
                os.replace(str(stats) + ".tmp", stats)
            tmp = self.folder / f".ppo_{steps}_steps.tmp.zip"
            self.model.save(str(tmp))
            os.replace(tmp, self.folder / f"ppo_{steps}_steps.zip")
        return True


class SpecMetricsCallback(BaseCallback):
    """Logs speculative-decoding metrics (per step and per episode) to the SB3 logger (and so to W&B)."""

    def __init__(self, every: int = 64):
        super().__init__()
        self.every = every
        self.window: list[dict] = []

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            self.window.append(info)
            episode = info.get("spec_episode")
            if episode:
                for key in ("tokens_per_s", "speedup", "mean_k", "accept_rate"):
                    self.logger.record_mean(f"episode/{key}", episode[key])
                self.logger.record_mean(f"speedup_by_category/{episode['category']}", episode["speedup"])
        if len(self.window) >= self.every:
            w = self.window
            drafted = sum(i["k"] for i in w)
            self.logger.record("spec/tokens_per_s", float(np.mean([i["tokens_per_s"] for i in w])))
            self.logger.record("spec/mean_k", drafted / len(w))
            self.logger.record("spec/accept_rate", sum(i["accepted"] for i in w) / drafted if drafted else 0.0)
            self.window = []
        return True


def train(
    phases: list[tuple[str, Callable, int, int]],
    hp: dict,
    out_dir: str | Path,
    seed: int = 0,
    resume: bool = False,
    track: bool = False,
    wandb_project: str = "specpilot",
    run_config: dict | None = None,
    progress: bool = True,
    init: tuple[list, dict] | None = None,
    on_phase_end: Callable | None = None,
):
    """Train (or continue) one PPO model through phases of (name, env_fn, env steps, checkpoint every).

    E.g. [("replay-warmup", ..., 300000, 50000), ("replay", ..., 50000, 10000), ("real", ..., 2048, 512)]:
    pre-train on the replay env (first on one batch size), then fine-tune on the real loop; the observation
    normalisation carries over, learned through the replay phases and frozen for the real one. Checkpoints go to
    out_dir/checkpoints; with `resume` the newest one is loaded and training continues in its phase.
    `init` = (layers, normalisation) of a warm-start MLP (agents.improve): a fresh model starts from its
    weights and its observation statistics, which then stay frozen (the weights were fitted to them).
    `on_phase_end(name, model, venv)` runs when a phase has taken its steps (not for a phase a resumed run skips).
    Returns (model, venv of the last phase).
    """
    n_envs = {n_envs_of(p[1]) for p in phases}
    if len(n_envs) > 1:
        raise SpecPilotError(f"every phase needs the same number of envs (SB3 keeps it per model), got {sorted(n_envs)}")
    n_envs = n_envs.pop() if n_envs else 1
    n_steps, batch_size, fitted = fit_rollouts([p[2] for p in phases], int(hp["n_steps"]), int(hp["batch_size"]), n_envs)
    hp = {**hp, "n_steps": n_steps, "batch_size": batch_size}  # whole rollouts: no phase runs more than asked
    rollout = n_steps * n_envs
    phases = [(name, fn, s, max(rollout, int(every) // rollout * rollout))  # checkpoints at rollout ends
              for (name, fn, _, every), s in zip(phases, fitted)]
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if resume and not checkpoints(ckpt_dir):  # killed before its first checkpoint, or a chain whose PPO starts now
        print(f"specpilot: --resume: no checkpoint in {ckpt_dir} yet: PPO starts from its first step", file=sys.stderr)
        resume = False
    found = None
    run_id_file = out_dir / "wandb_run_id"
    resume_id = run_id_file.read_text().strip() if resume and run_id_file.exists() else None
    run = start_tracking(track, wandb_project, out_dir, {**(run_config or {}), **hp}, resume_id)
    if run is not None:
        run_id_file.write_text(run.id)
    tb_log = str(out_dir / "tensorboard")
    model, venv, done = None, None, 0
    if resume:  # the newest checkpoint that loads (its env is replaced by its phase's below)
        found = load_checkpoint(ckpt_dir, phases[0][1], seed, log=lambda m: print(m, file=sys.stderr))
        if found is None:
            raise SpecPilotError(f"--resume: no checkpoint in {ckpt_dir} loads")
    try:
        for phase, (name, env_fn, steps, every) in enumerate(phases):
            end = done + steps
            if found and found[2] >= end:  # this phase finished before the checkpoint
                done = end
                continue
            fresh = make_vec_env(env_fn, seed)
            if model is None and found:
                model, venv = found[0], found[1]
                model.tensorboard_log = tb_log
                fresh.obs_rms = venv.obs_rms
                venv.close()  # the env it was loaded with (its processes, if any)
                venv = fresh
                model.set_env(venv)
            elif model is None:
                venv = fresh
                model = make_ppo(venv, hp, seed, tb_log)
                if init is not None:
                    warm_start(model, venv, *init)
                    venv.training = False  # the warm start's statistics stay (as below), also while the value fits
                    prefit = fit_value_to_policy(model, int(hp.get("value_prefit_rollouts") or 0),
                                                 lr=hp.get("value_prefit_lr"))
                    if prefit:
                        print(f"specpilot: value net fitted to the warm start's returns: explained variance "
                              f"{prefit['explained_variance_before']:.2f} -> {prefit['explained_variance_after']:.2f}",
                              file=sys.stderr)
            else:  # next phase: same policy and observation statistics, new env
                fresh.obs_rms = venv.obs_rms
                venv.close()
                venv = fresh
                model.set_env(venv)
            # the normalisation is learned in the first phase and the replay phases after it, and frozen for
            # the real-loop fine-tune: it sees the inputs its pre-trained weights were trained on (and the
            # pinned features stay pinned). A replay warm-up on one batch size has seen no other: the next
            # replay phase goes on learning it (the batch-size feature, pinned until then, comes alive)
            venv.training = init is None and (phase == 0 or name.startswith("replay"))
            callbacks = [AtomicCheckpoint(every, ckpt_dir), SpecMetricsCallback()]
            if run is not None:
                # slow to import: only when tracking
                from wandb.integration.sb3 import WandbCallback

                callbacks.append(WandbCallback(verbose=0))
            remaining = end - model.num_timesteps
            if remaining > 0:
                model.learn(total_timesteps=remaining, callback=CallbackList(callbacks), progress_bar=progress,
                            reset_num_timesteps=model.num_timesteps == 0, tb_log_name="ppo")
            if on_phase_end is not None:
                on_phase_end(name, model, venv)
            done = end
    finally:
        if run is not None:
            run.finish()
    if model is None:  # resumed after the last phase had finished: its final checkpoint
        model, venv = found[0], found[1]
    model.save(str(out_dir / "final_model.zip"))
    venv.save(str(out_dir / "final_vecnormalize.pkl"))
    return model, venv
