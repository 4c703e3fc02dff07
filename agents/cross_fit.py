"""Which training recipe holds on train prompts it never saw: `python -m specpilot.agents.cross_fit` (about 90 minutes on
2 CPU cores for two recipes, four folds, two seeds).

Selecting a policy by its speed on its own training prompts rewards what it memorised (the in-sample selection
and three held-out splits disagreed: reports/README.md, "The warm start"). This splits the train split into folds (every
`folds`-th prompt of each category), trains each recipe's warm start (the device's YAML block: rounds, net,
passes, episodes, labels; each seed, then the mean of their logits, as `train_policy.py` does; simulated machine
conditions are not drawn, which the CPU block does not use) on all folds but one and
scores it with the replay on the one left out, beside the best tuned rule, at every batch size; the folds'
scores are averaged, so every train prompt is scored once by a policy that never saw it. A recipe is the train
split minus the categories it drops (`all`, or `-CAT[+CAT...]`). The test, ood and outside splits are not
touched. Prints per recipe learned / best-rule at each batch size and their minimum (the selection rule), and
writes the same as JSON."""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass

from specpilot.bench.tune_cli import rules_policy
from specpilot.decoding.hardware import artifact_key
from specpilot.decoding.config import ReplayInputs, parse_config, parse_ints, run_cli
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import Checkpoint, atomic_write_text, policy_dir, profile_path, read_json_file, traces_path
from specpilot.env.oracle import CostModel, load_profile, load_traces, profile_hardware, train_traces, truncate
from specpilot.env.replay_env import replay_evaluate

from .ensemble import merge
from .improve import as_policy, improve_policy
from .ppo import load_hyperparams
from .train_plan import rollout_episodes


@dataclass
class CrossFitConfig(ReplayInputs):
    """Score training recipes on held-out folds of the train split (replay, every batch size)."""

    recipes: str = "all,-passage_translation"
    """Comma-separated recipes: `all` (every train prompt) or `-CAT[+CAT...]` (without these categories)."""
    folds: int = 4
    """Folds of the train split (every folds-th prompt of each category is in one fold)."""
    seeds: str = "2,1"
    """Seeds trained per fold and recipe; their mean is the fold's policy."""
    batch_sizes: str = "1,2,4,8,16"
    """Batch sizes scored (and trained)."""
    max_new_tokens: int = 48
    """Tokens per row."""
    out: str = "runs/cross_fit.json"
    """JSON written with every fold's and recipe's scores."""
    progress: bool = True
    """Show progress bars."""
    resume: bool = False
    """Continue an interrupted run: each finished fold of a recipe is kept in OUT.checkpoint.jsonl as it ends, and
    only the rest are trained (refused when the file comes from other settings)."""


def fold_of(traces) -> dict[str, int]:
    """{question id: fold number}: the i-th trace of each category (in file order) goes to fold i mod folds."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for t in traces:
        out[t.question_id] = seen[t.category]
        seen[t.category] += 1
    return out


def recipe_filter(recipe: str):
    """`all` -> keep everything; `-a+b` -> drop categories a and b."""
    if recipe == "all":
        return lambda t: True
    if not recipe.startswith("-") or not recipe[1:]:
        raise SpecPilotError(f"--recipes takes `all` or `-CAT[+CAT...]`, got '{recipe}'")
    dropped = set(recipe[1:].split("+"))
    return lambda t: t.category not in dropped


def cross_fit(traces, recipes: list[str], folds: int, train_fold, score, batch_sizes: list[int],
              done: dict | None = None, on_fold=None) -> dict:
    """{recipe: {"folds": [{batch size: (learned, rule)}...], "ratio": {b: mean learned / rule}, "min": ...}}.
    `train_fold(fit_traces) -> policy` trains one recipe's policy; `score(policy, traces, b) -> (learned, rule)`
    replays it beside the rule on the held-out fold. `done` {(recipe, fold): its row} skips folds already scored
    (a resumed run); `on_fold(recipe, fold, row)` is called as each new one ends."""
    where = fold_of(traces)
    done = done or {}
    results = {}
    for recipe in recipes:
        keep = recipe_filter(recipe)
        rows = []
        for f in range(folds):
            if (recipe, f) in done:
                rows.append(done[(recipe, f)])
                continue
            held = [t for t in traces if where[t.question_id] % folds == f]
            fit_on = [t for t in traces if where[t.question_id] % folds != f and keep(t)]
            if not held or not fit_on:
                raise SpecPilotError(f"fold {f} of recipe '{recipe}' has nothing to {'score' if not held else 'train'} on")
            policy = train_fold(fit_on)
            rows.append({b: score(policy, held, b) for b in batch_sizes})
            if on_fold:
                on_fold(recipe, f, rows[-1])
        ratio = {b: sum(r[b][0] / r[b][1] for r in rows) / folds for b in batch_sizes}
        results[recipe] = {"folds": rows, "ratio": ratio, "min": min(ratio.values())}
    return results


def cross_fit_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(CrossFitConfig, argv)
    cfg.device = artifact_key(cfg.device)  # 'cpu' -> this CPU's machine key
    if cfg.folds < 2:
        raise SpecPilotError(f"--folds must be >= 2, got {cfg.folds}")
    sizes, seeds = parse_ints(cfg.batch_sizes, "--batch-sizes"), parse_ints(cfg.seeds, "--seeds", minimum=0)
    recipes = [r.strip() for r in cfg.recipes.split(",") if r.strip()]
    for r in recipes:
        recipe_filter(r)
    hp = load_hyperparams(cfg.device)
    profile = load_profile(profile_path(cfg.device, cfg.draft))
    cost, hardware = CostModel.from_profile(profile), profile_hardware(profile)
    traces, meta = load_traces(traces_path(cfg.draft))
    train = [truncate(t, cfg.max_new_tokens) for t in train_traces(traces, meta)]
    k_max = int(hp["k_max"])
    rules = read_json_file(policy_dir(cfg.device, cfg.draft) / "rules.json", "tuned rules", keys=("best_rule",))
    rule = rules_policy(rules["best_rule"], profile, train, k_max, cfg.draft)

    def train_fold(fit_on):
        per_b = {b: min(len(fit_on), n) for b, n in rollout_episodes(hp, sizes).items()}
        members = []
        for seed in seeds:
            layers, norm, _ = improve_policy(rule, fit_on, cost, k_max, hardware, sizes, per_b, cfg.max_new_tokens,
                                             int(hp["rollout_rounds"]), list(hp["net_arch"]), str(hp["activation"]),
                                             int(hp["rollout_epochs"]), seed=seed, progress=cfg.progress,
                                             workers=int(hp.get("rollout_workers") or 0),
                                             context_lens=[int(c) for c in hp.get("context_lens") or []],
                                             cost_jitter=float(hp.get("replay_cost_jitter") or 0.0),
                                             labels=str(hp.get("warm_start_labels") or "rollout"))
            members.append(as_policy(layers, norm, str(hp["activation"]), k_max))
        return members[0] if len(members) == 1 else as_policy(*merge(members), str(hp["activation"]), k_max)

    def score(policy, held, b):
        got = replay_evaluate({"learned": policy, "rule": rule}, held, cost, k_max, hardware, b, cfg.max_new_tokens)
        return got["learned"]["speedup"], got["rule"]["speedup"]

    signature = {k: v for k, v in vars(cfg).items() if k not in ("progress", "resume")}
    signature.update(hyperparams=hp, rule=rules["best_rule"], prompts=[t.question_id for t in train])
    keep = Checkpoint(f"{cfg.out}.checkpoint.jsonl", signature, cfg.resume, "cross-fit")
    done = {(x["recipe"], x["fold"]): {int(b): tuple(v) for b, v in x["row"].items()} for x in keep.rows}
    if done:
        print(f"resuming: {len(done)} fold(s) already scored in {keep.path}")
    results = cross_fit(train, recipes, cfg.folds, train_fold, score, sizes, done,
                        lambda recipe, f, row: keep.append({"recipe": recipe, "fold": f, "row": row}))
    print(f"{len(train)} train prompts in {cfg.folds} folds, each scored by policies that never saw it; learned / best-rule")
    print(f"{'recipe':<28}" + "".join(f"{'B=' + str(b):>8}" for b in sizes) + f"{'min':>8}")
    for recipe, row in results.items():
        print(f"{recipe:<28}" + "".join(f"{row['ratio'][b]:>8.3f}" for b in sizes) + f"{row['min']:>8.3f}")
    atomic_write_text(cfg.out, json.dumps({"config": vars(cfg), "results": results}, indent=1, default=str))
    keep.remove()
    print(f"written: {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(cross_fit_main))
