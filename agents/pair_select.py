"""Which draft a device decodes with (`--draft auto`): `python -m specpilot.agents.pair_select --device cpu`, and the
first phase of `python scripts/train_policy.py --draft auto`.

Every candidate draft runs its own tuned rule (policies/DEVICE/PAIR/rules.json, one row: each pair's strongest
simple rule, there before any policy is trained) in the real loop, interleaved with plain decoding, on train
prompts that the train command's phase selection holds out (`select.held_out`) and that no candidate's head was
distilled on; the fastest over plain, paired within each repeat, is written to policies/DEVICE/auto/choice.json
(`decoding.paths.draft_choice_path`), which `--draft auto` reads. The test and ood splits are never read."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specpilot.bench.benchmark import run_benchmark
from specpilot.bench.paired_cli import paired_ratios
from specpilot.decoding.config import ModelOptions, at_least, parse_config
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import device_of
from specpilot.decoding.models import draft_name, load_draft, load_target
from specpilot.decoding.paths import atomic_write_text, draft_choice_path, output_dir, read_json_file, relative, rules_path
from specpilot.decoding.policies import NoSpeculation
from specpilot.decoding.policy_spec import parse_policy
from specpilot.decoding.prompts import load_prompts, per_category

from .select import held_out

CANDIDATES = "ngram:3,default,hybrid"


@dataclass
class PairConfig(ModelOptions):
    """Choose this device's draft: each candidate's tuned rule in the real loop on held-out train prompts, the fastest
    recorded for `--draft auto`."""

    target: str = "embedded"
    """Target model (see generate --target); the choice is keyed by it, as policies are."""
    drafts: str = CANDIDATES
    """Comma-separated candidate drafts. One without tuned rules for this device (scripts/tune_rules.py) or that the
    target cannot run (a head on a target without hidden states) is left out, with the reason."""
    holdout: float = 0.2
    """Share of the train prompts the choice may use, by question id (the train command's `select_holdout`)."""
    per_category: int = 1
    """Prompts per category of those (0 = all)."""
    repeats: int = 2
    """Paired repeats (policies interleaved)."""
    max_new_tokens: int = 48
    """Tokens per prompt."""
    prompts: str | None = None
    """Prompt JSONL (default: the project's set); only its train split is read."""
    out: str = ""
    """Root of the choice: OUT/DEVICE/auto/choice.json (default: policies/ in the working directory when it has one,
    else the user folder)."""
    progress: bool = True
    """Show a progress bar."""


def candidate_rules(cfg: PairConfig, device_key: str, target) -> tuple[dict, dict[str, str]]:
    """({draft name: (drafter, one-row rule policy, rule spelling)}, {draft name: why it was left out})."""
    found, skipped = {}, {}
    for spec in [d.strip() for d in cfg.drafts.split(",") if d.strip()]:
        name = draft_name(spec)
        if spec == "auto" or name in found:
            raise SpecPilotError(f"--drafts: '{spec}' is not a candidate (each draft once, 'auto' is the choice itself)")
        path = rules_path(device_key, name, target=target.name)
        if not path.exists():
            skipped[name] = (f"no tuned rules ({relative(path)}: python scripts/tune_rules.py --device {device_key} "
                             f"--draft {spec})")
            continue
        rules = read_json_file(path, "tuned rules", keys=("best_rule",))
        spelling = rules["best_rule"].get("1")
        if spelling is None or spelling == "batch-table":
            skipped[name] = f"no one-row rule in {relative(path)}"
            continue
        try:
            drafter = load_draft(spec, target, cfg.dtype)
        except SpecPilotError as e:
            skipped[name] = str(e)
            continue
        policy = parse_policy(spelling, int(rules.get("k_max") or 8), draft=name)
        policy.drafter = drafter  # the benchmark's DRAFT@POLICY: each candidate decodes with its own draft
        found[name] = (drafter, policy, spelling)
    return found, skipped


def choice_prompts(cfg: PairConfig, drafters: list) -> list:
    """The held-out train prompts no candidate's head learned from, `per_category` of each category."""
    train = load_prompts(cfg.prompts, "train")
    keep = held_out([p.question_id for p in train], cfg.holdout)
    seen = [s for s in (getattr(d, "distilled_on", None) for d in drafters) if s is not None]
    prompts = [p for p in train if p.question_id in keep and not any(s(p.question_id, p.category) for s in seen)]
    prompts = per_category(prompts, cfg.per_category)
    if not prompts:
        raise SpecPilotError(f"no train prompt is held out at --holdout {cfg.holdout:g} that no candidate's head was "
                             "distilled on: raise --holdout")
    return prompts


def choose_draft(cfg: PairConfig, command: str = "") -> tuple[str, Path]:
    """Run the choice, write it, print it; (the winning draft's name, the choice file)."""
    at_least(1, repeats=cfg.repeats, max_new_tokens=cfg.max_new_tokens)
    if not 0.0 < cfg.holdout < 1.0:
        raise SpecPilotError(f"--holdout is a share in (0, 1), got {cfg.holdout:g}")
    target = load_target(cfg.target, cfg.dtype, cfg.device, cfg.gemm, cfg.threads)
    device_key, hardware_name = device_of(str(target.device))
    found, skipped = candidate_rules(cfg, device_key, target)
    for name, why in skipped.items():
        print(f"specpilot: pair choice: '{name}' left out: {why}", file=sys.stderr)
    if not found:
        raise SpecPilotError(f"no candidate draft of '{cfg.drafts}' can run here (see above)")
    prompts = choice_prompts(cfg, [d for d, _, _ in found.values()])
    policies = {"none": NoSpeculation(), **{name: policy for name, (_, policy, _) in found.items()}}
    print(f"specpilot: pair choice on {len(prompts)} held-out train prompts x {cfg.repeats} repeats, "
          f"{cfg.max_new_tokens} tokens: " + ", ".join(f"{n} ({s})" for n, (_, _, s) in found.items()), file=sys.stderr)
    runs = [asdict(r) for r in run_benchmark(target, None, policies, prompts, cfg.max_new_tokens, cfg.repeats,
                                             progress=cfg.progress)]
    scores = {}
    for name, (_, _, spelling) in found.items():
        cell = paired_ratios(runs, name, "none")["B=1"]
        scores[name] = {"rule": spelling, "speedup": cell["ratio"], "interval": cell["interval"]}
    winner = max(scores, key=lambda n: scores[n]["speedup"])
    root = Path(cfg.out) if cfg.out else output_dir("policies")
    path = draft_choice_path(device_key, target.name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({
        "draft": winner, "device": device_key, "hardware": hardware_name, "target": target.name, "split": "train",
        "holdout": cfg.holdout, "prompts": [p.question_id for p in prompts], "repeats": cfg.repeats,
        "max_new_tokens": cfg.max_new_tokens, "by": "each draft's tuned one-row rule over plain decoding, real loop",
        "scores": scores, "left_out": skipped, "command": command}, indent=1) + "\n")
    print("specpilot: pair choice: " + ", ".join(
        f"{n} {s['speedup']:.3f}x" + (" [{:.3f}, {:.3f}]".format(*s["interval"]) if s["interval"] else "")
        for n, s in sorted(scores.items(), key=lambda x: -x[1]["speedup"]))
        + f" plain -> '{winner}' ({relative(path)})", file=sys.stderr)
    return winner, path


def pair_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PairConfig, argv)
    choose_draft(cfg, "python -m specpilot.agents.pair_select " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(pair_main())
