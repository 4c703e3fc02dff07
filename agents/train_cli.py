"""The main job: `python scripts/train_policy.py --device cpu` trains, exports and evaluates a policy."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specpilot.bench.batch_table import BatchContextTableK
from specpilot.bench.benchmark import format_table, run_benchmark, summarize
from specpilot.bench.tune_cli import rules_policy, tune_rules
from specpilot.decoding.config import at_least, parse_config, parse_ints, warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import gpu_names, resolve, shared_monitor
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.paths import (
    atomic_write_text,
    output_dir,
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
)
from specpilot.decoding.prompts import load_prompts, per_category
from specpilot.decoding.tracking import log_rows
from specpilot.env import PlainSpeed, ReplayEnv, SpecDecodeEnv, measure_plain_speed
from specpilot.env.oracle import CostModel, load_draft_traces, load_profile, truncate
from specpilot.env.replay_env import MachineCondition, replay_steps_per_second

from .ensemble import merge_policies
from .defer import defer_table, describe, write_defer
from .export import export_policy, write_policy
from .improve import improve_policy
from .ppo import EnvFns, fit_rollouts, load_hyperparams, split_budget, train


@dataclass
class TrainConfig:
    """Train a PPO draft-length policy for this device on the real decode loop, export and evaluate it."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (the first visible GPU of that kind; must be present)."""
    timesteps: int = 0
    """Total PPO env steps of the run, split over its phases (replay warm-up, replay, real loop) in the
    proportions of agents/hyperparams.yaml (all to the last phase where the YAML gives none); 0 = the
    YAML's own steps. The run prints its plan first and never runs more than asked."""
    replay_timesteps: int = -1
    """Steps of the replay phase, taken out of --timesteps (-1 = its share of it, or the YAML's)."""
    warmup_timesteps: int = -1
    """Steps of the replay warm-up phase, taken out of --timesteps (-1 = its share, or the YAML's)."""
    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct, offline), a hub id, a folder or a .gguf file."""
    draft: str = "ngram"
    """Drafter: ngram | ngram:N | self:bf16 | MODEL_ID_OR_PATH."""
    env: str = "auto"
    """real | replay | both (pre-train on the replay env, fine-tune on the real loop) | auto (both when a
    cost profile and traces exist for this device and draft, else real)."""
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
    dtype: str = "auto"
    """Model dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16."""
    progress: bool = True
    """Show progress bars."""
    allow_simulated: bool = False
    """Train for a chip from a simulated cost profile (--profile PATH from profile_device.py --simulate): replay
    env only, no GPU needed, the device need not be present; the exported policy records it."""
    condition_profiles: str = ""
    """Comma-separated cost profiles of the same device under other machine conditions (a power cap, a
    co-tenant, a background load: profile_device.py --simulate D --condition C, or --background-load L), each
    with the counters as read under it: replay episodes draw the condition (the --profile one included), so
    the counters carry what the policy needs to know about the machine."""
    hardware_noise: float = 0.02
    """With --condition-profiles: each replay episode reads every counter off by this standard deviation."""
    background_load: str = "none"
    """Comma-separated background loads the real-loop env draws from per episode (env/load.py: none | compute
    | memory | both), started and stopped by the env (never left running, not even when the run is killed);
    the reward prices plain decoding by its speed measured under the same load."""
    n_envs: int = 1
    """Envs PPO steps at once: replay envs in N processes (one core each); real-loop envs one per visible GPU
    (each process loads the target on its GPU), or on the CPU N envs sharing this process's model."""


def _default_paths(cfg: TrainConfig, device_key: str, draft_name: str) -> tuple[Path, Path]:
    return (Path(cfg.profile) if cfg.profile else profile_path(device_key, draft_name),
            Path(cfg.traces) if cfg.traces else traces_path(draft_name))


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


def _env_mode(cfg: TrainConfig, device_key: str, draft_name: str) -> str:
    if cfg.env not in ("auto", "real", "replay", "both"):
        raise SpecPilotError(f"--env must be auto, real, replay or both, got '{cfg.env}'")
    if cfg.env != "auto":
        return cfg.env
    profile, traces = _default_paths(cfg, device_key, draft_name)
    return "both" if profile.exists() and traces.exists() else "real"


def _replay_data(cfg: TrainConfig, device_key: str, draft_name: str, train_ids: set[str], torch_device: str):
    """(train-split traces, cost model, hardware counters, profile, profile path) for the replay env."""
    profile_file, traces_file = _default_paths(cfg, device_key, draft_name)
    profile = load_profile(profile_file, device_key)
    traces, _ = load_draft_traces(traces_file, draft_name)
    traces = [t for t in traces if t.question_id in train_ids]  # never pre-train on the test split
    if not traces:
        raise SpecPilotError(f"traces {traces_file} hold none of the training prompts")
    # hardware counters as seen while decoding on this device (recorded with the profile, else live now)
    hardware = profile.get("hardware")
    if hardware is None:
        hardware = shared_monitor(torch_device).read().tolist()
    return traces, CostModel.from_profile(profile), np.asarray(hardware, dtype=np.float32), profile, profile_file


def machine_conditions(cfg: TrainConfig, device_key: str, cost: CostModel, hardware: np.ndarray,
                profile: dict) -> list[MachineCondition]:
    """The machine conditions of --condition-profiles, after the --profile one ([] without them)."""
    paths = [p.strip() for p in cfg.condition_profiles.split(",") if p.strip()]
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
                                           np.asarray(other["hardware"], dtype=np.float32)))
    names = [c.name for c in conditions]
    if len(set(names)) != len(names):
        raise SpecPilotError(f"--condition-profiles: two profiles share a condition name ({', '.join(names)})")
    return conditions


def _replay_env_fn(cfg: TrainConfig, device_key: str, draft_name: str, k_max: int, train_ids: set[str],
                   max_new_tokens: int, torch_device: str, reward: str, batch_sizes: list[int] = (1,),
                   speed_jitter: float = 1.0, context_lens: list[int] = (), cost_jitter: float = 0.0):
    traces, cost, hardware, profile, _ = _replay_data(cfg, device_key, draft_name, train_ids, torch_device)
    conditions = machine_conditions(cfg, device_key, cost, hardware, profile)
    return lambda: ReplayEnv(traces, cost, k_max=k_max, noise=float(profile.get("noise", 0.05)), hardware=hardware,
                             max_new_tokens=max_new_tokens, reward=reward, batch_sizes=batch_sizes,
                             speed_jitter=speed_jitter, context_lens=context_lens, conditions=conditions,
                             hardware_noise=cfg.hardware_noise if conditions else 0.0, cost_jitter=cost_jitter)


def _best_rule(cfg: TrainConfig, hp: dict, device_key: str, draft_name: str, train_ids: set[str], torch_device: str,
               batch_sizes: list[int], out: Path):
    """(best-rule policy, train traces, cost model, hardware counters): the best engine rule per batch size
    as tuned on the train split (OUT/rules.json; tuned first when it does not exist yet)."""
    traces, cost, hardware, profile, profile_file = _replay_data(cfg, device_key, draft_name, train_ids, torch_device)
    k_max, budget = int(hp["k_max"]), int(hp["max_new_tokens"])
    traces = [truncate(t, budget) for t in traces]
    rules_path = out / "rules.json"
    if rules_path.exists():
        rules = read_json_file(rules_path, "tuned rules", keys=("best_rule",))
    else:
        print(f"specpilot: tuning the engine rules on the train split first ({rules_path})", file=sys.stderr)
        rules = tune_rules(traces, profile, draft_name, k_max, hardware, batch_sizes, budget, cfg.progress)
        rules = {"device": device_key, "draft": draft_name, "split": "train", "traces": len(traces),
                 "profile": relative(profile_file), "max_new_tokens": budget, "k_max": k_max, **rules}
        atomic_write_text(rules_path, json.dumps(rules, indent=1) + "\n")
    return rules_policy(rules["best_rule"], profile, traces, k_max, draft_name), traces, cost, hardware


def _warm_start(cfg: TrainConfig, hp: dict, device_key: str, draft_name: str, train_ids: set[str], torch_device: str,
                batch_sizes: list[int], out: Path, seed: int):
    """Rollout policy improvement from the best engine rule tuned on the train split (agents.improve, with this
    seed): (layers, normalisation) for PPO to start from, and its history."""
    k_max, budget = int(hp["k_max"]), int(hp["max_new_tokens"])
    contexts = [int(c) for c in hp.get("context_lens") or []]
    traces, cost, hardware, profile, _ = _replay_data(cfg, device_key, draft_name, train_ids, torch_device)
    conditions = machine_conditions(cfg, device_key, cost, hardware, profile)
    if hp.get("warm_start_base", "best-rule") == "batch-context-table":  # from the profile: no rule tuning
        traces = [truncate(t, budget) for t in traces]
        base = BatchContextTableK.from_profile(profile, traces, k_max, contexts or [profile["context_lens"][0]])
        what = f"the batch x context table from the profile ({len(base.table)} cells)"
    else:
        base, traces, cost, hardware = _best_rule(cfg, hp, device_key, draft_name, train_ids, torch_device, batch_sizes, out)
        what = f"the best tuned rule ({', '.join(f'B={b} {s}' for b, s in base.table.items())})"
    episodes = rollout_episodes(hp, batch_sizes)
    labels = str(hp.get("warm_start_labels") or "rollout")
    print(f"specpilot: warm start: {hp['rollout_rounds']} rounds of rollout policy improvement from {what}"
          + (" (one-row states labelled by the oracle's hindsight Q*)" if labels == "oracle" else ""), file=sys.stderr)
    layers, norm, history = improve_policy(
        base, traces, cost, k_max, hardware, batch_sizes, episodes, budget, int(hp["rollout_rounds"]),
        list(hp["net_arch"]), str(hp["activation"]), int(hp["rollout_epochs"]), seed=seed, progress=cfg.progress,
        log=lambda m: print(f"specpilot: {m}", file=sys.stderr), context_lens=contexts, conditions=conditions,
        hardware_noise=cfg.hardware_noise if conditions else 0.0, cost_jitter=float(hp.get("replay_cost_jitter") or 0.0),
        workers=int(hp.get("rollout_workers") or 0), labels=labels,
        batch_weights={int(b): float(w) for b, w in (hp.get("rollout_batch_weights") or {}).items()})
    return (layers, norm), history


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


def train_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TrainConfig, argv) if not isinstance(argv, TrainConfig) else argv
    started = time.perf_counter()
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
    seeds = train_seeds(cfg, hp)
    hp.pop("seeds", None)  # each member records its own seed
    k_max = int(hp["k_max"])
    if cfg.batch_sizes:
        hp["batch_sizes"] = parse_ints(cfg.batch_sizes, "--batch-sizes")
    batch_sizes = [int(b) for b in hp.get("batch_sizes") or [1]]
    real_batch_sizes = [int(b) for b in hp.get("real_batch_sizes") or batch_sizes]
    train_prompts = load_prompts(cfg.prompts, "train")
    test_prompts = load_prompts(cfg.prompts, "test") if cfg.eval_per_category else []
    print(f"specpilot: training for device '{device_key}' ({hardware_name}), torch device {torch_device}", file=sys.stderr)
    target = load_target(cfg.target, cfg.dtype, torch_device)
    draft = load_draft(cfg.draft, target, cfg.dtype)
    real_prompts = fitting_prompts(target, train_prompts, int(hp["max_new_tokens"]) + k_max + 1)
    out = policy_dir(device_key, draft.name, cfg.out or output_dir("policies"))
    run_dir = out / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    speed_path = run_dir / "plain_speed.json"
    if cfg.env == "replay":  # only the real-loop env needs the measured plain speed
        plain_speed = None
    elif cfg.resume and speed_path.exists():
        plain_speed = PlainSpeed.load(speed_path)
    else:
        plain_speed = measure_plain_speed(target, target.encode(real_prompts[0].text, chat=True),
                                          batch_sizes=real_batch_sizes)
        plain_speed.save(speed_path)

    at_least(1, n_envs=cfg.n_envs)
    loads = [x.strip() for x in cfg.background_load.split(",") if x.strip()]
    if loads != ["none"] and cfg.env == "replay":
        raise SpecPilotError("--background-load runs beside the real loop; --env replay has none (use --condition-profiles)")

    def env_fn():
        return SpecDecodeEnv(target, draft, real_prompts, k_max=k_max, max_new_tokens=int(hp["max_new_tokens"]),
                             plain_speed=plain_speed, reward=str(hp["reward"]), batch_sizes=real_batch_sizes,
                             loads=loads)

    def real_env_fns() -> EnvFns:
        gpus = gpu_names() if torch_device.startswith("cuda") else []
        if cfg.n_envs == 1 or not gpus:  # one process: the envs share the model loaded above
            return EnvFns([env_fn] * cfg.n_envs)

        def on_gpu(index: int):
            def make():  # runs in the env's own process: its own copy of the models on its own GPU
                own = load_target(cfg.target, cfg.dtype, f"cuda:{index}")
                return SpecDecodeEnv(own, load_draft(cfg.draft, own, cfg.dtype), real_prompts, k_max=k_max,
                                     max_new_tokens=int(hp["max_new_tokens"]), plain_speed=plain_speed,
                                     reward=str(hp["reward"]), batch_sizes=real_batch_sizes, loads=loads)
            return make

        return EnvFns([on_gpu(i % len(gpus)) for i in range(cfg.n_envs)], subprocess=True)

    phases = []
    mode = _env_mode(cfg, device_key, draft.name)
    budget = plan_steps(cfg, hp, mode)
    if mode in ("replay", "both"):
        def replay_env_fn(sizes: list[int]):
            one = _replay_env_fn(cfg, device_key, draft.name, k_max, {p.question_id for p in train_prompts},
                                 int(hp["max_new_tokens"]), torch_device, str(hp["reward"]), sizes,
                                 float(hp["replay_speed_jitter"]), [int(c) for c in hp.get("context_lens") or []],
                                 float(hp.get("replay_cost_jitter") or 0.0))
            return EnvFns([one] * cfg.n_envs, subprocess=True)

        replay_fn = replay_env_fn(batch_sizes)
        every = int(hp["replay_checkpoint_every"])
        warmup = budget["replay-warmup"]
        if warmup > 0:  # first at these batch sizes only (CPU: one row), then at all of them
            warmup_sizes = [int(b) for b in hp.get("replay_warmup_batch_sizes") or [1]]
            phases.append(("replay-warmup", replay_env_fn(warmup_sizes), warmup, every))
        phases.append(("replay", replay_fn, budget["replay"], every))
        probe = replay_fn[0]()
        warn(probe.cost.outside(batch_sizes, max(probe.context_lens or [0]) + max(len(t.prompt_ids) + len(t.output_ids) for t in probe.traces)))
        print(f"specpilot: replay env runs {replay_steps_per_second(probe):,.0f} env steps/s "
              "(random actions, this process)", file=sys.stderr)
    if mode in ("real", "both"):
        phases.append(("real", real_env_fns(), budget["real"], int(hp["checkpoint_every"])))
    n_steps, batch_size, fitted = fit_rollouts([p[2] for p in phases], int(hp["n_steps"]), int(hp["batch_size"]),
                                               cfg.n_envs)
    hp["n_steps"], hp["batch_size"] = n_steps, batch_size
    phases = [(name, fn, s, every) for (name, fn, _, every), s in zip(phases, fitted)]
    warm = int(hp["rollout_rounds"]) if mode in ("replay", "both") else 0
    plan = ([f"warm start ({warm} round(s) of rollout improvement)"] if warm else []) + [
        f"{n} {s:,} PPO steps" for n, _, s, _ in phases if s > 0]
    if any(s > 0 for _, _, s, _ in phases):
        plan.append(f"rollouts of {n_steps} steps" + (f" x {cfg.n_envs} envs" if cfg.n_envs > 1 else ""))
    print(f"specpilot: plan (env {mode}): " + (", ".join(plan) or "nothing to train"), file=sys.stderr)

    phases = [p for p in phases if p[2] > 0]

    def train_one(seed: int, member_out: Path) -> tuple[Path, str]:
        """Warm start, PPO phases and export of one seed's policy into `member_out` (its run in member_out/run)."""
        member_run = member_out / "run"
        member_run.mkdir(parents=True, exist_ok=True)
        init, warm_history = None, []
        if warm:
            warm_path = member_run / "warm_start.json"
            if cfg.resume and warm_path.exists():
                saved = read_json_file(warm_path, "warm-start file", keys=("layers", "normalization", "history"))
                init = ([(np.asarray(w, dtype=np.float32), np.asarray(b, dtype=np.float32)) for w, b in saved["layers"]],
                        saved["normalization"])
                warm_history = saved["history"]
            else:
                init, warm_history = _warm_start(cfg, hp, device_key, draft.name, {p.question_id for p in train_prompts},
                                                 torch_device, batch_sizes, out, seed)
                atomic_write_text(warm_path, json.dumps({"layers": [[w.tolist(), b.tolist()] for w, b in init[0]],
                                                         "normalization": init[1], "history": warm_history}))
        run_config = {"device": device_key, "hardware_name": hardware_name, "target": target.name,
                      "draft": draft.name, **{k: v for k, v in asdict(cfg).items() if k not in ("hp",)}, "seed": seed}
        provenance = {"target": target.name if simulated is None else simulated["target"], "draft": draft.name,
                      "simulated": simulated is not None, "profile": relative(cfg.profile) if cfg.profile else None,
                      "context_lens": [int(c) for c in hp.get("context_lens") or []],
                      "condition_profiles": [relative(p.strip()) for p in cfg.condition_profiles.split(",") if p.strip()],
                      "max_new_tokens": int(hp["max_new_tokens"]),
                      "batch_sizes": batch_sizes, "real_batch_sizes": real_batch_sizes,
                      "prompts": cfg.prompts or "decoding/data/prompts.jsonl (train split)", "seed": seed,
                      "env": mode, "hyperparams": hp, "warm_start": warm_history}
        if phases:
            model, venv = train(phases, hp, member_run, seed=seed, resume=cfg.resume, track=cfg.track,
                                wandb_project=cfg.wandb_project, run_config=run_config, progress=cfg.progress, init=init)
            path = export_policy(model, venv, member_out, device_key, hardware_name, k_max, provenance,
                                 check_obs=venv.get_original_obs() if hasattr(venv, "get_original_obs") else None,
                                 activation=str(hp["activation"]))
            venv.close()  # its envs' processes and background loads
            return path, "checked against SB3's actions"
        if init is not None:  # the warm start alone (no PPO steps asked for)
            log_rows(cfg.track, cfg.wandb_project, member_run, {**run_config, **hp}, "warm_start", warm_history)
            return (write_policy(member_out, init[0], init[1], str(hp["activation"]), k_max, device_key, hardware_name,
                                 0, provenance), "the rollout-improved policy, no PPO steps")
        raise SpecPilotError("nothing to train: every phase has 0 steps and there is no warm start")

    if len(seeds) == 1:
        meta_path, how = train_one(seeds[0], out)
    else:  # one policy per seed, then their mean (a member already trained is kept on --resume)
        members = []
        for number, seed in enumerate(seeds, 1):
            member_out = out / "seeds" / f"seed-{seed}"
            if cfg.resume and (member_out / "policy.json").exists():
                print(f"specpilot: seed {seed} ({number}/{len(seeds)}): kept {member_out / 'policy.json'}", file=sys.stderr)
            else:
                print(f"specpilot: seed {seed} ({number}/{len(seeds)})", file=sys.stderr)
                train_one(seed, member_out)
            members.append(member_out / "policy.json")
        meta_path = merge_policies(members, out)
        how = f"the mean of {len(seeds)} seeds' policies ({', '.join(map(str, seeds))}), checked against theirs"
    if mode in ("replay", "both") and hp.get("defer_margin") is not None:  # where the tuned rule decides instead
        rule, rule_traces, cost, hardware = _best_rule(cfg, hp, device_key, draft.name,
                                                       {p.question_id for p in train_prompts}, torch_device, batch_sizes, out)
        mlp = LearnedK.load(meta_path, device=device_key, draft=draft.name, defer=False)
        table, ratios = defer_table(mlp, rule, rule_traces, cost, k_max, hardware, batch_sizes, int(hp["max_new_tokens"]),
                                    float(hp["defer_margin"]))
        write_defer(meta_path, table, ratios, float(hp["defer_margin"]))
        print(f"specpilot: the tuned rule's batch sizes (train-split replay): {describe(table, ratios)}", file=sys.stderr)
    learned = LearnedK.load(meta_path, device=device_key, draft=draft.name)
    print(f"specpilot: exported {meta_path} ({how}); one decision takes "
          f"{1e6 * learned.decision_seconds():.1f} us", file=sys.stderr)
    if not test_prompts:
        print(f"specpilot: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return 0
    held_out = per_category(test_prompts, cfg.eval_per_category)
    statics = sorted({k for k in (1, 2, 3, 4, 6, k_max) if k <= k_max})
    policies = {"none": NoSpeculation(), **{f"static:{k}": StaticK(k) for k in statics},
                "heuristic": HeuristicK(k_max), "learned": learned}
    if mode in ("replay", "both"):  # the rule the learned policy has to beat
        policies["best-rule"] = _best_rule(cfg, hp, device_key, draft.name, {p.question_id for p in train_prompts},
                                           torch_device, batch_sizes, out)[0]
    runs = run_benchmark(target, draft, policies, held_out, cfg.eval_max_new_tokens, 1, progress=cfg.progress)
    summary = summarize(runs)
    table = summary["table"]
    best_static = max((n for n in policies if n.startswith("static:")), key=lambda n: table[n]["overall"]["tokens_per_s"])
    row, best = table["learned"]["overall"], table[best_static]["overall"]
    print(format_table(summary))
    print(f"learned vs best static ({best_static}): {row['tokens_per_s'] / best['tokens_per_s']:.3f}x tokens/s; "
          f"vs heuristic: {row['tokens_per_s'] / table['heuristic']['overall']['tokens_per_s']:.3f}x; "
          f"vs plain: {row['speedup']:.3f}x"
          + (f"; vs best-rule: {row['tokens_per_s'] / table['best-rule']['overall']['tokens_per_s']:.3f}x"
             if "best-rule" in table else ""))
    log_rows(cfg.track, cfg.wandb_project, run_dir, {"device": device_key, "draft": draft.name, "policy": str(meta_path),
                                                     "prompts": [p.question_id for p in held_out]}, "eval",
             summary={f"{name}/{key}": value for name, row in table.items()
                      for key, value in row["overall"].items() if isinstance(value, (int, float))})
    atomic_write_text(run_dir / "eval.json", json.dumps({"summary": summary, "best_static": best_static,
                                                         "prompts": [p.question_id for p in held_out]}, indent=1))
    print(f"specpilot: done in {time.perf_counter() - started:.0f} s (evaluation: results in {run_dir / 'eval.json'})",
          file=sys.stderr)
    return 0
