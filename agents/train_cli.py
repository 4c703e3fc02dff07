"""The main job: `python scripts/train_policy.py --device cpu` trains, exports and evaluates a policy."""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from specpilot.bench.batch_table import BatchContextTableK
from specpilot.bench.benchmark import format_table, run_benchmark, summarize
from specpilot.bench.paired_cli import paired_ratios
from specpilot.bench.tune_cli import rules_policy, tune_rules
from specpilot.decoding.config import at_least, parse_config, parse_ints, warn
from specpilot.decoding.drafters import reports_confidence
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import gpu_names, resolve, shared_monitor
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.paths import (
    atomic_write_text,
    output_dir,
    load_profile_path,
    policy_dir,
    profile_path,
    read_json_file,
    relative,
    traces_path,
)
from specpilot.decoding.policies import (
    HeuristicK,
    NoSpeculation,
    StaticK,
    at_or_below,
)
from specpilot.decoding.prompts import load_prompts, per_category
from specpilot.decoding.tracking import log_rows
from specpilot.env import PlainSpeed, ReplayEnv, SpecDecodeEnv, measure_plain_speed
from specpilot.env.oracle import (
    CostModel,
    load_draft_traces,
    load_profile,
    model_identity,
    profile_hardware,
    trace_dtype,
    truncate,
)
from specpilot.env.load import background_load
from specpilot.env.replay_env import MachineCondition, replay_steps_per_second

from .ensemble import merge_policies
from .defer import defer_table, describe, write_defer
from .export import export_policy, provenance_of, write_policy
from .improve import improve_policy
from .select import batch_choice, held_out, selection_scores
from .ppo import EnvFns, fit_rollouts, load_hyperparams, split_budget, train


@dataclass
class TrainConfig:
    """Train a PPO draft-length policy for this device on the real decode loop, export and evaluate it."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (the first visible GPU of that kind; must be present)."""
    timesteps: int = 0
    """PPO env steps of the run, and nothing else: split over its PPO phases (replay warm-up, replay, real loop) in
    the proportions of agents/hyperparams.yaml (all to the last where the YAML gives none); 0 = the YAML's own steps. The rule
    tuning and the warm start are not PPO steps (see --quick). The run prints its plan first and never runs more
    PPO steps than asked."""
    quick: bool = False
    """A quick try of the whole chain in about a minute: one seed, batch sizes 1-2, one short warm-start round,
    rules tuned on a few traces, short PPO phases (the real loop's without a load), two test prompts; written under
    runs/quick (or --out), never over a policy. A device or pair without its cost profile and traces measures them
    first (--env auto): minutes more."""
    replay_timesteps: int = -1
    """Steps of the replay phase, taken out of --timesteps (-1 = its share of it, or the YAML's)."""
    warmup_timesteps: int = -1
    """Steps of the replay warm-up phase, taken out of --timesteps (-1 = its share, or the YAML's)."""
    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct, offline), a hub id, a folder or a .gguf file."""
    draft: str = "ngram"
    """Drafter: ngram | ngram:N | self:bf16 | MODEL_ID_OR_PATH."""
    env: str = "auto"
    """real | replay | both (pre-train on the replay env, fine-tune on the real loop) | auto (both, after measuring
    here the cost profile and the train split's traces this device and (target, draft) pair lack: `prepare_phase`)."""
    profile: str | None = None
    """Cost profile for the replay env (default: profiles/DEVICE.json, from scripts/profile_device.py)."""
    traces: str | None = None
    """Acceptance traces for the replay env (default: profiles/traces-DRAFT.json)."""
    prompts: str | None = None
    """Prompt JSONL (default: the project's set); its train split trains, its test split evaluates."""
    track: bool = True
    """Track the run with W&B (online with WANDB_API_KEY, else offline; sync later with `wandb sync`)."""
    wandb_project: str = "specpilot"
    """W&B project name."""
    seed: int | None = None
    """Seed of the warm start, of PPO and of the env's prompt choice: one policy (default: the YAML's `seeds`)."""
    seeds: str = ""
    """Comma-separated seeds: one policy per seed (OUT/DEVICE/DRAFT/seeds/seed-N/), merged into one whose logits
    are their mean (agents/ensemble.py); default: the YAML's `seeds` (CPU: 2,1, the committed policy's recipe), else 0."""
    resume: bool = False
    """Continue a killed run from its last checkpoint in OUT/DEVICE/run/checkpoints."""
    out: str = ""
    """Root folder: the policy goes to OUT/DEVICE/DRAFT/policy.{json,safetensors}, the run to OUT/DEVICE/DRAFT/run/
    (default: policies/ in the working directory when it has one, as a source checkout does, else the user folder
    $SPECPILOT_HOME/policies or ~/.local/share/specpilot/policies)."""
    batch_sizes: str = ""
    """Comma-separated batch sizes episodes draw from, e.g. 1,2,4,8,16 (default: the YAML's batch_sizes)."""
    hp: list[str] = field(default_factory=list)
    """Hyperparameter override KEY=VALUE (repeatable), e.g. --hp n_steps=128."""
    eval_per_category: int = 1
    """Held-out (test split) prompts per category for the final evaluation (0 = skip it)."""
    eval_max_new_tokens: int = 48
    """Tokens per prompt in the final evaluation."""
    eval_repeats: int = 3
    """Paired repeats of the final evaluation (policies interleaved; learned / best-rule gets a t interval)."""
    dtype: str = "auto"
    """Model dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16."""
    progress: bool = True
    """Show progress bars."""
    allow_simulated: bool = False
    """Train for a chip from a simulated cost profile (--profile PATH from profile_device.py --simulate): replay
    env only, no GPU needed, the device need not be present; the exported policy records it."""
    condition_profiles: str | None = None
    """Comma-separated cost profiles of the same device under other machine conditions (a power cap, a
    co-tenant, a background load: profile_device.py --simulate D --condition C, or --background-load L), each
    with the counters as read under it: replay episodes draw the condition (the --profile one included), so
    the counters carry what the policy needs to know about the machine. Default: the YAML's `condition_loads`,
    the profiles profile_device.py --background-load L wrote for this device and draft (profiles/load/); '' = none."""
    hardware_noise: float = 0.02
    """With --condition-profiles: each replay episode reads every counter off by this standard deviation."""
    background_load: str | None = None
    """Comma-separated background loads the real-loop env draws from per episode (env/load.py: none | compute
    | memory | both), started and stopped by the env (never left running, not even when the run is killed);
    the reward prices plain decoding by its speed measured under the same load. Default: the YAML's
    `background_loads` (CPU: none,compute,memory)."""
    profiles_out: str = ""
    """Where --env auto writes a cost profile or traces this device and pair lack (default: profiles/ in the working
    directory when it has one, else the user folder, where later runs find them)."""
    n_envs: int = 1
    """Envs PPO steps at once: replay envs in N processes (one core each); real-loop envs one per visible GPU
    (each process loads the target on its GPU), or on the CPU N envs sharing this process's model."""


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
        return [float(v) for v in self.hp.get("stop_levels") or [0.0]]

    @property
    def run_dir(self) -> Path:
        return self.out / "run"


def _default_paths(cfg: TrainConfig, device_key: str, draft_name: str, target_name: str | None) -> tuple[Path, Path]:
    """(cost profile, traces) of this device and (target, draft) pair: --profile / --traces, else their default paths."""
    return (Path(cfg.profile) if cfg.profile else profile_path(device_key, draft_name, target_name),
            Path(cfg.traces) if cfg.traces else traces_path(draft_name, target=target_name))


def _simulated_profile(cfg: TrainConfig) -> dict | None:
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


def _env_mode(cfg: TrainConfig, device_key: str, draft_name: str, target_name: str | None) -> str:
    if cfg.env not in ("auto", "real", "replay", "both"):
        raise SpecPilotError(f"--env must be auto, real, replay or both, got '{cfg.env}'")
    if cfg.env != "auto":
        return cfg.env
    profile, traces = _default_paths(cfg, device_key, draft_name, target_name)
    return "both" if profile.exists() and traces.exists() else "real"


def condition_paths(cfg: TrainConfig, hp: dict, device_key: str, draft_name: str, target_name: str | None,
                    own_profile: bool) -> list[str]:
    """--condition-profiles, else the YAML's `condition_loads` as the load profiles of this device and draft that exist
    (one line for each that does not: profile_device.py --background-load L --out profiles/load writes it). With a
    --profile the user gave (`own_profile` False) the loads are that profile's to give: none."""
    if cfg.condition_profiles is not None:
        return [p.strip() for p in cfg.condition_profiles.split(",") if p.strip()]
    if not own_profile:
        return []
    paths = []
    for load in hp.get("condition_loads") or []:
        path = load_profile_path(device_key, draft_name, str(load), target_name)
        if path.exists():
            paths.append(str(path))
        else:
            warn(f"no cost profile of {device_key} under the load '{load}' ({path}); the replay env leaves it out "
                 f"(measure it: scripts/profile_device.py --background-load {load} --out profiles/load)")
    return paths


def machine_conditions(paths: list[str], device_key: str, cost: CostModel, hardware: np.ndarray,
                       profile: dict) -> list[MachineCondition]:
    """The machine conditions of these condition profiles, after the --profile one ([] without them)."""
    if not paths:
        return []

    def name(prof: dict, default: str) -> str:
        return (prof.get("condition") or {}).get("name") or prof.get("background_load") or default

    conditions = [MachineCondition(name(profile, "none"), cost, hardware)]
    for path in paths:
        other = load_profile(path, device_key)
        if other.get("hardware") is None:
            raise SpecPilotError(f"condition profile {path} records no hardware counters: the policy could not tell it apart")
        if bool(other.get("simulated")) != bool(profile.get("simulated")):
            raise SpecPilotError(f"condition profile {path} and the --profile are not both measured or both simulated")
        conditions.append(MachineCondition(name(other, Path(path).stem), CostModel.from_profile(other),
                                           profile_hardware(other)))
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise SpecPilotError(f"--condition-profiles: two profiles share a condition name ({', '.join(names)})")
    return conditions


def rollout_episodes(hp: dict, batch_sizes: list[int]) -> dict[int, int]:
    """{batch size: labelled episodes} from the YAML's `rollout_episodes` (an int for every batch size, or
    {batch size: episodes}; a batch size it does not name gets none)."""
    episodes = hp["rollout_episodes"]
    return {int(b): int(episodes.get(b, episodes.get(str(b), 0)) if isinstance(episodes, dict) else episodes)
            for b in batch_sizes}


def fitting_prompts(target, prompts: list, room: int) -> list:
    """The prompts whose chat-encoded length leaves `room` tokens in the target's context window (all of them
    when the target has no window); says how many it left out, and fails when none fits."""
    window = target.context_window
    if not window:
        return prompts
    fits = [p for p in prompts if len(target.encode(p.text, chat=True)) + room <= window]
    if not fits:
        raise SpecPilotError(f"no train prompt fits the target's context window ({window} tokens) with {room} to spare")
    if len(fits) < len(prompts):
        warn(f"{len(prompts) - len(fits)} of {len(prompts)} train prompts do not fit the target's context window "
             f"({window} tokens) with {room} to spare; the real-loop env leaves them out")
    return fits


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


def _quick(cfg: TrainConfig, hp: dict) -> None:
    """--quick: the whole chain at a toy size (about a minute on 2 cores): one seed, batch sizes 1 and 2, one short
    round of the warm start on a few episodes, rules tuned on a few traces, a two-prompt evaluation of 16 tokens."""
    hp.update(QUICK_HP)
    hp["seeds"] = [int((hp.get("seeds") or [0])[0])]
    hp["batch_sizes"] = [b for b in hp.get("batch_sizes") or [1] if b in QUICK_BATCH_SIZES] or [1]
    hp["real_batch_sizes"] = [1]
    hp["rollout_episodes"] = {b: QUICK_EPISODES for b in hp["batch_sizes"]}
    cfg.eval_max_new_tokens = min(cfg.eval_max_new_tokens, 16)


# --- the phases of a run, in order; each a function of what the ones before it made ---------------------------


def stale_reason(path: Path, target, what: str, want: dict, draft=None) -> str | None:
    """Why the profile or traces at `path` are not this pair's current ones (None: they are); a draft with weights
    of its own (a trained head: `weights_id`) must be the one they were made with."""
    if not path.exists():
        return "none yet"
    meta = read_json_file(path, what)
    meta = meta.get("meta", meta) if what == "traces" else meta
    weights = getattr(draft, "weights_id", "")
    if weights and meta.get("draft_weights") != weights:
        return f"made with the draft weights {meta.get('draft_weights')}, these are {weights}"
    if model_identity(str(meta.get("target") or "")) != model_identity(target.name):
        return f"recorded with the target '{model_identity(str(meta.get('target')))}'"
    if what != "traces" and str(meta.get("target")) != target.name:  # a cost is the kernel's too; tokens are not
        return f"measured through another kernel ('{meta.get('target')}', this run: '{target.name}')"
    dtype = trace_dtype(meta)
    if dtype != str(target.dtype):
        return f"recorded in {dtype}, this run decodes in {target.dtype}"
    for key, value in want.items():
        if int(meta.get(key) or 0) < value:
            return f"{key} {meta.get(key)} < {value}"
    return None


def prepare_phase(cfg: TrainConfig, hp: dict, target, draft, device_key: str, hardware_name: str,
                  batch_sizes: list[int]) -> bool:
    """Phase 1b (--env auto): the replay env's inputs for this device and (target, draft) pair, each kept when it exists
    and is current (this target's, in this dtype, long enough), else measured here: the cost profile at the YAML's
    batch sizes, then the train split's acceptance traces (these weights, this device). True when either was measured
    (the rules are then tuned anew). A random-init target has no tokenizer, so no traces: --env real or --traces."""
    from specpilot.bench.profile_cli import ProfileConfig, write_profile, write_traces  # noqa: I001 (the measuring command)

    k_max, budget = int(hp["k_max"]), int(hp["max_new_tokens"])
    profile_file, traces_file = _default_paths(cfg, device_key, draft.name, target.name)
    out = Path(cfg.profiles_out or output_dir("profiles"))
    pcfg = ProfileConfig(device=cfg.device, target=cfg.target, draft=cfg.draft, k_max=k_max, dtype=cfg.dtype, prompts=cfg.prompts,
                         context_lens="64,256,1024,2048",
                         batch_sizes=",".join(map(str, batch_sizes)), trace_split="train", max_new_tokens=max(64, budget),
                         progress=cfg.progress, out=str(out))
    fresh, user_profile = False, cfg.profile is not None
    why = None if cfg.profile else stale_reason(profile_file, target, "cost profile", {}, draft)
    if why is None:
        print(f"specpilot: chain: cost profile kept ({relative(profile_file)})", file=sys.stderr)
    else:
        print(f"specpilot: chain: measuring the cost profile of {device_key} for this pair ({why})", file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        prompt_ids = target.encode(load_prompts(cfg.prompts)[0].text, chat=True)
        cfg.profile = str(write_profile(pcfg, target, draft, prompt_ids, parse_ints(pcfg.context_lens, "--context-lens"),
                                        device_key, hardware_name, out))
        fresh = True
    why = None if cfg.traces else stale_reason(traces_file, target, "traces", {"k_max": k_max, "max_new_tokens": budget},
                                               draft)
    if why is None:
        print(f"specpilot: chain: traces kept ({relative(traces_file)})", file=sys.stderr)
    else:
        if target.tokenizer is None:
            raise SpecPilotError(f"no traces of {target.name} with {draft.name} ({why}), and a random-init target has no "
                                 "tokenizer to record them: pass --traces, or --env real")
        print(f"specpilot: chain: recording the train split's traces of this pair ({why})", file=sys.stderr)
        cfg.traces = str(write_traces(pcfg, target, draft, out))
        fresh = True
    if cfg.condition_profiles is None and not user_profile:
        load_profiles_phase(pcfg, hp, target, draft, device_key, hardware_name, batch_sizes)
    return fresh


LOAD_PROFILE = {"context_lens": "256", "batch_sizes": (1, 4, 16), "repeats": 5}
"""How the chain measures a cost profile beside a load (as profiles/load/ was: one context length, three batch sizes)."""


def load_profiles_phase(pcfg, hp: dict, target, draft, device_key: str, hardware_name: str, batch_sizes: list[int]) -> None:
    """Phase 1c (--env auto): the cost profile beside each of the YAML's `condition_loads` that this device and pair lack
    or hold for another target, measured here with the load running (profile_device.py --background-load L --out
    profiles/load): the replay env's machine conditions, each with the counters as they read under that load."""
    from specpilot.bench.profile_cli import write_profile  # noqa: I001 (the measuring command)

    for load in hp.get("condition_loads") or []:
        path = load_profile_path(device_key, draft.name, str(load), target.name)
        why = stale_reason(path, target, "cost profile", {}, draft)
        if why is None:
            print(f"specpilot: chain: cost profile beside the load '{load}' kept ({relative(path)})", file=sys.stderr)
            continue
        print(f"specpilot: chain: measuring the cost profile of {device_key} beside the load '{load}' ({why})", file=sys.stderr)
        # (1, 4, 16) of the run's, and its smallest and largest: the replay env prices every batch size it draws
        sizes = sorted({b for b in LOAD_PROFILE["batch_sizes"] if b in batch_sizes} | {min(batch_sizes), max(batch_sizes)})
        lcfg = replace(pcfg, context_lens=LOAD_PROFILE["context_lens"], batch_sizes=",".join(map(str, sizes)),
                       repeats=LOAD_PROFILE["repeats"], background_load=str(load), out=str(Path(pcfg.out) / "load"))
        Path(lcfg.out).mkdir(parents=True, exist_ok=True)
        prompt_ids = target.encode(load_prompts(pcfg.prompts)[0].text, chat=True)
        with background_load(str(load)):
            write_profile(lcfg, target, draft, prompt_ids, parse_ints(lcfg.context_lens, "--context-lens"), device_key,
                          hardware_name, Path(lcfg.out))


def resolve_run(cfg: TrainConfig) -> Run:
    """Phase 1: the device, the hyperparameters (YAML, --hp, --quick), the prompts, the models, the output folder."""
    simulated = _simulated_profile(cfg)
    if simulated is not None:  # a chip that need not be here: replay only, the models stay on the CPU
        device_key, hardware_name, torch_device = simulated["device"], simulated["hardware_name"], "cpu"
        cfg.env, cfg.eval_per_category = "replay", 0
        print(f"specpilot: SIMULATED profile {cfg.profile}: training for {hardware_name} on the replay env only",
              file=sys.stderr)
    else:
        device = resolve(cfg.device)
        device_key, hardware_name, torch_device = device.key, device.name, device.torch
    hp = load_hyperparams(device_key, cfg.hp)
    if cfg.batch_sizes:
        hp["batch_sizes"] = parse_ints(cfg.batch_sizes, "--batch-sizes")
    if cfg.quick:
        _quick(cfg, hp)
    seeds = train_seeds(cfg, hp)
    hp.pop("seeds", None)  # each member records its own seed
    batch_sizes = [int(b) for b in hp.get("batch_sizes") or [1]]
    at_least(1, n_envs=cfg.n_envs)
    if cfg.background_load is None:
        cfg.background_load = ",".join(hp.get("background_loads") or ["none"]) if cfg.env != "replay" else "none"
    loads = [x.strip() for x in cfg.background_load.split(",") if x.strip()] or ["none"]
    if loads != ["none"] and cfg.env == "replay":
        raise SpecPilotError("--background-load runs beside the real loop; --env replay has none (use --condition-profiles)")
    train_prompts = load_prompts(cfg.prompts, "train")
    test_prompts = load_prompts(cfg.prompts, "test") if cfg.eval_per_category else []
    print(f"specpilot: training for device '{device_key}' ({hardware_name}), torch device {torch_device}", file=sys.stderr)
    target = load_target(cfg.target, cfg.dtype, torch_device)
    draft = load_draft(cfg.draft, target, cfg.dtype)
    seen = getattr(draft, "distilled_on", None)  # a trained head: never tune on the prompts it learned from
    if seen is not None:
        kept = [p for p in train_prompts if not seen(p.question_id, p.category)]
        if not kept:
            raise SpecPilotError(f"draft '{draft.name}' was distilled on every train prompt: none is left to train on")
        print(f"specpilot: {len(train_prompts) - len(kept)} of {len(train_prompts)} train prompts left out: the draft "
              "learned from them (its distillation's answers, or its synthetic generator)", file=sys.stderr)
        train_prompts = kept
    target_name = target.name if simulated is None else None  # a simulated chip replays the embedded pair's traces
    fresh, own_profile = False, cfg.profile is None
    if cfg.env == "auto" and simulated is None:
        fresh = prepare_phase(cfg, hp, target, draft, device_key, hardware_name, batch_sizes)
    mode = _env_mode(cfg, device_key, draft.name, target_name)
    k_max = int(hp["k_max"])
    holdout_ids = held_out([p.question_id for p in train_prompts], float(hp.get("select_holdout") or 0.0)) \
        if cfg.env != "real" else set()
    real_prompts = fitting_prompts(target, [p for p in train_prompts if p.question_id not in holdout_ids],
                                   int(hp["max_new_tokens"]) + k_max + 1)
    root = cfg.out or (output_dir("policies").parent / "runs" / "quick" if cfg.quick else output_dir("policies"))
    out = policy_dir(device_key, draft.name, root, target_name)
    (out / "run").mkdir(parents=True, exist_ok=True)
    return Run(cfg, device_key, hardware_name, torch_device, simulated, hp, seeds, batch_sizes,
               [int(b) for b in hp.get("real_batch_sizes") or batch_sizes], train_prompts, test_prompts, target, draft,
               real_prompts, mode, out, loads, condition_paths(cfg, hp, device_key, draft.name, target_name, own_profile) if mode != "real" else [],
               holdout_ids, fresh_inputs=fresh)


def load_replay_data(run: Run) -> ReplayData:
    """Phase 2 (replay modes): the cost profile, the train split's traces and the machine conditions, read once."""
    profile_file, traces_file = _default_paths(run.cfg, run.device_key, run.draft.name,
                                               run.target.name if run.simulated is None else None)
    profile = load_profile(profile_file, run.device_key)
    # acceptance belongs to the (target, draft) pair: another pair's traces are refused (a simulated chip replays
    # the embedded pair's, by design)
    traces, _ = load_draft_traces(traces_file, run.draft.name, target_name=None if run.simulated else run.target.name)
    train_ids = {p.question_id for p in run.train_prompts} - run.holdout_ids
    holdout = [truncate(t, run.budget) for t in traces if t.question_id in run.holdout_ids]
    traces = [t for t in traces if t.question_id in train_ids]  # never the test split, nor the held-out train prompts
    if not traces:
        raise SpecPilotError(f"traces {traces_file} hold none of the training prompts")
    hardware = profile_hardware(profile)
    if hardware is None:  # the counters as seen while decoding on this device: recorded with the profile, else live
        hardware = np.asarray(shared_monitor(run.torch_device).read(), dtype=np.float32)
    cost = CostModel.from_profile(profile)
    conditions = machine_conditions(run.condition_profiles, run.device_key, cost, hardware, profile)
    return ReplayData(traces, [truncate(t, run.budget) for t in traces], cost, profile, profile_file, hardware,
                      conditions, holdout)


def best_rule_phase(run: Run):
    """Phase 3 (replay modes): the best engine rule per batch size tuned on the train split, read from OUT/rules.json
    or tuned now and written there (--quick: on its first few traces)."""
    if run.rule is not None:
        return run.rule
    data = run.replay
    rules_file = run.out / "rules.json"
    if rules_file.exists() and not run.fresh_inputs:
        rules = read_json_file(rules_file, "tuned rules", keys=("best_rule",))
    else:
        traces = data.budget_traces[:QUICK_TRACES] if run.cfg.quick else data.budget_traces
        print(f"specpilot: tuning the engine rules on {len(traces)} train-split traces first ({rules_file})", file=sys.stderr)
        rules = tune_rules(traces, data.profile, run.draft.name, run.k_max, data.hardware, run.batch_sizes, run.budget,
                           run.cfg.progress)
        rules = {"device": run.device_key, "draft": run.draft.name, "split": "train", "traces": len(traces),
                 "profile": relative(data.profile_file), "max_new_tokens": run.budget, "k_max": run.k_max, **rules}
        atomic_write_text(rules_file, json.dumps(rules, indent=1) + "\n")
    run.rule = rules_policy(rules["best_rule"], data.profile, data.budget_traces, run.k_max, run.draft.name)
    return run.rule


def plain_speed_phase(run: Run) -> dict[str, PlainSpeed] | None:
    """Phase 4 (real-loop modes): plain decoding's measured speed beside each background load of the real-loop
    episodes, which the real env's reward prices steps by (run/plain_speed.json without a load,
    run/plain_speed-load-L.json beside load L; measured once for every seed, reused on --resume)."""
    if run.mode == "replay":
        return None
    speeds = {}
    for load in run.loads:
        path = run.run_dir / ("plain_speed.json" if load == "none" else f"plain_speed-load-{load}.json")
        if run.cfg.resume and path.exists():
            speeds[load] = PlainSpeed.load(path)
            continue
        print(f"specpilot: timing plain decoding beside the load '{load}' (the real-loop reward's price)", file=sys.stderr)
        with background_load(load):
            speeds[load] = measure_plain_speed(run.target, run.target.encode(run.real_prompts[0].text, chat=True),
                                               batch_sizes=run.real_batch_sizes)
        speeds[load].save(path)
    return speeds


def _real_env_fns(run: Run, plain_speeds: dict[str, PlainSpeed]) -> EnvFns:
    cfg, hp = run.cfg, run.hp
    kwargs = dict(k_max=run.k_max, max_new_tokens=run.budget, plain_speeds=plain_speeds, reward=str(hp["reward"]),
                  batch_sizes=run.real_batch_sizes, loads=run.loads, stop_levels=run.stop_levels)
    gpus = gpu_names() if run.torch_device.startswith("cuda") else []
    if cfg.n_envs == 1 or not gpus:  # one process: the envs share the model loaded already
        return EnvFns([lambda: SpecDecodeEnv(run.target, run.draft, run.real_prompts, **kwargs)] * cfg.n_envs)

    def on_gpu(index: int):
        def make():  # runs in the env's own process: its own copy of the models on its own GPU
            own = load_target(cfg.target, cfg.dtype, f"cuda:{index}")
            return SpecDecodeEnv(own, load_draft(cfg.draft, own, cfg.dtype), run.real_prompts, **kwargs)
        return make

    return EnvFns([on_gpu(i % len(gpus)) for i in range(cfg.n_envs)], subprocess=True)


def _replay_env_fns(run: Run, sizes: list[int]) -> EnvFns:
    data, hp = run.replay, run.hp

    def make():
        return ReplayEnv(data.traces, data.cost, k_max=run.k_max, noise=float(data.profile.get("noise", 0.05)),
                         hardware=data.hardware, max_new_tokens=run.budget, reward=str(hp["reward"]), batch_sizes=sizes,
                         speed_jitter=float(hp["replay_speed_jitter"]),
                         context_lens=[int(c) for c in hp.get("context_lens") or []], conditions=data.conditions,
                         hardware_noise=run.cfg.hardware_noise if data.conditions else 0.0,
                         cost_jitter=float(hp.get("replay_cost_jitter") or 0.0), stop_levels=run.stop_levels)
    return EnvFns([make] * run.cfg.n_envs, subprocess=True)


def plan_phases(run: Run, plain_speed: dict[str, PlainSpeed] | None) -> tuple[list[tuple], int]:
    """Phase 5: the PPO phases [(name, env factories, steps, checkpoint every)] with steps > 0, fitted to whole
    rollouts, and the warm start's rounds; printed as the run's plan before anything trains."""
    hp, cfg = run.hp, run.cfg
    budget = plan_steps(cfg, hp, run.mode)
    phases = []
    if run.mode in ("replay", "both"):
        every = int(hp["replay_checkpoint_every"])
        if budget["replay-warmup"] > 0:  # first at these batch sizes only (CPU: one row), then at all of them
            warmup_sizes = [int(b) for b in hp.get("replay_warmup_batch_sizes") or [1]]
            phases.append(("replay-warmup", _replay_env_fns(run, warmup_sizes), budget["replay-warmup"], every))
        replay_fns = _replay_env_fns(run, run.batch_sizes)
        phases.append(("replay", replay_fns, budget["replay"], every))
        probe = replay_fns[0]()
        warn(probe.cost.outside(run.batch_sizes, max(probe.context_lens or [0])
                                + max(len(t.prompt_ids) + len(t.output_ids) for t in probe.traces)))
        print(f"specpilot: replay env runs {replay_steps_per_second(probe):,.0f} env steps/s "
              "(random actions, this process)", file=sys.stderr)
    if run.mode in ("real", "both"):
        phases.append(("real", _real_env_fns(run, plain_speed), budget["real"], int(hp["checkpoint_every"])))
    n_steps, batch_size, fitted = fit_rollouts([p[2] for p in phases], int(hp["n_steps"]), int(hp["batch_size"]),
                                               cfg.n_envs)
    hp["n_steps"], hp["batch_size"] = n_steps, batch_size
    phases = [(name, fns, steps, every) for (name, fns, _, every), steps in zip(phases, fitted)]
    warm = int(hp["rollout_rounds"]) if run.mode in ("replay", "both") else 0
    plan = ([f"warm start ({warm} round(s) of rollout improvement)"] if warm else []) + [
        f"{name} {steps:,} PPO steps" for name, _, steps, _ in phases if steps > 0]
    if any(steps > 0 for _, _, steps, _ in phases):
        plan.append(f"rollouts of {n_steps} steps" + (f" x {cfg.n_envs} envs" if cfg.n_envs > 1 else ""))
    print(f"specpilot: plan (env {run.mode}{', --quick' if cfg.quick else ''}): " + (", ".join(plan) or "nothing to train"),
          file=sys.stderr)
    return [p for p in phases if p[2] > 0], warm


def warm_start_phase(run: Run, seed: int, member_run: Path) -> tuple[tuple | None, list]:
    """Phase 6 (replay modes): rollout policy improvement from the best tuned rule (or the profile's batch x context
    table), for one seed: (layers, normalisation) for PPO to start from and the rounds' history; kept in
    member_run/warm_start.json and reused on --resume."""
    path = member_run / "warm_start.json"
    if run.cfg.resume and path.exists():
        saved = read_json_file(path, "warm-start file", keys=("layers", "normalization", "history"))
        layers = [(np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32)) for w, b in saved["layers"]]
        return (layers, saved["normalization"]), saved["history"]
    hp, data = run.hp, run.replay
    contexts = [int(c) for c in hp.get("context_lens") or []]
    if hp.get("warm_start_base", "best-rule") == "batch-context-table":  # from the profile: no rule tuning
        base = BatchContextTableK.from_profile(data.profile, data.budget_traces, run.k_max,
                                               contexts or [data.profile["context_lens"][0]])
        what = f"the batch x context table from the profile ({len(base.table)} cells)"
    else:
        base = best_rule_phase(run)
        what = f"the best tuned rule ({', '.join(f'B={b} {s}' for b, s in base.table.items())})"
    labels = str(hp.get("warm_start_labels") or "rollout")
    print(f"specpilot: warm start: {hp['rollout_rounds']} rounds of rollout policy improvement from {what}"
          + (" (one-row states labelled by the oracle's hindsight Q*)" if labels == "oracle" else ""), file=sys.stderr)
    layers, norm, history = improve_policy(
        base, data.budget_traces, data.cost, run.k_max, data.hardware, run.batch_sizes, rollout_episodes(hp, run.batch_sizes),
        run.budget, int(hp["rollout_rounds"]), list(hp["net_arch"]), str(hp["activation"]), int(hp["rollout_epochs"]),
        seed=seed, progress=run.cfg.progress, log=lambda m: print(f"specpilot: {m}", file=sys.stderr),
        context_lens=contexts, conditions=data.conditions,
        hardware_noise=run.cfg.hardware_noise if data.conditions else 0.0,
        cost_jitter=float(hp.get("replay_cost_jitter") or 0.0), workers=int(hp.get("rollout_workers") or 0),
        labels=labels, batch_weights={int(b): float(w) for b, w in (hp.get("rollout_batch_weights") or {}).items()},
        stop_levels=run.stop_levels)
    atomic_write_text(path, json.dumps({"layers": [[w.tolist(), b.tolist()] for w, b in layers], "normalization": norm,
                                        "history": history}))
    return (layers, norm), history


def train_member(run: Run, phases: list[tuple], warm: int, seed: int, member_out: Path) -> tuple[Path, str]:
    """Phase 7: one seed's policy: its warm start, its PPO phases and its export into member_out."""
    member_run = member_out / "run"
    member_run.mkdir(parents=True, exist_ok=True)
    init, warm_history = warm_start_phase(run, seed, member_run) if warm else (None, [])
    cfg, hp, simulated = run.cfg, run.hp, run.simulated
    run_config = {"device": run.device_key, "hardware_name": run.hardware_name, "target": run.target.name,
                  "draft": run.draft.name, **{k: v for k, v in asdict(cfg).items() if k != "hp"}, "seed": seed}
    provenance = {"target": run.target.name if simulated is None else simulated["target"], "draft": run.draft.name,
                  "simulated": simulated is not None, "profile": relative(cfg.profile) if cfg.profile else None,
                  "context_lens": [int(c) for c in hp.get("context_lens") or []],
                  "condition_profiles": [relative(p) for p in run.condition_profiles],
                  "conditions": [c.name for c in run.replay.conditions] if run.replay else [],
                  "background_loads": run.loads if run.mode != "replay" else [],
                  "max_new_tokens": run.budget, "batch_sizes": run.batch_sizes, "real_batch_sizes": run.real_batch_sizes,
                  "prompts": cfg.prompts or "decoding/data/prompts.jsonl (train split)", "seed": seed, "env": run.mode,
                  "hyperparams": hp, "warm_start": warm_history, "quick": cfg.quick,
                  "phases": [{"name": name, "steps": steps, **({"env": "replay", "conditions": [
                      c.name for c in run.replay.conditions] or ["none"]} if name.startswith("replay") else
                      {"env": "real", "loads": run.loads})} for name, _, steps, _ in phases]}
    if phases:
        candidates = member_run / "candidates"
        selecting = bool(run.replay is not None and run.replay.holdout)
        if selecting and init is not None:
            write_policy(candidates / "warm-start", init[0], init[1], str(hp["activation"]), run.k_max, run.device_key,
                         run.hardware_name, 0, {**provenance, "candidate": "warm-start"}, stop_levels=run.stop_levels)

        def phase_end(name: str, model, venv) -> None:
            if selecting:  # checked against SB3's actions, as every export
                export_policy(model, venv, candidates / name, run.device_key, run.hardware_name, run.k_max,
                              {**provenance, "candidate": name}, activation=str(hp["activation"]),
                              check_obs=venv.get_original_obs() if hasattr(venv, "get_original_obs") else None)

        model, venv = train(phases, hp, member_run, seed=seed, resume=cfg.resume, track=cfg.track,
                            wandb_project=cfg.wandb_project, run_config=run_config, progress=cfg.progress, init=init,
                            on_phase_end=phase_end)
        if selecting:  # every phase's policy is in candidates/ (the last one's is the final model's)
            venv.close()  # its envs' processes and background loads
            return select_phase(run, phase_candidates(candidates, phases), member_out, provenance)
        path = export_policy(model, venv, member_out, run.device_key, run.hardware_name, run.k_max, provenance,
                             check_obs=venv.get_original_obs() if hasattr(venv, "get_original_obs") else None,
                             activation=str(hp["activation"]))
        venv.close()  # its envs' processes and background loads
        return path, "checked against SB3's actions"
    if init is not None:  # the warm start alone (no PPO steps asked for)
        log_rows(cfg.track, cfg.wandb_project, member_run, {**run_config, **hp}, "warm_start", warm_history)
        return (write_policy(member_out, init[0], init[1], str(hp["activation"]), run.k_max, run.device_key,
                             run.hardware_name, 0, provenance, stop_levels=run.stop_levels),
                "the rollout-improved policy, no PPO steps")
    raise SpecPilotError("nothing to train: every phase has 0 steps and there is no warm start")


def select_phase(run: Run, found: dict[str, Path], out: Path, provenance: dict | None = None) -> tuple[Path, str]:
    """Phase 7b (with `select_holdout`): the candidates (the warm start's and each phase's policy, in training order)
    replayed on the held-out train prompts under every machine condition; at each batch size the best decides
    (agents/select.py). `provenance`: of the exported policy (None: the one-row winner's own)."""
    order = list(found)
    conditions = run.replay.conditions or [MachineCondition("none", run.replay.cost, run.replay.hardware)]
    scores = selection_scores(found, run.replay.holdout, conditions, run.k_max, run.batch_sizes, run.budget,
                              run.device_key, run.draft.name)
    choice = batch_choice(scores, order)
    base = choice[min(choice)]
    print("specpilot: selection on " + f"{len(run.replay.holdout)} held-out train prompts: "
          + ", ".join(f"{n} {v['score']:.4f}" for n, v in scores.items()) + " -> "
          + ", ".join(f"B={b} {n}" for b, n in choice.items()), file=sys.stderr)
    nets = {name: LearnedK.load(found[name], device=run.device_key, draft=run.draft.name, defer=False, replay=True)
            for name in dict.fromkeys(choice.values())}
    selection = {"held_out_prompts": sorted(t.question_id for t in run.replay.holdout), "scores": scores,
                 "chosen": base, "by_batch": {str(b): n for b, n in choice.items()}}
    meta = nets[base].meta
    if provenance is None:
        provenance = provenance_of(meta, ("defer", "defer_evidence", "selection", "candidate"))
    by_batch = ({b: (name, None, None) if name == base else (name, *network_parts(nets[name]))
                 for b, name in choice.items()} if len(nets) > 1 else None)
    path = write_policy(out, *network_parts(nets[base]), meta["activation"], run.k_max, run.device_key, run.hardware_name,
                        max(int(m.meta["training_steps"]) for m in nets.values()), {**provenance, "selection": selection},
                        by_batch=by_batch, check=lambda p: check_by_batch(p, nets, choice),
                        stop_levels=nets[base].actions.stop_levels)
    return path, ("the " + " / ".join(f"{n} (B >= {min(b for b in choice if choice[b] == n)})" for n in nets)
                  + " policy, picked per batch size on held-out train prompts")


def network_parts(policy: LearnedK) -> tuple[list, dict]:
    """(layers as (W, b) with W of shape (out, in), normalisation) of a loaded policy's own network."""
    layers = [(w.T.astype(np.float32), b.astype(np.float32)) for w, b in policy.layers]
    return layers, {k: v for k, v in policy.meta["normalization"].items() if k != "pinned"}


def check_by_batch(meta_path: Path, nets: dict[str, LearnedK], choice: dict[int, str], n: int = 256) -> None:
    """The written policy decides each selected batch size as the network chosen for it does (an error if not)."""
    written = LearnedK.load(meta_path, allow_device_mismatch=True, defer=False, replay=True)
    rng = np.random.default_rng(0)
    for b, name in choice.items():
        lo, hi, _ = nets[name].input_bounds()
        obs = lo + (np.where(np.isfinite(hi), hi, lo) - lo) * rng.random((n, len(lo)))
        obs[:, FEATURES.index("batch_size_log")] = math.log(b)
        if not np.allclose(written.logits(obs), nets[name].logits(obs), atol=1e-5):
            raise SpecPilotError(f"by-batch export check failed: at B={b} the written policy is not {name}'s")


def train_members(run: Run, phases: list[tuple], warm: int) -> tuple[Path, str]:
    """Phase 8: one policy per seed, then their mean (a member already trained is kept on --resume)."""
    if len(run.seeds) == 1:
        return train_member(run, phases, warm, run.seeds[0], run.out)  # (its phases stay in run/candidates/)
    members = []
    for number, seed in enumerate(run.seeds, 1):
        member_out = run.out / "seeds" / f"seed-{seed}"
        if run.cfg.resume and (member_out / "policy.json").exists():
            print(f"specpilot: seed {seed} ({number}/{len(run.seeds)}): kept {member_out / 'policy.json'}", file=sys.stderr)
        else:
            print(f"specpilot: seed {seed} ({number}/{len(run.seeds)})", file=sys.stderr)
            train_member(run, phases, warm, seed, member_out)
        members.append(member_out / "policy.json")
    kept = keep_phase_policies(run, [m.parent for m in members])
    if kept and run.replay is not None and run.replay.holdout:  # the phases merged over the seeds, picked per batch size
        path, how = select_phase(run, phase_candidates(run.out / "phases", phases), run.out)
        return path, how.replace(" policy,", f" policy (each the mean of {len(run.seeds)} seeds' networks),")
    merged = merge_policies(members, run.out)
    return merged, f"the mean of {len(run.seeds)} seeds' policies ({', '.join(map(str, run.seeds))}), checked against theirs"


def phase_candidates(folder: Path, phases: list[tuple]) -> dict[str, Path]:
    """{name: policy.json} of the phases' policies in folder (the warm start first, then in training order)."""
    order = ["warm-start"] + [p[0] for p in phases]
    return {name: folder / name / "policy.json" for name in order if (folder / name / "policy.json").exists()}


def keep_phase_policies(run: Run, members: list[Path]) -> list[Path]:
    """OUT/phases/NAME/policy.json: each phase's policy (the warm start, after PPO on replay, after PPO on the real loop)
    merged over the seeds as the exported one is, for the ablations of reports/ppo.md (with `select_holdout`, which
    keeps them per seed in run/candidates/)."""
    names = sorted({p.parent.name for m in members for p in (m / "run" / "candidates").glob("*/policy.json")})
    kept = []
    for name in names:
        found = [m / "run" / "candidates" / name / "policy.json" for m in members]
        if all(p.exists() for p in found):
            kept.append(merge_policies(found, run.out / "phases" / name))
    return kept


def defer_phase(run: Run, meta_path: Path) -> None:
    """Phase 9 (replay modes): hand the batch sizes where the MLP trails the tuned rule on the train-split replay
    to that rule (the policy's `defer` table)."""
    margin = run.hp.get("defer_margin")
    if run.mode not in ("replay", "both") or margin is None:
        return
    rule, data = best_rule_phase(run), run.replay
    mlp = LearnedK.load(meta_path, device=run.device_key, draft=run.draft.name, defer=False, replay=True)
    table, ratios = defer_table(mlp, rule, data.budget_traces, data.cost, run.k_max, data.hardware, run.batch_sizes, run.budget,
                                float(margin), [int(c) for c in run.hp.get("context_lens") or []])  # where it trained
    write_defer(meta_path, table, ratios, float(margin))
    print(f"specpilot: the tuned rule's batch sizes (train-split replay): {describe(table, ratios)}", file=sys.stderr)


def evaluate_phase(run: Run, learned: LearnedK) -> None:
    """Phase 10: the exported policy beside plain decoding and the rule it has to beat (the best tuned rule; without a
    replay phase, static k and the heuristic) on held-out (test split) prompts, interleaved, in paired repeats:
    learned / that rule with its 95% interval; identical policies named once. run/eval.json and a W&B table."""
    cfg = run.cfg
    at_least(1, eval_repeats=cfg.eval_repeats)
    held_out = per_category(run.test_prompts, cfg.eval_per_category)[: 2 if cfg.quick else None]
    policies = {"none": NoSpeculation(), "learned": learned}
    if run.mode in ("replay", "both"):
        versus = "best-rule"
        policies[versus] = best_rule_phase(run)
    else:  # no tuned rule without a replay phase: the static k and the heuristic
        policies.update({f"static:{k}": StaticK(k) for k in sorted({k for k in (1, 2, 3, 4, 6, run.k_max) if k <= run.k_max})})
        policies["heuristic"] = HeuristicK(run.k_max)
        versus = None
    repeats = cfg.eval_repeats
    runs = run_benchmark(run.target, run.draft, policies, held_out, cfg.eval_max_new_tokens, repeats, progress=cfg.progress)
    summary = summarize(runs)
    table = summary["table"]
    if versus is None:
        versus = max((n for n in policies if n not in ("none", "learned")), key=lambda n: table[n]["overall"]["tokens_per_s"])
    print(format_table(summary))
    same = at_or_below(learned.defer, 1) if learned.defer else None
    cell = paired_ratios([asdict(r) for r in runs], "learned", versus).get("B=1", {})
    interval = cell.get("interval")
    verdict = (f"learned / {versus}: {cell.get('ratio', float('nan')):.3f}"
               + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "") + f" ({len(held_out)} test prompts x "
               f"{repeats} paired repeats; a first look: scripts/benchmark.py measures)")
    if same is not None and versus == "best-rule":
        verdict += f"; at one row the policy defers to {getattr(same, 'name', same)}, so the two are one policy here"
    print(verdict)
    log_rows(cfg.track, cfg.wandb_project, run.run_dir, {"device": run.device_key, "draft": run.draft.name,
                                                         "prompts": [p.question_id for p in held_out]}, "eval",
             summary={f"{name}/{key}": value for name, r in table.items()
                      for key, value in r["overall"].items() if isinstance(value, (int, float))})
    atomic_write_text(run.run_dir / "eval.json", json.dumps({"summary": summary, "versus": versus, "learned_over": cell,
                                                             "prompts": [p.question_id for p in held_out]}, indent=1))


def train_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv) if not isinstance(argv, TrainConfig) else argv
    started = time.perf_counter()
    run = resolve_run(cfg)
    if run.mode in ("replay", "both"):
        run.replay = load_replay_data(run)
    plain_speed = plain_speed_phase(run)
    phases, warm = plan_phases(run, plain_speed)
    meta_path, how = train_members(run, phases, warm)
    defer_phase(run, meta_path)
    learned = LearnedK.load(meta_path, device=run.device_key, draft=run.draft.name, replay=run.simulated is not None,
                            target=run.target.name if run.simulated is None else None)
    print(f"specpilot: exported {meta_path} ({how}); one decision takes "
          f"{1e6 * learned.decision_seconds():.1f} us", file=sys.stderr)
    if run.test_prompts:
        evaluate_phase(run, learned)
    print(f"specpilot: done in {time.perf_counter() - started:.0f} s"
          + (f" (evaluation: {run.run_dir / 'eval.json'})" if run.test_prompts else ""), file=sys.stderr)
    return 0
