"""The main job before training: the machine's conditions, what must be measured or is stale (traces, cost
profile, load profiles: measured once and kept), the resolved `Run` and the replay data."""
from __future__ import annotations

from typing import TYPE_CHECKING

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from specpilot.bench.tune_cli import rules_policy, tune_rules
from specpilot.decoding.config import at_least, parse_ints, warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import LOAD_READING, resolve, shared_monitor
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.paths import (
    atomic_write_text,
    draft_choice_path,
    load_profile_path,
    output_dir,
    policy_dir,
    read_json_file,
    relative,
)
from specpilot.decoding.prompts import load_prompts
from specpilot.env.load import background_load
from specpilot.env.oracle import (
    CostModel,
    load_draft_traces,
    load_profile,
    model_identity,
    profile_hardware,
    trace_dtype,
    truncate,
)
from specpilot.env.replay_env import MachineCondition

from .pair_select import PairConfig, choose_draft
from .ppo import load_hyperparams
from .select import held_out
from .train_plan import (
    QUICK_TRACES,
    ReplayData,
    Run,
    apply_quick,
    default_paths,
    env_mode,
    simulated_profile,
    train_seeds,
)

if TYPE_CHECKING:
    from .train_cli import TrainConfig


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
    profile_file, traces_file = default_paths(cfg, device_key, draft.name, target.name)
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


COUNTER_SECONDS = 10.0
"""Seconds of plain decoding a load profile's counters are read over when only they are stale."""
LOAD_PROFILE = {"context_lens": "256", "batch_sizes": (1, 4, 16), "repeats": 5}
"""How the chain measures a cost profile beside a load (as profiles/load/ was: one context length, three batch sizes)."""


def load_profiles_phase(pcfg, hp: dict, target, draft, device_key: str, hardware_name: str, batch_sizes: list[int]) -> None:
    """Phase 1c (--env auto): the cost profile beside each of the YAML's `condition_loads` that this device and pair lack
    or hold for another target, measured here with the load running (profile_device.py --background-load L --out
    profiles/load): the replay env's machine conditions, each with the counters as they read under that load."""
    from specpilot.bench.profile_cli import record_counters, write_profile  # noqa: I001 (the measuring command)

    for load in hp.get("condition_loads") or []:
        path = load_profile_path(device_key, draft.name, str(load), target.name)
        why = stale_reason(path, target, "cost profile", {}, draft)
        if why is None and read_json_file(path, "cost profile").get("load_reading") != LOAD_READING:
            # its costs stand; its counters read the one-minute load average, which lags a load started with the
            # measurement: read them again under the load (as profile_device.py --record-counters)
            print(f"specpilot: chain: reading the counters beside the load '{load}' again ({LOAD_READING})",
                  file=sys.stderr)
            record_counters(path, read_json_file(path, "cost profile"), target,
                            target.encode(load_prompts(pcfg.prompts)[0].text, chat=True), str(load), COUNTER_SECONDS)
            continue
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


def train_root(cfg: TrainConfig) -> Path:
    """Where the run writes its policy (OUT/DEVICE/PAIR) and a draft choice (OUT/DEVICE/auto): --out, else
    runs/quick with --quick, else policies/ (`paths.output_dir`)."""
    return Path(cfg.out) if cfg.out else (output_dir("policies").parent / "runs" / "quick" if cfg.quick
                                          else output_dir("policies"))


def draft_phase(cfg: TrainConfig) -> None:
    """Phase 0 (--draft auto): the draft whose tuned rule is fastest on held-out train prompts (agents/pair_select.py,
    --quick: one repeat of a few short prompts) becomes the run's --draft; the choice is written beside the policy."""
    if cfg.draft != "auto":
        return
    recorded = draft_choice_path(resolve(cfg.device).key, cfg.target, train_root(cfg))
    if cfg.resume and recorded.exists():  # a resumed run keeps the draft it chose
        cfg.draft = read_json_file(recorded, "draft choice", keys=("draft",))["draft"]
        print(f"specpilot: --resume: the draft chosen before, '{cfg.draft}' ({relative(recorded)})", file=sys.stderr)
        return
    quick = {"repeats": 1, "max_new_tokens": 16} if cfg.quick else {}
    pcfg = PairConfig(device=cfg.device, dtype=cfg.dtype, target=cfg.target, prompts=cfg.prompts,
                      out=str(train_root(cfg)), progress=cfg.progress, **quick)
    cfg.draft, _ = choose_draft(pcfg, "python scripts/train_policy.py " + " ".join(sys.argv[1:]))


def resolve_run(cfg: TrainConfig) -> Run:
    """Phase 1: the device, the hyperparameters (YAML, --hp, --quick), the prompts, the models, the output folder."""
    simulated = simulated_profile(cfg)
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
        apply_quick(cfg, hp)
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
    most = getattr(target, "max_rows", None)
    if most and any(b > most for b in batch_sizes):  # an engine of one row (llama.cpp): its batch sizes only
        if cfg.batch_sizes:
            raise SpecPilotError(f"--batch-sizes {cfg.batch_sizes}: {target.name} decodes at most {most} row(s) at once")
        batch_sizes = hp["batch_sizes"] = [b for b in batch_sizes if b <= most] or [1]
        print(f"specpilot: {target.name} decodes at most {most} row(s) at once: batch sizes {batch_sizes}", file=sys.stderr)
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
    mode = env_mode(cfg, device_key, draft.name, target_name)
    k_max = int(hp["k_max"])
    holdout_ids = held_out([p.question_id for p in train_prompts], float(hp.get("select_holdout") or 0.0)) \
        if cfg.env != "real" else set()
    real_prompts = fitting_prompts(target, [p for p in train_prompts if p.question_id not in holdout_ids],
                                   int(hp["max_new_tokens"]) + k_max + 1)
    out = policy_dir(device_key, draft.name, train_root(cfg), target_name)
    (out / "run").mkdir(parents=True, exist_ok=True)
    return Run(cfg, device_key, hardware_name, torch_device, simulated, hp, seeds, batch_sizes,
               [b for b in (int(b) for b in hp.get("real_batch_sizes") or batch_sizes) if b in batch_sizes] or batch_sizes,
               train_prompts, test_prompts, target, draft,
               real_prompts, mode, out, loads, condition_paths(cfg, hp, device_key, draft.name, target_name, own_profile) if mode != "real" else [],
               holdout_ids, fresh_inputs=fresh)


def load_replay_data(run: Run) -> ReplayData:
    """Phase 2 (replay modes): the cost profile, the train split's traces and the machine conditions, read once."""
    profile_file, traces_file = default_paths(run.cfg, run.device_key, run.draft.name,
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
