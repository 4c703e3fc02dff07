"""The main job's training phases: the tuned best rule, plain speed, the env factories, the phase plan, the warm
start and each member's PPO phases (replay, then the real loop), the policies each phase kept."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
from specpilot.bench.batch_table import BatchContextTableK
from specpilot.decoding.config import warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import LOAD_READING, gpu_names
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.paths import (
    atomic_write_text,
    read_json_file,
    relative,
)
from specpilot.decoding.tracking import log_rows
from specpilot.env import PlainSpeed, ReplayEnv, SpecDecodeEnv, measure_plain_speed
from specpilot.env.load import background_load
from specpilot.env.replay_env import replay_steps_per_second

from .ensemble import merge_policies
from .export import export_policy, write_policy
from .improve import improve_policy
from .ppo import EnvFns, fit_rollouts, train
from .train_plan import Run, plan_steps, rollout_episodes
from .train_prepare import best_rule_phase
from .train_select import select_phase


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
                  batch_sizes=run.real_batch_sizes, loads=run.loads, stop_levels=run.stop_levels,
                  sources=run.sources)
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
                         cost_jitter=float(hp.get("replay_cost_jitter") or 0.0), stop_levels=run.stop_levels,
                         sources=run.sources)
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
        stop_levels=run.stop_levels, sources=run.sources)
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
                  "hyperparams": hp, "warm_start": warm_history, "quick": cfg.quick, "load_reading": LOAD_READING,
                  "phases": [{"name": name, "steps": steps, **({"env": "replay", "conditions": [
                      c.name for c in run.replay.conditions] or ["none"]} if name.startswith("replay") else
                      {"env": "real", "loads": run.loads})} for name, _, steps, _ in phases]}
    if phases:
        candidates = member_run / "candidates"
        selecting = bool(run.replay is not None and run.replay.holdout)
        if selecting and init is not None:
            write_policy(candidates / "warm-start", init[0], init[1], str(hp["activation"]), run.k_max, run.device_key,
                         run.hardware_name, 0, {**provenance, "candidate": "warm-start"}, stop_levels=run.stop_levels,
                         sources=run.sources)

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
                             run.hardware_name, 0, provenance, stop_levels=run.stop_levels, sources=run.sources),
                "the rollout-improved policy, no PPO steps")
    raise SpecPilotError("nothing to train: every phase has 0 steps and there is no warm start")


def train_members(run: Run, phases: list[tuple], warm: int) -> tuple[Path, str]:
    """Phase 8: one policy per seed, then their mean (a member already trained is kept on --resume)."""
    if len(run.seeds) == 1:
        return train_member(run, phases, warm, run.seeds[0], run.out)  # (its phases stay in run/candidates/)
    members = []
    for number, seed in enumerate(run.seeds, 1):
        member_out = run.out / "seeds" / f"seed-{seed}"
        why = member_stale(member_out, run) if run.cfg.resume else "not resuming"
        if why is None:
            print(f"specpilot: seed {seed} ({number}/{len(run.seeds)}): kept {member_out / 'policy.json'}", file=sys.stderr)
        else:
            print(f"specpilot: seed {seed} ({number}/{len(run.seeds)})" + (f" (trained anew: {why})" if run.cfg.resume
                                                                           else ""), file=sys.stderr)
            train_member(run, phases, warm, seed, member_out)
        members.append(member_out / "policy.json")
    kept = keep_phase_policies(run, [m.parent for m in members])
    if kept and run.replay is not None and run.replay.holdout:  # the phases merged over the seeds, picked per batch size
        path, how = select_phase(run, phase_candidates(run.out / "phases", phases), run.out)
        return path, how.replace(" policy,", f" policy (each the mean of {len(run.seeds)} seeds' networks),")
    merged = merge_policies(members, run.out)
    return merged, f"the mean of {len(run.seeds)} seeds' policies ({', '.join(map(str, run.seeds))}), checked against theirs"


def member_stale(member_out: Path, run: Run) -> str | None:
    """Why a seed's finished policy cannot be kept on --resume (None: it can): none yet, trained on another reading
    of the machine's load (`hardware.LOAD_READING`: its counters would be read otherwise here), or, where the phases
    are selected on held-out prompts, without the phases' policies it was selected from (run/candidates/)."""
    path = member_out / "policy.json"
    if not path.exists():
        return "none yet"
    meta = json.loads(path.read_text())
    if meta.get("load_reading") != LOAD_READING:
        return f"its load counter was read as '{meta.get('load_reading') or 'the one-minute load average'}', now '{LOAD_READING}'"
    if run.replay is not None and run.replay.holdout and not any((member_out / "run" / "candidates").glob("*/policy.json")):
        return "its phases' policies (run/candidates/) are gone"
    return None


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
