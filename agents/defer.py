"""Where a learned policy hands k back to the tuned rule: `python -m specpilot.agents.defer --device cpu --draft ngram:3`.

One MLP decides k at every batch size, and where speculation gains little it can trail the tuned rule (on this
CPU at 8 and 16 rows the best rule is ~1.04-1.05x plain decoding on the train split, and the MLP came out 2-4%
behind it on held-out prompts: reports/README.md). This replays the policy's MLP alone beside the best rule of
each batch size on the train split (noise-free replay env, the prompts both were fitted and tuned on) and
writes into its policy.json a `defer` table, {batch size: rule or null}: the rule decides the batch sizes where
the MLP is not at least `margin` ahead of it, the MLP the rest (LearnedK.defer). Nothing held out is read.
`train_policy.py` runs the same step after training, with the YAML's `defer_margin`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specpilot.bench.batch_table import BatchTableK
from specpilot.bench.tune_cli import rules_policy
from specpilot.decoding.hardware import artifact_key
from specpilot.decoding.config import ReplayInputs, parse_config, parse_ints, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.learned import LearnedK
from specpilot.decoding.paths import atomic_write_text, policy_dir, profile_path, read_json_file, traces_path
from specpilot.decoding.policies import PerBatchK
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import CostModel, load_profile, load_traces, profile_hardware, train_traces, truncate
from specpilot.env.replay_env import replay_evaluate

from .ppo import load_hyperparams


@dataclass
class DeferConfig(ReplayInputs):
    """Write where a learned policy defers to the tuned rule (its `defer` table), from the train-split replay (less
    the prompts its training run held out to pick the phase: the run's own deferral)."""

    policy: str | None = None
    """policy.json to gate (default: policies/DEVICE/DRAFT/policy.json)."""
    margin: float | None = None
    """The MLP keeps a batch size only where its train-split replay speed is >= (1 + margin) x the rule's; below
    that the rule decides there (default: the YAML's `defer_margin`)."""
    batch_sizes: str = ""
    """Comma-separated batch sizes to decide (default: those the policy was trained on)."""
    dry_run: bool = False
    """Print the comparison and the table; write nothing."""


def rule_spec(rule: PerBatchK, batch: int, k_max: int) -> str:
    """The spelling (parse_policy's) of the tuned rule at this batch size: a batch table is its k there."""
    chosen = rule.policy_for(batch)
    spec = f"static:{chosen.k_for(batch)}" if isinstance(chosen, BatchTableK) else chosen.name
    if parse_policy(spec, k_max).name != spec:
        raise SpecPilotError(f"the tuned rule at B={batch} ('{spec}') has no spelling a policy file can hold")
    return spec


def defer_table(mlp: LearnedK, rule: PerBatchK, traces, cost: CostModel, k_max: int, hardware, batch_sizes: list[int],
                max_new_tokens: int, margin: float, context_lens: list[int] | None = None
                ) -> tuple[dict[str, str | None], dict[int, float]]:
    """({batch size: rule spelling, or None where the MLP keeps it}, {batch size: MLP / rule replay speed}). With
    `context_lens` (a policy trained on simulated contexts: the YAML's `context_lens`) the replay runs at each of them
    and the ratio is their geometric mean; else at the prompts' own contexts."""
    if margin < 0:
        raise SpecPilotError(f"the defer margin is >= 0, got {margin:g}")
    ratios, table = {}, {}
    for b in sorted(batch_sizes):
        logs = []
        for context in context_lens or [0]:
            got = replay_evaluate({"mlp": mlp, "rule": rule}, traces, cost, k_max, hardware, b, max_new_tokens,
                                  context_len=int(context))
            logs.append(np.log(got["mlp"]["speedup"] / got["rule"]["speedup"]))
        ratios[b] = float(np.exp(np.mean(logs)))
        table[str(b)] = rule_spec(rule, b, k_max) if ratios[b] < 1.0 + margin else None
    return table, ratios


def write_defer(meta_path: Path, table: dict, ratios: dict[int, float], margin: float) -> None:
    """Record the table (and the evidence for it) in policy.json, atomically."""
    meta = read_json_file(meta_path, "policy file", keys=("k_max",))
    meta["defer"] = table
    meta["defer_evidence"] = {"split": "train", "env": "replay", "margin": margin,
                              "mlp_over_rule": {str(b): round(r, 5) for b, r in ratios.items()}}
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")


def describe(table: dict, ratios: dict[int, float]) -> str:
    return "; ".join(f"B={b} MLP/rule {ratios[int(b)]:.3f} -> {'MLP' if spec is None else spec}" for b, spec in table.items())


def defer_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(DeferConfig, argv)
    cfg.device = artifact_key(cfg.device)  # 'cpu' -> this CPU's machine key
    hp = load_hyperparams(cfg.device)
    margin = float(hp.get("defer_margin") or 0.0) if cfg.margin is None else cfg.margin
    if margin < 0:
        raise SpecPilotError(f"--margin is >= 0, got {margin:g}")
    meta_path = Path(cfg.policy) if cfg.policy else policy_dir(cfg.device, cfg.draft) / "policy.json"
    mlp = LearnedK.load(meta_path, device=cfg.device, draft=cfg.draft, defer=False)
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes else [int(b) for b in mlp.meta.get("batch_sizes") or [1]]
    budget = int(mlp.meta.get("max_new_tokens") or hp["max_new_tokens"])
    profile = load_profile(profile_path(cfg.device, cfg.draft), cfg.device)
    traces, trace_meta = load_traces(traces_path(cfg.draft))
    held = set((mlp.meta.get("selection") or {}).get("held_out_prompts") or [])  # what the training run's deferral left out
    train = [truncate(t, budget) for t in train_traces(traces, trace_meta) if t.question_id not in held]
    rules = read_json_file(meta_path.parent / "rules.json", "tuned rules", keys=("best_rule",))
    rule = rules_policy(rules["best_rule"], profile, train, mlp.k_max, cfg.draft)
    table, ratios = defer_table(mlp, rule, train, CostModel.from_profile(profile), mlp.k_max, profile_hardware(profile),
                                sizes, budget, margin, [int(c) for c in mlp.meta.get("context_lens") or []])
    print(f"{len(train)} train prompts ({len(held)} held out for the phase selection), replay, {budget} tokens, margin {margin:g}: {describe(table, ratios)}")
    if not cfg.dry_run:
        write_defer(meta_path, table, ratios, margin)
        print(f"written: {meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(defer_main))
