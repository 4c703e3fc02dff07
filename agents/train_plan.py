"""What the main job's configuration (`train_cli.TrainConfig`) resolves to (`Run`, `ReplayData`) and the plans made
from it alone: seeds, steps per phase, episodes per rollout, the quick settings."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from specpilot.decoding.config import parse_ints
from specpilot.decoding.drafters import reports_confidence
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hybrid import ACTION_SOURCES
from specpilot.decoding.paths import (
    profile_path,
    traces_path,
)
from specpilot.env.oracle import (
    CostModel,
    load_profile,
)
from specpilot.env.replay_env import MachineCondition

from .ppo import split_budget

if TYPE_CHECKING:
    from .train_cli import TrainConfig


QUICK_HP = {"rollout_rounds": 1, "rollout_epochs": 20, "rollout_workers": 1, "n_steps": 64, "batch_size": 32,
            "n_epochs": 2, "checkpoint_every": 64, "replay_checkpoint_every": 64, "replay_warmup_timesteps": 0,
            "replay_timesteps": 512, "value_prefit_rollouts": 1, "timesteps": 64, "background_loads": ["none"]}
"""What --quick sets over the YAML: one round of a short fit, a few small PPO rollouts (the real loop's without a load)."""
QUICK_EPISODES, QUICK_TRACES, QUICK_BATCH_SIZES = 4, 24, [1, 2]


@dataclass
class ReplayData:
    """What the replay env, the rule tuning, the warm start and the deferral read: loaded once per run."""

    traces: list
    """The train split's acceptance traces (never the test split's), as recorded: the replay env's."""
    budget_traces: list
    """The same cut to the episode budget: what the rule tuning, the warm start and the deferral score."""
    cost: CostModel
    profile: dict
    profile_file: Path
    hardware: np.ndarray
    """The counters as recorded with the profile (else read live now)."""
    conditions: list[MachineCondition]
    """The machine conditions of --condition-profiles, after the profile's own ([] without them)."""
    holdout: list = field(default_factory=list)
    """The held-out train prompts' traces, cut to the budget (`select_holdout`): what picks the phase to export."""


@dataclass
class Run:
    """One training run, resolved once from its config: device, hyperparameters, prompts, models, folders."""

    cfg: TrainConfig
    device_key: str
    hardware_name: str
    torch_device: str
    simulated: dict | None
    """The --profile when it is a simulated one (replay only, the models on the CPU), else None."""
    hp: dict
    seeds: list[int]
    batch_sizes: list[int]
    real_batch_sizes: list[int]
    train_prompts: list
    test_prompts: list
    target: object
    draft: object
    real_prompts: list
    """The train prompts that fit the target's window with an episode's budget to spare."""
    mode: str
    """real | replay | both."""
    out: Path
    """OUT/DEVICE/DRAFT: the policy, its rules and its run/ folder."""
    loads: list[str]
    """The background loads the real-loop episodes draw from."""
    condition_profiles: list[str]
    """The cost profiles of the replay env's other machine conditions (`condition_paths`)."""
    holdout_ids: set = field(default_factory=set)
    """The train prompts no phase trains on, which pick the phase whose policy is exported (agents/select.py)."""
    replay: ReplayData | None = None
    rule: object = None
    """The best engine rule per batch size tuned on the train split (`best_rule_phase`), once tuned or read."""
    fresh_inputs: bool = False
    """The chain measured the profile or traces anew (`prepare_phase`): rules tuned on the old ones are not reused."""

    @property
    def k_max(self) -> int:
        return int(self.hp["k_max"])

    @property
    def budget(self) -> int:
        return int(self.hp["max_new_tokens"])

    @property
    def stop_levels(self) -> list[float]:
        """The stop levels the actions pair with k (YAML `stop_levels`; `decoding.policies.ActionTable`) for a draft
        that reports its confidence; prompt lookup's is always 1, so its actions are k alone."""
        if not reports_confidence(self.draft):
            return [0.0]
        key = "hybrid_stop_levels" if self.sources != (None,) else "stop_levels"
        return [float(v) for v in self.hp.get(key) or [0.0]]

    @property
    def sources(self) -> tuple:
        """The draft sources the actions choose among (`decoding.hybrid.ACTION_SOURCES`) for the hybrid drafter; a
        single drafter's actions name none."""
        return ACTION_SOURCES if getattr(self.draft, "name", None) == "hybrid" else (None,)

    @property
    def run_dir(self) -> Path:
        return self.out / "run"


def default_paths(cfg: TrainConfig, device_key: str, draft_name: str, target_name: str | None) -> tuple[Path, Path]:
    """(cost profile, traces) of this device and (target, draft) pair: --profile / --traces, else their default paths."""
    return (Path(cfg.profile) if cfg.profile else profile_path(device_key, draft_name, target_name),
            Path(cfg.traces) if cfg.traces else traces_path(draft_name, target=target_name))


def simulated_profile(cfg: TrainConfig) -> dict | None:
    """The --profile when it is a simulated one (and --allow-simulated says so), else None."""
    if not cfg.profile:
        return None
    profile = load_profile(cfg.profile)
    if not profile.get("simulated"):
        return None
    if not cfg.allow_simulated:
        raise SpecPilotError(f"{cfg.profile} is a SIMULATED profile; pass --allow-simulated to train on it (replay env only)")
    if cfg.env not in ("auto", "replay"):
        raise SpecPilotError(f"a simulated profile trains on the replay env only, not --env {cfg.env}")
    if cfg.device not in ("auto", profile["device"]):
        raise SpecPilotError(f"{cfg.profile} simulates '{profile['device']}', not --device {cfg.device}")
    return profile


def env_mode(cfg: TrainConfig, device_key: str, draft_name: str, target_name: str | None) -> str:
    if cfg.env not in ("auto", "real", "replay", "both"):
        raise SpecPilotError(f"--env must be auto, real, replay or both, got '{cfg.env}'")
    if cfg.env != "auto":
        return cfg.env
    profile, traces = default_paths(cfg, device_key, draft_name, target_name)
    return "both" if profile.exists() and traces.exists() else "real"


def rollout_episodes(hp: dict, batch_sizes: list[int]) -> dict[int, int]:
    """{batch size: labelled episodes} from the YAML's `rollout_episodes` (an int for every batch size, or
    {batch size: episodes}; a batch size it does not name gets none)."""
    episodes = hp["rollout_episodes"]
    return {int(b): int(episodes.get(b, episodes.get(str(b), 0)) if isinstance(episodes, dict) else episodes)
            for b in batch_sizes}


def train_seeds(cfg: TrainConfig, hp: dict) -> list[int]:
    """The seeds to train: --seeds, else --seed, else the YAML's `seeds`, else [0]."""
    if cfg.seeds and cfg.seed is not None:
        raise SpecPilotError("pass --seed (one policy) or --seeds (an ensemble), not both")
    if cfg.seeds:
        seeds = parse_ints(cfg.seeds, "--seeds", minimum=0)
    elif cfg.seed is not None:
        seeds = [cfg.seed]
    else:
        seeds = [int(x) for x in hp.get("seeds") or [0]]
    if len(set(seeds)) != len(seeds):
        raise SpecPilotError(f"--seeds repeats a seed: {seeds}")
    return seeds


def plan_steps(cfg: TrainConfig, hp: dict, mode: str) -> dict[str, int]:
    """{phase: PPO env steps} for this run's phases, before rounding to whole rollouts (agents.ppo.fit_rollouts).

    The YAML gives each phase's steps; --timesteps replaces them by a total split in their proportions,
    after the phases set explicitly (--warmup-timesteps, --replay-timesteps) are taken out of it."""
    replay = mode in ("replay", "both")
    yaml_steps = {"replay-warmup": int(hp.get("replay_warmup_timesteps") or 0) if replay else 0,
                  "replay": int(hp["replay_timesteps"]) if replay else 0,
                  "real": int(hp["timesteps"]) if mode in ("real", "both") else 0}
    explicit = {"replay-warmup": cfg.warmup_timesteps, "replay": cfg.replay_timesteps}
    for name, value in explicit.items():
        if value < -1:
            raise SpecPilotError(f"--{'warmup' if name == 'replay-warmup' else 'replay'}-timesteps is >= 0 (or -1), got {value}")
        if value >= 0 and not replay:
            raise SpecPilotError(f"--{'warmup' if name == 'replay-warmup' else 'replay'}-timesteps needs a replay "
                                 f"phase, and --env {mode} has none")
    if cfg.timesteps < 0:
        raise SpecPilotError(f"--timesteps is >= 0, got {cfg.timesteps}")
    present = (["replay-warmup", "replay"] if replay else []) + (["real"] if mode in ("real", "both") else [])
    steps = {n: (explicit[n] if explicit.get(n, -1) >= 0 else s) for n, s in yaml_steps.items()}
    if cfg.timesteps:
        fixed = sum(v for v in explicit.values() if v >= 0)
        free = [n for n in present if explicit.get(n, -1) < 0]
        if fixed > cfg.timesteps or (not free and fixed < cfg.timesteps):
            raise SpecPilotError(f"--timesteps {cfg.timesteps} does not match the phases set explicitly ({fixed} steps)")
        for name, part in zip(free, split_budget(cfg.timesteps - fixed, [yaml_steps[n] for n in free])):
            steps[name] = part
    return steps


def apply_quick(cfg: TrainConfig, hp: dict) -> None:
    """--quick: the whole chain at a toy size (about a minute on 2 cores): one seed, batch sizes 1 and 2, one short
    round of the warm start on a few episodes, rules tuned on a few traces, a two-prompt evaluation of 16 tokens."""
    hp.update(QUICK_HP)
    hp["seeds"] = [int((hp.get("seeds") or [0])[0])]
    hp["batch_sizes"] = [b for b in hp.get("batch_sizes") or [1] if b in QUICK_BATCH_SIZES] or [1]
    hp["real_batch_sizes"] = [1]
    hp["rollout_episodes"] = {b: QUICK_EPISODES for b in hp["batch_sizes"]}
    cfg.eval_max_new_tokens = min(cfg.eval_max_new_tokens, 16)


# --- the phases of a run, in order; each a function of what the ones before it made ---------------------------
