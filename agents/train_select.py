"""The main job after training: the held-out selection among the phases' policies, per batch size, the deferral
table and the evaluation on the test split beside the tuned rule."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
from specpilot.bench.benchmark import format_table, run_benchmark, summarize
from specpilot.bench.paired_cli import paired_ratios
from specpilot.decoding.config import at_least
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.observation import FEATURES
from specpilot.decoding.paths import (
    atomic_write_text,
)
from specpilot.decoding.policies import (
    HeuristicK,
    NoSpeculation,
    StaticK,
    at_or_below,
)
from specpilot.decoding.prompts import per_category
from specpilot.decoding.tracking import log_rows
from specpilot.env.replay_env import MachineCondition

from .defer import defer_table, describe, write_defer
from .export import provenance_of, write_policy
from .select import batch_choice, selection_scores
from .train_plan import Run
from .train_prepare import best_rule_phase


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
                        stop_levels=nets[base].actions.stop_levels, sources=nets[base].actions.sources)
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
