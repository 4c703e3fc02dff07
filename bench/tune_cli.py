"""The tune command: `python scripts/tune_rules.py --device cpu --draft ngram` tunes every engine's k rule
on the train split (a small grid on the noise-free replay env) and writes the best parameters per batch
size where the benchmark reads them (`policies/<device>/<draft>/rules.json`: policies `best-rule` and
`rule:FAMILY`). Nothing is tuned on the test, ood or outside split."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specpilot.decoding.hardware import artifact_key
from specpilot.decoding.config import ReplayInputs, at_least, parse_config, parse_ints, warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import (
    atomic_write_text,
    output_dir,
    profile_path,
    relative,
    rules_path,
    traces_path,
)
from specpilot.decoding.policies import DEFAULT_K_MAX, LengthPolicy, PerBatchK
from specpilot.decoding.policy_spec import parse_policy
from specpilot.env.oracle import (
    CostModel,
    load_draft_traces,
    load_profile,
    profile_hardware,
    traces_report_confidence,
    train_traces,
    truncate,
)
from specpilot.env.replay_env import replay_evaluate

from .batch_table import BatchTableK

FAMILIES = ("static", "heuristic", "batch-table", "match", "sglang-adaptive", "trtllm", "p-min", "transformers-roc",
            "svip", "adaedl", "bandit-ucb")


@dataclass
class TuneConfig(ReplayInputs):
    """Tune the engines' k rules on the train split (replay env, noise-free) for one device and draft."""

    target: str = "embedded"
    """The target whose profile, traces and rules these are (see generate --target; e.g. llama.cpp:embedded, whose
    artifacts are keyed apart from the torch loop's)."""
    profile: str | None = None
    """Cost profile (default: the device's for --target and --draft)."""
    traces: str | None = None
    """Acceptance traces (default: the draft's at --temperature); only their train split is used."""
    temperature: float = 0.0
    """Tune for sampled decoding at this temperature, on the traces recorded at it (profile_device --temperature;
    prompt-lookup drafts); 0: greedy."""
    batch_sizes: str = "1,2,4,8,16"
    """Batch sizes to tune at (each gets its own best parameters)."""
    max_new_tokens: int = 48
    """Tokens per row in the replay (the budget the benchmark uses)."""
    k_max: int = DEFAULT_K_MAX
    """Largest k any rule may choose."""
    out: str | None = None
    """JSON to write (default: policies/DEVICE/DRAFT/rules.json, rules-tT.json for a temperature T > 0)."""
    progress: bool = True
    """Show a progress bar."""


def grid(k_max: int, confident: bool, hybrid: bool = False) -> dict[str, list[str]]:
    """The candidate spellings of each family (batch-table has no parameter: built from the profile). The rules that
    read the draft's confidence (llama.cpp's p-min, transformers' self-tuning threshold, SVIP, AdaEDL) are tuned
    for a draft that reports one (`confident`: a model draft; prompt lookup's is always 1, and its match rules read
    the n-gram match instead). For the hybrid drafter (`hybrid`) the single-source rules run its default source
    (the extension) and the source rules of decoding/hybrid.py join them (`hybrid_grid`)."""
    if hybrid:
        return {**{f: c for f, c in grid(k_max, False).items() if f != "match"}, **hybrid_grid(k_max)}
    ngram = not confident
    ks = range(1, k_max + 1)
    caps = sorted({k for k in (2, 3, 4, 6, 8) if k <= k_max} | {k_max})  # the largest k a stop rule may draft
    cands = [c for c in ("1/3/7", "1/2/4", "2/4/8", "1/4/8", "1/2/3/4/5/6/7/8") if max(map(int, c.split("/"))) <= k_max]
    return {
        "static": [f"static:{k}" for k in range(k_max + 1)],  # static:0 = plain decoding (a table may say 0)
        "heuristic": ["heuristic"],
        "batch-table": ["batch-table"],
        "match": [f"match:{n}:{k}" for n in (1, 2, 3, 4) for k in ks if k >= 2] if ngram else [],
        "sglang-adaptive": [f"sglang-adaptive:{c}:{a}" for c in cands for a in (0.2, 0.5)],
        "trtllm": [f"trtllm:{k}" + (f":{w}:{t}" if w else "") for k in range(k_max + 1) for w, t in
                   [(0, 0)] + [(w, t) for w in (4, 16) for t in (0.1, 0.3, 0.5)]],
        "p-min": [] if ngram else [f"confidence:{p}:{k}" for p in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8) for k in caps],
        "transformers-roc": [] if ngram else [f"transformers-roc:{t}:{k}" for t in (0.2, 0.4, 0.6) for k in caps],
        "svip": [] if ngram else [f"entropy:{h}:{k}" for h in (0.5, 1, 2, 3) for k in caps],
        "adaedl": [] if ngram else [f"adaedl:{g}:{lam}:{k}" for g in (1, 2) for lam in (0.3, 0.5, 0.7) for k in caps],
        "bandit-ucb": [f"bandit-ucb:{'/'.join(map(str, arms))}:{c}" for arms in ([0, 1, 2, 3, 4], list(range(k_max + 1)))
                       for c in (0.1, 0.3) if max(arms) <= k_max],
    }


def hybrid_grid(k_max: int) -> dict[str, list[str]]:
    """The source rules' candidates (decoding/hybrid.py): SAM's match threshold, Arctic's score, llama.cpp's
    best-of-speculators, a UCB bandit over (source, k) arms, and each single source at a fixed k (the head's with
    a p-min stop), every k within k_max."""
    lookup = [k for k in (2, 4, 6, 8) if k <= k_max]
    head = [k for k in (1, 2, 3) if k <= k_max]
    stops = ("", ":0.3", ":0.5")
    arms = ["lookup=8/head=2/extend=4", "lookup=4/head=1/extend=3", "lookup=8/head=1", "lookup=2/head=1/extend=2"]
    return {
        "hybrid-sam": [f"hybrid-sam:{n}:{kl}:{kh}{p}" for n in (1, 2, 3, 4) for kl in lookup for kh in head for p in stops],
        "hybrid-score": [f"hybrid-score:{kl}:{kh}{p}" for kl in lookup for kh in head for p in stops],
        "hybrid-best": [f"hybrid-best:{kl}:{kh}{p}" for kl in lookup for kh in head for p in stops],
        "hybrid-ucb": [f"hybrid-ucb:{a}:{c}" for a in arms for c in (0.1, 0.3)
                       if max(int(x.partition("=")[2]) for x in a.split("/")) <= k_max],
        "source-lookup": [f"source:lookup:{k}" for k in range(1, k_max + 1)],
        "source-head": [f"source:head:{k}{p}" for k in range(1, min(4, k_max) + 1) for p in ("", ":0.2", ":0.4", ":0.6")],
        "source-extend": [f"source:extend:{k}" for k in range(1, k_max + 1)],
    }


def tune(policies: dict[str, LengthPolicy], families: dict[str, list[str]], traces, cost, k_max: int, hardware,
         sizes: list[int], max_new_tokens: int, progress: bool = True) -> dict:
    """{"speedups": {b: {spelling: speedup}}, "best": {family: {b: spelling}}}: per batch size, each
    family's best spelling on these traces."""
    speedups = {}
    for b in tqdm(sizes, desc="tune", disable=not progress, file=sys.stderr):
        scores = replay_evaluate(policies, traces, cost, k_max, hardware, b, max_new_tokens)
        speedups[b] = {name: round(float(row["speedup"]), 5) for name, row in scores.items()}
    best = {family: {b: max(names, key=lambda n: speedups[b][n]) for b in sizes}
            for family, names in families.items() if names}
    if "trtllm" in best:  # one window / threshold for the whole schedule (one engine config), k per batch size
        cutoffs = sorted({n.partition(":")[2].partition(":")[2] for n in families["trtllm"]})

        def with_cutoff(cut: str) -> dict[int, str]:
            return {b: max((n for n in families["trtllm"] if n.partition(":")[2].partition(":")[2] == cut),
                           key=lambda n: speedups[b][n]) for b in sizes}

        cut = max(cutoffs, key=lambda c: sum(math.log(speedups[b][n]) for b, n in with_cutoff(c).items()))
        best["trtllm"] = with_cutoff(cut)
    overall = {b: max((best[f][b] for f in best), key=lambda n: speedups[b][n]) for b in sizes}
    return {"speedups": speedups, "best": best, "best_rule": overall}


def tune_rules(traces, profile: dict, draft: str, k_max: int, hardware, sizes: list[int], max_new_tokens: int,
               progress: bool = True) -> dict:
    """Every family's grid (see `grid`) on these traces with this profile's cost model: see `tune`."""
    families = grid(k_max, traces_report_confidence(traces), hybrid=any(t.sources for t in traces))
    policies: dict[str, LengthPolicy] = {"none": parse_policy("none")}
    for names in families.values():
        for name in names:
            policies[name] = (BatchTableK.from_profile(profile, traces, k_max) if name == "batch-table"
                              else parse_policy(name, k_max, draft=draft))
    return tune(policies, families, traces, CostModel.from_profile(profile), k_max, hardware, sizes, max_new_tokens,
                progress)


def rules_policy(by_batch: dict, profile: dict, traces, k_max: int, draft: str, name: str = "best-rule") -> PerBatchK:
    """A tuned rule as a policy: {batch size: spelling} (a rules.json entry) -> PerBatchK; `batch-table`
    is built from the profile and these (train-split) traces."""
    made = {int(b): BatchTableK.from_profile(profile, traces, k_max) if spec == "batch-table"
            else parse_policy(spec, k_max, draft=draft) for b, spec in by_batch.items()}
    policy = PerBatchK(made, name)
    policy.table = {int(b): spec for b, spec in by_batch.items()}
    return policy


def tune_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(TuneConfig, argv)
    cfg.device = artifact_key(cfg.device)  # 'cpu' -> this CPU's machine key
    at_least(1, max_new_tokens=cfg.max_new_tokens, k_max=cfg.k_max)
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes")
    source = Path(cfg.profile) if cfg.profile else profile_path(cfg.device, cfg.draft, cfg.target)
    profile = load_profile(source)
    traces, meta = load_draft_traces(cfg.traces or traces_path(cfg.draft, cfg.temperature, cfg.target), cfg.draft, cfg.max_new_tokens,
                                     cfg.temperature)
    traces = [truncate(t, cfg.max_new_tokens) for t in train_traces(traces, meta)]
    if max(sizes) > 1 and not profile.get("batch_sizes"):
        raise SpecPilotError(f"the cost profile {source} has no batch sizes; rerun scripts/profile_device.py")
    warn(CostModel.from_profile(profile).outside(sizes))
    result = tune_rules(traces, profile, cfg.draft, cfg.k_max, profile_hardware(profile), sizes, cfg.max_new_tokens,
                        cfg.progress)
    out = Path(cfg.out) if cfg.out else rules_path(cfg.device, cfg.draft, cfg.temperature, output_dir("policies"), cfg.target)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = BatchTableK.from_profile(profile, traces, cfg.k_max).table  # what `batch-table` means in these rules
    doc = {"device": cfg.device, "draft": cfg.draft, "target": cfg.target, "temperature": cfg.temperature, "split": "train", "traces": len(traces),
           "profile": relative(source), "max_new_tokens": cfg.max_new_tokens, "k_max": cfg.k_max,
           "note": "per batch size, each engine rule's best spelling on the train-split replay (noise-free); "
                   "best_rule: the best of them; batch_table: vLLM's batch-table rule built from this profile", **result,
           "batch_table": {str(b): k for b, k in table.items()}}
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    print(f"tuned on {len(traces)} train-split traces, {cfg.max_new_tokens} tokens, cost profile {relative(source)}; "
          "replay speedup over plain of each family's best, per batch size:")
    print(f"{'family':<16}" + "".join(f"{'B=' + str(b):>34}" for b in sizes))
    for family, by_b in {**result["best"], "best-rule": result["best_rule"]}.items():
        print(f"{family:<16}" + "".join(f"{by_b[b]:>27} {result['speedups'][b][by_b[b]]:.3f}x" for b in sizes))
    print(f"written: {out}")
    return 0
