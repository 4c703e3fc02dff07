"""How many passes the warm start's fit should make, judged on train prompts it did not see:
`python -m specpilot.agents.fit_check` (about 12 minutes on one core).

One row, the CPU profile and traces: a quarter of the train-split prompts is held out (seeded), two rounds of
rollout labels are collected on the rest (round 1 from the best tuned rule, round 2 on the fitted policy's
states, as `train_policy.py` does), and each fit variant (passes x entropy bonus) is scored by its replay
speedup on the held-out quarter beside the rule's. The test and ood splits are not touched.

With `--extra-traces FILE` (traces of more train prompts: `profile_device.py --no-costs --prompts P --out D`) the
whole check runs twice on the same held-out quarter, fitted without and with those prompts' episodes: whether
more training prompts of that kind help on train prompts no fit saw."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from specpilot.bench.tune_cli import rules_policy
from specpilot.decoding.hardware import artifact_key
from specpilot.decoding.config import ReplayInputs, parse_config, parse_ints, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import policy_dir, profile_path, read_json_file, traces_path
from specpilot.env.oracle import CostModel, load_draft_traces, load_profile, load_traces, profile_hardware, train_traces, truncate
from specpilot.env.replay_env import replay_evaluate

from .improve import as_policy, collect, fit, merge


@dataclass
class FitCheckConfig(ReplayInputs):
    """Score warm-start fit variants on held-out train prompts (one row, replay)."""

    passes: str = "50,200"
    """Comma-separated numbers of passes of the fit to compare."""
    entropy: str = "0,0.02,0.05"
    """Comma-separated entropy bonuses to compare."""
    hidden: str = "128,128"
    """Hidden layer sizes of the MLP."""
    holdout: float = 0.25
    """Share of the train prompts held out."""
    max_new_tokens: int = 48
    """Tokens per row."""
    seed: int = 7
    """Seed of the held-out choice."""
    extra_traces: str | None = None
    """Traces of extra train prompts (same draft, budget and k_max): never held out; every variant is scored
    twice, fitted without and with their episodes (default: one arm)."""


def holdout_split(train: list, extra: list, holdout: float, seed: int) -> tuple[list, list]:
    """(fitted on, held out) traces: a seeded `holdout` share of `train` is held out, the same whatever `extra`
    holds; the extra traces join the fit only, and one whose prompt is also in `train` is an error."""
    shared = {t.question_id for t in train} & {t.question_id for t in extra}
    if shared:
        raise SpecPilotError(f"the extra traces repeat {len(shared)} train prompts (e.g. {sorted(shared)[0]})")
    held = set(np.random.default_rng(seed).permutation(len(train))[: int(len(train) * holdout)].tolist())
    return [t for i, t in enumerate(train) if i not in held], [t for i, t in enumerate(train) if i in held]


def fit_check_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(FitCheckConfig, argv)
    cfg.device = artifact_key(cfg.device)  # 'cpu' -> this CPU's machine key
    profile = load_profile(profile_path(cfg.device, cfg.draft))
    cost, hardware = CostModel.from_profile(profile), profile_hardware(profile)
    traces, meta = load_traces(traces_path(cfg.draft))
    train = [truncate(t, cfg.max_new_tokens) for t in train_traces(traces, meta)]
    added = []
    if cfg.extra_traces:
        extra, _ = load_draft_traces(cfg.extra_traces, cfg.draft, cfg.max_new_tokens)
        added = [truncate(t, cfg.max_new_tokens) for t in extra]
    fit_on, val = holdout_split(train, added, cfg.holdout, cfg.seed)
    rules = read_json_file(policy_dir(cfg.device, cfg.draft) / "rules.json", "tuned rules", keys=("best_rule",))
    rule = rules_policy(rules["best_rule"], profile, train, 8, cfg.draft)
    hidden = parse_ints(cfg.hidden, "--hidden")
    base = replay_evaluate({"rule": rule}, val, cost, 8, hardware, 1, cfg.max_new_tokens)["rule"]["speedup"]
    print(f"{len(val)} held-out train prompts, one row; the best tuned rule: {base:.4f}x plain")
    print(f"{'fitted on':>22}{'passes':>7}{'entropy':>9}{'held-out':>10}")
    arms = [("the rest", fit_on)] + ([(f"the rest + {len(added)} extra", fit_on + added)] if added else [])
    for name, episodes in arms:
        first = collect(rule, episodes, cost, 8, hardware, [1], {1: len(episodes)}, cfg.max_new_tokens, seed=0,
                        progress=True, workers=0)
        fitted = as_policy(*fit(first, hidden, "tanh", 200, seed=0), "tanh", 8)
        second = collect(fitted, episodes, cost, 8, hardware, [1], {1: len(episodes)}, cfg.max_new_tokens, seed=1,
                         progress=True, follow=fitted, workers=0)
        data = merge(first, second)
        for passes in parse_ints(cfg.passes, "--passes"):
            for bonus in [float(v) for v in cfg.entropy.split(",") if v.strip()]:
                policy = as_policy(*fit(data, hidden, "tanh", passes, seed=0, entropy=bonus), "tanh", 8)
                score = replay_evaluate({"p": policy}, val, cost, 8, hardware, 1, cfg.max_new_tokens)["p"]["speedup"]
                print(f"{name:>22}{passes:>7}{bonus:>9.3f}{score:>9.4f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(fit_check_main))
