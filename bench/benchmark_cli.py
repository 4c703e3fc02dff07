"""The benchmark command: `python scripts/benchmark.py --policies ... [--batch-sizes ...] [--replay]`."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specpilot.decoding.config import ModelOptions, at_least, parse_config, parse_ints, warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import device_of
from specpilot.decoding.hybrid import SOURCES
from specpilot.decoding.models import load_draft, load_target, resolve_torch_device
from specpilot.decoding.paths import atomic_write_text, profile_path, relative, traces_path
from specpilot.decoding.policies import PerBatchK
from specpilot.decoding.policy_spec import parse_policy, tuned_rule
from specpilot.decoding.rule_spec import resolve_k_max
from specpilot.decoding.prompts import load_prompts, per_category
from specpilot.decoding.sampling import Sampling
from specpilot.env.oracle import (
    CostModel,
    OracleK,
    load_draft_traces,
    load_profile,
    profile_hardware,
    train_traces,
    truncate,
)
from specpilot.env.replay_env import cost_shape, replay_evaluate
from specpilot.env.sources import SourceOracleK

from .batch_table import BatchTableK
from .benchmark import (
    batch_markdown_report,
    format_batch_table,
    format_paired_table,
    format_table,
    markdown_report,
    run_batch_benchmark,
    run_benchmark,
    summarize,
    summarize_batches,
    format_loads_table,
    loads_markdown_report,
    summarize_loads,
    write_results,
)
from specpilot.env.load import LOADS
from .paired_cli import paired_ratios, versus_markdown
from .plots import plot_batch_benchmark, plot_benchmark, plot_load_benchmark
from .replay_check import format_check, machine_speed_warning, plain_speed_ratio, replay_check
from .report import write_report


@dataclass
class BenchmarkConfig(ModelOptions):
    """Benchmark length policies side by side (interleaved, medians) on a prompt set."""

    policies: str = "none,static:1,static:2,static:4,static:8,heuristic,confidence:0.5"
    """Comma-separated policies; static:A..B expands to every k in the range; also oracle, batch-table,
    best-rule (per batch size the best engine rule tuned on the train split) and rule:FAMILY. DRAFT@POLICY runs
    a policy with a drafter of its own (e.g. ngram:3@learned beside --draft hybrid; the real loop only)."""
    draft: str = "ngram"
    """Drafter for every speculative policy (see generate --draft)."""
    target: str = "embedded"
    """Target model (see generate --target)."""
    prompts: str | None = None
    """Prompt JSONL file (default: the project's set)."""
    split: str = "test"
    """Which split of the prompt file: train | test | ood (styles unlike the train split, never tuned on) | outside
    (the six kinds of the outside check, written after ood was looked at; never tuned on or chosen by) | all."""
    per_category: int = 0
    """Use at most this many prompts per category (0 = all)."""
    repeats: int = 1
    """Runs of every (policy, prompt) pair; the median time counts. The policy order rotates from batch to batch
    and repeat to repeat; with fewer batches of a size than policies, a multiple of the number of policies puts
    every policy in every position equally often (else a warning says so)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    k_max: int | None = None
    """Largest draft length a policy may choose (default: a learned policy's own k_max, else 8; a value
    that differs from a learned policy's is an error: its features are scaled by the k_max it was trained with)."""
    chat: bool = True
    """Wrap prompts in the chat template."""
    temperature: float = 0.0
    """0 = greedy (also checks losslessness against plain decoding)."""
    out: str = "runs/benchmark"
    """Folder for results.json and benchmark.png."""
    report: str | None = None
    """Also write a markdown report here (e.g. reports/cpu.md; the plot and JSON are copied beside it)."""
    profile: str | None = None
    """Cost profile for the oracle, the batch table and --replay (default: profiles/DEVICE[-DRAFT].json)."""
    traces: str | None = None
    """Acceptance traces for the oracle (default: profiles/traces-DRAFT.json)."""
    batch_sizes: str = ""
    """Comma-separated batch sizes (e.g. 1,2,4,8,16): benchmark batched decoding instead, the prompts
    taken B at a time and decoded together, every policy on the same batches (policy batch-table: the
    per-batch-size table built from the cost profile and the train traces)."""
    replay_check: bool = False
    """Sim-to-real check: run each policy on the real loop and on the replay of the same batches and
    print the k it chose in each, the observation features that differ most, and each real step's seconds
    against the cost profile's price for it, by k relative to the plain steps (needs the traces)."""
    replay: bool = False
    """Instead of timing the real loop, evaluate the policies on the recorded traces with the device's
    cost model, without noise (the replay env PPO pre-trains on): seconds instead of minutes."""
    cost_jitter: float = 0.0
    """With --replay: also replay under --cost-draws cost curves, each k >= 1 priced exp(s (u + z_k)) times the
    profile's (u, z_k standard normal, seeded; env/replay_env.py's cost_jitter): a profile is one draw of what a
    step costs, and a policy that leans on a bump of it loses when the next measurement moves it. Prints each
    policy's speedup over --versus (else plain) under the draws: mean, worst, 10th percentile."""
    cost_draws: int = 20
    """Cost curves drawn with --cost-jitter."""
    rules: str | None = None
    """Tuned rules for the policies best-rule and rule:FAMILY (default: policies/DEVICE/DRAFT/rules.json,
    written by scripts/tune_rules.py on the train split)."""
    progress: bool = True
    """Show a progress bar."""
    versus: str | None = None
    """Also compare every policy with this one (e.g. best-rule): their tokens/s ratio paired within each repeat,
    with an interval, in the printout and the report (bench/paired_cli.py)."""
    resume: bool = False
    """Continue an interrupted real-loop run: each finished batch is kept in OUT/checkpoint.jsonl as it ends, and
    with --resume those batches are not run again (the same command is required; the file goes once the
    results are written)."""
    background_load: str = "none"
    """Comma-separated background loads to run every policy under, e.g. none,compute,memory (env/load.py:
    compute = one core of matrix multiplies, memory = a stream of large copies, both): each repeat runs the
    whole plan under each load in turn, the load started and stopped by the benchmark (never left running,
    not even when it is killed); speedups are over plain decoding under the same load."""


def expand_policies(text: str) -> list[str]:
    names = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, arg = part.partition(":")
        if ".." in arg:
            lo, _, hi = arg.partition("..")
            try:
                names += [f"{name}:{k}" for k in range(int(lo), int(hi) + 1)]
            except ValueError:
                raise SpecPilotError(f"bad policy range '{part}'; expected e.g. static:1..8") from None
        else:
            names.append(part)
    return names


def _other_draft(cfg, name: str, target, draft, loaded: dict = {}):  # noqa: B006 (one drafter per spelling)
    """The drafter of `DRAFT@POLICY` (loaded once per spelling), else the run's --draft. Its policies run in the
    real loop only: --replay, --replay-check and the oracle read the run's draft's traces."""
    spec, at, _ = name.rpartition("@")
    if not at:
        return draft
    if cfg.replay or cfg.replay_check:
        raise SpecPilotError(f"policy '{name}' decodes with its own draft: --replay and --replay-check replay --draft's "
                             "traces only")
    if spec == cfg.draft:
        return draft
    key = (spec, id(target))
    if key not in loaded:
        loaded[key] = load_draft(spec, target, cfg.dtype)
        if loaded[key] is None:
            raise SpecPilotError(f"policy '{name}': 'none' is not a draft (benchmark 'none' itself for plain decoding)")
    return loaded[key]


def _traces_and_profile(cfg, device_key: str, draft, sampling) -> tuple[list, dict, dict]:
    """This draft's acceptance traces, their meta and the device's cost profile (for the oracle, the
    batch table and --replay). Sampled decoding reads the traces recorded at its temperature."""
    profile = load_profile(cfg.profile or profile_path(device_key, draft.name, cfg.target))
    traces, meta = load_draft_traces(cfg.traces or traces_path(draft.name, sampling.temperature, cfg.target), draft.name,
                                     cfg.max_new_tokens, sampling.temperature)
    return traces, meta, profile


def _oracle(cfg, device_key: str, draft, sampling, sources: str = "") -> OracleK | SourceOracleK:
    """The hindsight schedule of each traced prompt; for the hybrid drafter's traces over its sources (`oracle`) or
    some of them (`oracle:lookup`, `oracle:head/extend`: env.sources)."""
    if not sampling.greedy and not cfg.replay:
        raise SpecPilotError("the oracle's schedule is one continuation's: with sampling it runs in --replay only")
    traces, _, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    cost = CostModel.from_profile(profile)
    if any(t.sources for t in traces):
        chosen = tuple(sources.split("/")) if sources else SOURCES
        if not set(chosen) <= set(SOURCES):
            raise SpecPilotError(f"oracle:{sources}: the sources are {', '.join(SOURCES)} (e.g. oracle:lookup/head)")
        return SourceOracleK(traces, cost, cfg.k_max, cfg.max_new_tokens, chosen)
    if sources:
        raise SpecPilotError(f"oracle:{sources} chooses among a hybrid drafter's sources; draft '{draft.name}' has one")
    return OracleK(traces, cost, cfg.k_max, cfg.max_new_tokens)


def _batch_table(cfg, device_key: str, draft, sampling) -> BatchTableK:
    traces, meta, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    if not profile.get("batch_sizes"):
        raise SpecPilotError(f"the cost profile of {device_key} has no batch sizes; rerun scripts/profile_device.py")
    return BatchTableK.from_profile(profile, train_traces(traces, meta), cfg.k_max)


def _tuned_rule(cfg, name: str, device_key: str, draft, sampling) -> PerBatchK:
    """`best-rule` or `rule:FAMILY`: the rules tuned on the train split by scripts/tune_rules.py, one
    spelling per batch size (policies/DEVICE/DRAFT/rules.json or --rules): `policy_spec.tuned_rule`."""
    return tuned_rule(name, cfg.k_max, device_key, draft.name, cfg.target, sampling.temperature, cfg.rules or None)


def _command(argv: list[str] | None) -> str:
    """How a report says it was made: the command line, or the call when run from Python."""
    return "python scripts/benchmark.py " + " ".join(sys.argv[1:]) if argv is None else f"benchmark_main({argv!r})"


def _checkpoint(cfg) -> Path:
    """Where the real loop keeps its finished batches (bench.benchmark.run_batch_benchmark)."""
    return Path(cfg.out) / "checkpoint.jsonl"


def _range_report(policies: dict) -> dict:
    """{name: {"calls", "out_of_range", "non_finite", "clipped", "deferred"}} of the learned policies: decisions
    whose input was clipped into the trained range (policies that record it; "clipped": how often, per feature) or
    was not finite (k = 0 taken instead); "deferred": decisions its tuned rules made (LearnedK.defer)."""
    return {n: {"calls": p.calls, "out_of_range": p.out_of_range, "non_finite": p.non_finite,
                "clipped": p.clipped_features(), "deferred": p.deferred}
            for n, p in policies.items() if hasattr(p, "non_finite") and (p.calls or p.deferred)}


def _print_range_report(report: dict) -> None:
    for name, row in report.items():
        which = ", ".join(f"{f} {c}" for f, c in list(row["clipped"].items())[:3])
        print(f"{name}: {row['out_of_range']} of {row['calls']} decisions saw a feature outside its trained range "
              f"(clipped into it{': ' + which if which else ''}); {row['non_finite']} saw a non-finite one (k = 0 instead)"
              + (f"; {row['deferred']} more were made by its deferred rules" if row.get("deferred") else ""))


def _policy_sources(policies: dict) -> dict:
    """{name: where the policy came from}: a learned policy's path (relative), a table, or its name."""
    return {n: relative(p.path) if getattr(p, "path", None) else getattr(p, "table", None) or n for n, p in policies.items()}


def _versus(cfg, runs, summary: dict, markdown):
    """With --versus: each policy's paired ratio over it (summary["versus"], printed) and the report section."""
    if not cfg.versus:
        return markdown
    if cfg.versus not in summary["policies"]:
        raise SpecPilotError(f"--versus {cfg.versus} is not one of the policies run ({', '.join(summary['policies'])})")
    rows = [asdict(r) for r in runs]
    table = {p: paired_ratios(rows, p, cfg.versus) for p in summary["policies"] if p != cfg.versus}
    summary["versus"] = {"policy": cfg.versus, "cells": table}
    print(versus_markdown(cfg.versus, table))
    return lambda *args: markdown(*args) + versus_markdown(cfg.versus, table)


def _save(cfg, argv, runs, summary: dict, meta: dict, prefix: str, plot, markdown) -> Path:
    """OUT/{prefix}results.json and OUT/{prefix}benchmark.png (drawn by `plot(path)`), and with --report
    the report page (`markdown(summary, meta, plot name, command)`) with its plot and JSON."""
    markdown = _versus(cfg, runs, summary, markdown)
    path = write_results(cfg.out, runs, summary, meta, f"{prefix}results.json")
    png = path.parent / f"{prefix}benchmark.png"
    plot(png)
    if cfg.report:
        write_report(cfg.report, png, meta, summary, lambda plot_name: markdown(summary, meta, plot_name, _command(argv)),
                     [asdict(run) for run in runs])
    _checkpoint(cfg).unlink(missing_ok=True)  # everything it held is in the results now
    return path


def parse_loads(text: str) -> list[str]:
    """--background-load: distinct names of bench.load.LOADS."""
    loads = [p.strip() for p in text.split(",") if p.strip()]
    bad = [x for x in loads if x not in LOADS]
    if not loads or bad or len(set(loads)) != len(loads):
        raise SpecPilotError(f"--background-load takes distinct ones of {', '.join(LOADS)}, got '{text}'")
    return loads


def _loads_benchmark(cfg, target, draft, sampling, policies: dict, prompts, device_key, hardware_name, argv,
                     loads: list[str]) -> int:
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes else [1]
    runs = run_batch_benchmark(target, draft, policies, prompts, sizes, cfg.max_new_tokens, cfg.repeats, sampling,
                               cfg.chat, cfg.progress, loads, _checkpoint(cfg), cfg.resume)
    _speed_check(cfg, runs, prompts, target, device_key, draft)  # its unloaded runs
    summary = summarize_loads(runs, greedy=sampling.greedy)
    summary["input_range"] = _range_report(policies)
    meta = _run_meta(cfg, target, draft, prompts, device_key, hardware_name, policies, batch_sizes=sizes, loads=loads)
    path = _save(cfg, argv, runs, summary, meta, "load_", lambda png: plot_load_benchmark(summary, png),
                 loads_markdown_report)
    print(f"target {meta['target']} | draft {meta['draft']} | {len(prompts)} prompts ({cfg.split}) | batch sizes {sizes} | "
          f"loads {', '.join(loads)} | {cfg.repeats} repeats | {hardware_name}")
    print("speedup over plain under the same load, paired within each repeat: geometric mean [95% interval]")
    print(format_loads_table(summary))
    _print_range_report(summary["input_range"])
    print(f"results: {path}")
    return 0


def _run_meta(cfg, target, draft, prompts, device_key: str, hardware_name: str, policies: dict, **extra) -> dict:
    """What a real-loop run's JSON and report record of how it ran (the policies: where each came from)."""
    return {"target": target.name, "draft": getattr(draft, "name", None), "prompts": len(prompts), "split": cfg.split,
            "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "device": device_key, "hardware": hardware_name, **extra, "policies": _policy_sources(policies)}


def _speed_check(cfg, runs, prompts, target, device_key: str, draft) -> None:
    """Warn in one line when this machine's plain step is far from what its cost profile prices (a machine of the
    same key at another speed): the replay-tuned rules and policy then price another machine's steps."""
    path = Path(cfg.profile) if cfg.profile else profile_path(device_key, draft.name, cfg.target)
    if not path.exists() or cfg.temperature != 0:  # the profile prices greedy steps
        return
    lens = {p.question_id: len(target.encode(p.text, chat=cfg.chat)) for p in prompts}
    warn(machine_speed_warning(plain_speed_ratio(runs, lens, CostModel.from_profile(load_profile(path))), relative(path)))


def _batch_benchmark(cfg, target, draft, sampling, policies: dict, prompts, device_key, hardware_name, argv) -> int:
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes")
    runs = run_batch_benchmark(target, draft, policies, prompts, sizes, cfg.max_new_tokens, cfg.repeats, sampling,
                               cfg.chat, cfg.progress, checkpoint=_checkpoint(cfg), resume=cfg.resume)
    _speed_check(cfg, runs, prompts, target, device_key, draft)
    summary = summarize_batches(runs, greedy=sampling.greedy)
    summary["input_range"] = _range_report(policies)
    meta = _run_meta(cfg, target, draft, prompts, device_key, hardware_name, policies, batch_sizes=sizes)
    path = _save(cfg, argv, runs, summary, meta, "batch_", lambda png: plot_batch_benchmark(summary, png),
                 batch_markdown_report)
    print(f"target {meta['target']} | draft {meta['draft']} | {len(prompts)} prompts ({cfg.split}) | batch sizes {sizes} | "
          f"{cfg.max_new_tokens} new tokens per row | {hardware_name}")
    print(format_batch_table(summary))
    if cfg.repeats > 1:
        print("speedup over plain within each repeat (paired): geometric mean [95% interval]")
        print(format_paired_table(summary))
    _print_range_report(summary["input_range"])
    print(f"results: {path}")
    return 0


def _replay_benchmark(cfg, device_key: str, draft, sampling, policies: dict, prompts) -> int:
    traces, _, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    wanted = {p.question_id for p in prompts}
    traces = [truncate(t, cfg.max_new_tokens) for t in traces if t.question_id in wanted]
    if not traces:
        raise SpecPilotError("--replay: none of the chosen prompts has a recorded trace")
    hardware = profile_hardware(profile)
    cost = CostModel.from_profile(profile)
    measured_on = profile.get("device") or device_key  # (--profile may be another machine's)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes else [1]
    warn(cost.outside(sizes, max(len(t.prompt_ids) + len(t.output_ids) for t in traces)))
    if cfg.batch_sizes:
        by_size = {b: replay_evaluate(policies, traces, cost, cfg.k_max, hardware, b, cfg.max_new_tokens) for b in sizes}
        print(f"replay model (no timing noise): {len(traces)} traced prompts ({cfg.split}) taken B at a time, "
              f"{cfg.max_new_tokens} tokens, cost profile of {measured_on}, draft {draft.name}; speedup over plain at B")
        names = [n for n in policies if any(n in by_size[b] for b in sizes)]
        print(f"{'policy':<16}" + "".join(f"{'B=' + str(b):>9}" for b in sizes))
        for name in names:
            print(f"{name:<16}" + "".join(f"{by_size[b][name]['speedup']:>8.3f}x" if name in by_size[b] else f"{'-':>9}"
                                          for b in sizes))
        if "oracle" in policies and max(sizes) > 1:
            print("oracle: its hindsight schedule is per sequence, so it is shown at B = 1 only")
        jitter = _cost_jitter_report(cfg, policies, traces, cost, hardware, sizes)
        atomic_write_text(out / "replay_batch.json", json.dumps({"prompts": sorted(wanted), "results": by_size, **jitter},
                                                                indent=1))
        _print_range_report(_range_report(policies))
        return 0
    results = replay_evaluate(policies, traces, cost, cfg.k_max, hardware, max_new_tokens=cfg.max_new_tokens)
    print(f"replay model (no timing noise): {len(traces)} traced prompts ({cfg.split}), {cfg.max_new_tokens} tokens, "
          f"cost profile of {measured_on}, draft {draft.name}")
    print(f"{'policy':<16}{'speedup':>9}{'acc.rate':>9}" + (f"{'/oracle':>8}" if "oracle" in results else ""))
    for name, row in results.items():
        print(f"{name:<16}{row['speedup']:>8.3f}x{row['accept_rate']:>9.3f}"
              + (f"{row['fraction_of_oracle']:>8.3f}" if "oracle" in results else ""))
    jitter = _cost_jitter_report(cfg, policies, traces, cost, hardware, [1])
    atomic_write_text(out / "replay.json", json.dumps({"prompts": sorted(wanted), "results": results, **jitter}, indent=1))
    _print_range_report(_range_report(policies))
    return 0


def _cost_jitter_report(cfg, policies: dict, traces, cost, hardware, sizes: list[int]) -> dict:
    """--cost-jitter: each policy's speedup over --versus (else plain) under --cost-draws perturbed cost curves,
    per batch size, printed and returned as {"cost_jitter": ...} ({} without --cost-jitter). The oracle is left
    out: its schedule is optimal for the profile's curve, not for a perturbed one."""
    if not cfg.cost_jitter:
        return {}
    at_least(1, cost_draws=cfg.cost_draws)
    versus = cfg.versus if cfg.versus in policies else None
    rng = np.random.default_rng(0)
    shapes = [cost_shape(rng, cfg.k_max, cfg.cost_jitter) for _ in range(cfg.cost_draws)]
    names = [n for n in policies if n != "oracle"]
    ratios = {n: {} for n in names}
    for b in sizes:
        runs = [replay_evaluate({n: policies[n] for n in names}, traces, cost, cfg.k_max, hardware, b,
                                cfg.max_new_tokens, shape=shape) for shape in tqdm(shapes, desc=f"cost draws B={b}",
                                                                                     disable=not cfg.progress, leave=False)]
        for n in names:
            r = np.array([run[n]["speedup"] / (run[versus]["speedup"] if versus else 1.0) for run in runs])
            ratios[n][b] = {"mean": float(r.mean()), "worst": float(r.min()), "p10": float(np.percentile(r, 10))}
    print(f"under {cfg.cost_draws} cost curves with each k >= 1 jittered (sd {cfg.cost_jitter:g}, seed 0): speedup over "
          f"{versus or 'plain'}, mean [worst, 10th percentile]")
    print(f"{'policy':<16}" + "".join(f"{'B=' + str(b):>24}" for b in sizes))
    for n in names:
        print(f"{n:<16}" + "".join(f"{ratios[n][b]['mean']:>9.3f} [{ratios[n][b]['worst']:.3f}, {ratios[n][b]['p10']:.3f}]"
                                   for b in sizes))
    return {"cost_jitter": {"sd": cfg.cost_jitter, "draws": cfg.cost_draws, "versus": versus or "plain", "ratios": ratios}}


def _replay_check(cfg, target, device_key: str, draft, sampling, policies: dict, prompts) -> int:
    traces, _, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    by_id = {t.question_id: truncate(t, cfg.max_new_tokens) for t in traces}
    missing = [p.question_id for p in prompts if p.question_id not in by_id]
    if missing:
        raise SpecPilotError(f"--replay-check: no recorded trace for {', '.join(missing[:3])}; rerun scripts/profile_device.py")
    hardware = profile_hardware(profile)
    cost = CostModel.from_profile(profile)
    encoded = [target.encode(p.text, chat=cfg.chat) for p in prompts]
    results = []
    for b in parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes else [1]:
        for name, policy in policies.items():
            if name == "none" or hasattr(policy, "prepare"):
                continue
            result = replay_check(target, draft, policy, encoded, [by_id[p.question_id] for p in prompts], cost, b,
                                  cfg.max_new_tokens, cfg.k_max, hardware)
            print(format_check(name, result))
            results.append({"policy": name, **result})
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay_check.json").write_text(json.dumps({"prompts": [p.question_id for p in prompts], "results": results}, indent=1))
    return 0


def benchmark_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(BenchmarkConfig, argv)
    at_least(1, repeats=cfg.repeats, max_new_tokens=cfg.max_new_tokens)
    names = expand_policies(cfg.policies)
    loads = parse_loads(cfg.background_load)
    if cfg.cost_jitter < 0 or (cfg.cost_jitter and not cfg.replay):
        raise SpecPilotError(f"--cost-jitter is a standard deviation >= 0 that perturbs the --replay cost model, "
                             f"got {cfg.cost_jitter:g}" + ("" if cfg.replay else " without --replay"))
    if loads != ["none"] and (cfg.replay or cfg.replay_check):
        raise SpecPilotError("--background-load times the real loop; --replay and --replay-check time nothing")
    oracles = any(n.split(":")[0] == "oracle" for n in names)
    if oracles and loads != ["none"] and not cfg.replay:
        raise SpecPilotError("the oracle's schedule comes from the unloaded cost profile: leave it out of --background-load runs")
    if oracles and cfg.batch_sizes and not cfg.replay:
        raise SpecPilotError("the oracle's hindsight schedule is per sequence: run it without --batch-sizes, or with --replay")
    if "none" not in names:
        names.insert(0, "none")
    device_key, hardware_name = device_of(resolve_torch_device(cfg.device))
    sampling = Sampling(cfg.temperature)
    prompts = per_category(load_prompts(cfg.prompts, cfg.split), cfg.per_category)
    target = load_target(cfg.target, cfg.dtype, cfg.device, cfg.gemm, cfg.threads)
    draft = load_draft(cfg.draft, target, cfg.dtype)
    # DRAFT@POLICY: a policy that decodes with a drafter of its own (e.g. ngram:3@learned beside --draft hybrid)
    drafts = {n: _other_draft(cfg, n, target, draft) for n in names}
    learned = {n: parse_policy(n.rpartition("@")[2], allow_device_mismatch=cfg.allow_device_mismatch, device=device_key,
                               draft=drafts[n].name, target=target.name)
               for n in names if n.rpartition("@")[2].split(":")[0] in ("learned", "learned-mlp", "learned-idle-counters")}
    cfg.k_max = resolve_k_max(cfg.k_max, learned.values())
    policies = {}
    for n in names:
        own, spec = drafts[n], n.rpartition("@")[2]
        if n in learned:
            policies[n] = learned[n]
        elif spec.split(":")[0] == "oracle":
            policies[n] = _oracle(cfg, device_key, own, sampling, spec.partition(":")[2])
        elif spec == "batch-table":
            policies[n] = _batch_table(cfg, device_key, own, sampling)
        elif spec == "best-rule" or spec.startswith("rule:"):
            policies[n] = _tuned_rule(cfg, spec, device_key, own, sampling)
        else:
            policies[n] = parse_policy(spec, cfg.k_max, allow_device_mismatch=cfg.allow_device_mismatch, device=device_key,
                                       draft=own.name)
        if own is not draft:
            policies[n].drafter = own
    if cfg.replay_check:
        return _replay_check(cfg, target, device_key, draft, sampling, policies, prompts)
    if cfg.replay:
        return _replay_benchmark(cfg, device_key, draft, sampling, policies, prompts)
    if loads != ["none"]:
        return _loads_benchmark(cfg, target, draft, sampling, policies, prompts, device_key, hardware_name, argv, loads)
    if cfg.batch_sizes:
        return _batch_benchmark(cfg, target, draft, sampling, policies, prompts, device_key, hardware_name, argv)
    runs = run_benchmark(target, draft, policies, prompts, cfg.max_new_tokens, cfg.repeats, sampling, cfg.chat, cfg.progress,
                         checkpoint=_checkpoint(cfg), resume=cfg.resume)
    _speed_check(cfg, runs, prompts, target, device_key, draft)
    summary = summarize(runs, greedy=sampling.greedy)
    summary["input_range"] = _range_report(policies)
    meta = _run_meta(cfg, target, draft, prompts, device_key, hardware_name, policies)
    path = _save(cfg, argv, runs, summary, meta, "", lambda png: plot_benchmark(summary, runs, png), markdown_report)
    print(f"target {meta['target']} | draft {meta['draft']} | {len(prompts)} prompts ({cfg.split}) x {cfg.repeats} | "
          f"{cfg.max_new_tokens} new tokens | {meta['hardware']}")
    print(format_table(summary))
    _print_range_report(summary["input_range"])
    print(f"results: {path}")
    return 0
