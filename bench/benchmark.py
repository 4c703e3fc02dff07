"""Every length policy side by side on the same prompts: same process, interleaved order, medians.

Speed is compared as ratios inside one run (these machines drift by up to 1.5x within an hour):
per prompt, each policy's median seconds over the repeats; per category and overall, tokens/s =
total tokens / total median seconds, and speedup = that over plain decoding (policy `none`).
Greedy runs are also checked token for token against plain decoding.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from specpilot.decoding.config import warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.loop import generate
from specpilot.decoding.paths import Checkpoint, atomic_write_text
from specpilot.decoding.policies import LengthPolicy
from specpilot.decoding.prompts import Prompt, batches_of
from specpilot.decoding.sampling import Sampling


@dataclass
class BatchRun:
    """One policy's decoding of one batch of prompts in one repeat (a single prompt is a batch of one)."""

    policy: str
    batch_size: int
    batch_index: int
    question_ids: list[str]
    repeat: int
    new_tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    policy_s: float
    ks: list[int]
    token_ids: list[list[int]]
    category: str = ""
    """The prompt's category (single-prompt runs)."""
    load: str = "none"
    """The background load the run ran beside (env/load.py)."""


def run_benchmark(target, draft, policies: dict[str, LengthPolicy], prompts: list[Prompt], *args, **kwargs) -> list[BatchRun]:
    """Run every policy on every prompt, one prompt at a time (`run_batch_benchmark` at B = 1; the same
    further arguments: max_new_tokens, repeats, sampling, chat, progress)."""
    return run_batch_benchmark(target, draft, policies, prompts, [1], *args, **kwargs)


def run_batch_benchmark(
    target,
    draft,
    policies: dict[str, LengthPolicy],
    prompts: list[Prompt],
    batch_sizes: list[int],
    max_new_tokens: int = 64,
    repeats: int = 1,
    sampling: Sampling = Sampling(),
    chat: bool = True,
    progress: bool = True,
    loads: list[str] = ("none",),
    checkpoint: str | Path | None = None,
    resume: bool = False,
) -> list[BatchRun]:
    """Every policy on the same batches of prompts at each batch size (B prompts decoded together),
    interleaved: the policy order rotates from one batch to the next, so slow drift hits all alike.
    With `loads` (env/load.py), each repeat runs the whole plan under each background load in turn (the
    order rotating from one repeat to the next), the load started before its pass and stopped after it.

    With `checkpoint` (a JSONL file), every batch's runs (all policies of it, so the pairs stay together) are
    appended as they finish; with `resume` too, the batches already in the file are taken from it and not
    run again (the file must come from the same plan: policies, prompts, sizes, budget, repeats, loads,
    sampling, models). A learned policy's input counters cover the batches run in this process only."""
    from specpilot.env.load import LOADS, background_load

    if "none" not in policies:
        raise SpecPilotError("the benchmark needs the 'none' policy (plain decoding) as its baseline")
    loads = list(loads)
    if not loads or any(load not in LOADS for load in loads) or len(set(loads)) != len(loads):
        raise SpecPilotError(f"background loads must be distinct ones of {', '.join(LOADS)}, got {','.join(loads)}")
    names = list(policies)
    encoded = [target.encode(p.text, chat=chat) for p in prompts]
    plan = [(b, i, idx) for b in batch_sizes for i, idx in enumerate(batches_of(len(prompts), b))]
    warn(order_imbalance(repeats, [sum(1 for x in plan if x[0] == b) for b in batch_sizes], batch_sizes, len(names)))
    # warm-up, untimed, at every batch size: the first forward passes of a process and of each new shape are slow
    # (allocator, kernels)
    for b in batch_sizes:
        first = next(idx for size, _, idx in plan if size == b)
        own = [n for n in names if getattr(policies[n], "drafter", None) is not None]  # DRAFT@POLICY: its drafter too
        for name in dict.fromkeys(names[-1:] + own + [n for n in names if hasattr(policies[n], "run_engine")]):
            if hasattr(policies[name], "run_engine"):
                policies[name].run_engine(target, encoded[first[0]], 8)
                continue
            generate(target, drafter_of(policies[name], draft), policies[name], [encoded[x] for x in first], 8, sampling)
    signature = {"policies": names, "prompts": [p.question_id for p in prompts], "batch_sizes": list(batch_sizes),
                 "max_new_tokens": max_new_tokens, "repeats": repeats, "loads": loads, "sampling": asdict(sampling),
                 "chat": chat, "target": getattr(target, "name", None), "draft": getattr(draft, "name", None)}
    keep = Checkpoint(checkpoint, signature, resume, "benchmark") if checkpoint else None
    done = {(x["repeat"], x["load"], x["batch"]): [BatchRun(**run) for run in x["runs"]] for x in keep.rows} if keep else {}
    runs: list[BatchRun] = []
    desc = "benchmark" if batch_sizes == [1] else "batch benchmark"
    bar = tqdm(total=repeats * len(loads) * len(plan) * len(names), desc=desc, disable=not progress, file=sys.stderr)
    for r in range(repeats):
        for load in loads[r % len(loads):] + loads[: r % len(loads)]:
            groups = {j: done[(r, load, j)] for j in range(len(plan)) if (r, load, j) in done}
            bar.update(len(groups) * len(names))
            if len(loads) > 1:
                bar.set_postfix_str(f"load {load}")
            with background_load(load) if len(groups) < len(plan) else nullcontext():
                if len(groups) < len(plan):  # untimed: the load's processes start and the thread governor follows them
                    time.sleep(SETTLE_S)
                    generate(target, None, policies["none"], [encoded[x] for x in plan[0][2]], SETTLE_TOKENS, sampling)
                for j, (b, i, idx) in enumerate(plan):
                    if j in groups:
                        continue
                    groups[j] = []
                    for name in policy_order(names, r, j):
                        groups[j].append(_run_one(target, draft, policies[name], name, prompts, encoded, b, i, idx, r,
                                                  max_new_tokens, sampling, load))
                        bar.update()
                    if keep:
                        keep.append({"repeat": r, "load": load, "batch": j, "runs": [asdict(x) for x in groups[j]]})
            runs += [run for j in range(len(plan)) for run in groups[j]]
    bar.close()
    return runs


SETTLE_S, SETTLE_TOKENS = 0.5, 16
"""Before the first timed batch of each load (each repeat's switch of loads), a pause and an untimed plain decode of this
many tokens: without them the first policy of a load ran 13-43% slower than in its other batches (the governor still
held the previous load's threads; reports/README.md, "How the benchmark measures")."""


def policy_order(names: list[str], r: int, j: int) -> list[str]:
    """The order the policies run in on batch j of repeat r: rotated to start at policy (r + j) mod P."""
    shift = (r + j) % len(names)
    return names[shift:] + names[:shift]


def order_imbalance(repeats: int, batches: list[int], batch_sizes: list[int], policies: int) -> str | None:
    """Why the policy order leaves position effects unbalanced, or None. Batch j of repeat r starts the rotation
    at policy (r + j) mod P; over a batch size's J consecutive batches and R repeats every policy takes every
    position equally often exactly when R or J is a multiple of P (the first Fourier coefficient of the sum of
    two uniform ranges mod P vanishes only then)."""
    short = [b for b, j in zip(batch_sizes, batches) if repeats % policies and j % policies]
    if not short or policies < 2:
        return None
    return (f"at batch size {','.join(map(str, short))} the {policies} policies do not each run in every position "
            f"equally often over {repeats} repeats (slow drift and warm-up favour some); use --repeats {policies}")


def drafter_of(policy, draft):
    """The drafter a benchmarked policy decodes with: its own (`DRAFT@POLICY`, benchmark_cli) or the run's."""
    return getattr(policy, "drafter", None) or draft


def _run_one(target, draft, policy, name, prompts, encoded, b, i, idx, r, max_new_tokens, sampling, load) -> BatchRun:
    """One policy's decoding of one batch (rows `idx` of the prompts) in repeat r, as a BatchRun."""
    if hasattr(policy, "prepare") and b == 1:  # the oracle replays this prompt's schedule
        policy.prepare(prompts[idx[0]].question_id)
    rows = [encoded[x] for x in idx]
    if hasattr(policy, "run_engine"):  # the engine's own decoding (decoding/llama_cpp.py EngineDecoding)
        if b != 1 or not sampling.greedy:
            raise SpecPilotError(f"policy '{name}' (llama.cpp's own decoding) runs greedy, one prompt at a time")
        ids, seconds, rounds = policy.run_engine(target, rows[0], max_new_tokens)
        return BatchRun(name, b, i, [prompts[x].question_id for x in idx], r, len(ids), seconds,
                        len(ids) - sum(a for _, a in rounds), sum(k for k, _ in rounds), sum(a for _, a in rounds), 0.0,
                        [k for k, _ in rounds], [ids], prompts[idx[0]].category, load)
    result = generate(target, drafter_of(policy, draft) if policy.k_max > 0 else None, policy, rows[0] if b == 1 else rows,
                      max_new_tokens, sampling, seed=r)
    s = result.stats
    token_ids = [result.token_ids] if b == 1 else result.token_ids
    return BatchRun(name, b, i, [prompts[x].question_id for x in idx], r, s.new_tokens, s.seconds, s.steps,
                    sum(x.k * x.batch_size for x in result.steps), sum(sum(x.accepted_rows) for x in result.steps),
                    s.policy_s, [x.k for x in result.steps], token_ids, prompts[idx[0]].category if b == 1 else "", load)


def mismatch_rate(ids, plain_ids) -> float:
    """Share of plain decoding's tokens that a run did not reproduce at the same position (rows of a batch
    flattened; a token missing or extra counts). 0 is token-identical; in bf16 a (k+1)-token verify pass can
    flip a near-tied argmax that a 1-token step would not, so it is measured, not assumed."""
    rows = [ids] if ids and isinstance(ids[0], int) else list(ids)
    plain = [plain_ids] if plain_ids and isinstance(plain_ids[0], int) else list(plain_ids)
    total = sum(len(p) for p in plain)
    wrong = sum(sum(a != b for a, b in zip(r, p)) + abs(len(r) - len(p)) for r, p in zip(rows, plain))
    return wrong / total if total else 0.0


def summarize(runs: list[BatchRun], greedy: bool = True) -> dict:
    """Per policy and category: tokens/s, speedup over plain, accept rate, mean k, mean accepted."""
    by_key: dict[tuple[str, str], list[BatchRun]] = defaultdict(list)
    for run in runs:
        by_key[(run.policy, run.question_ids[0])].append(run)
    policies = list(dict.fromkeys(run.policy for run in runs))
    categories = sorted({run.category for run in runs})
    plain_ids = {q: rs[0].token_ids for (p, q), rs in by_key.items() if p == "none"}
    table: dict[str, dict[str, dict]] = {}
    for policy in policies:
        table[policy] = {}
        for category in categories + ["overall"]:
            keys = [k for k in by_key if k[0] == policy and (category == "overall" or by_key[k][0].category == category)]
            if not keys:
                continue
            tokens = sum(by_key[k][0].new_tokens for k in keys)
            seconds = sum(statistics.median(r.seconds for r in by_key[k]) for k in keys)
            plain_seconds = sum(statistics.median(r.seconds for r in by_key[("none", k[1])]) for k in keys)
            plain_tokens = sum(by_key[("none", k[1])][0].new_tokens for k in keys)
            group = [r for k in keys for r in by_key[k]]
            drafted = sum(r.drafted for r in group)
            steps = sum(r.steps for r in group)
            table[policy][category] = {
                "prompts": len(keys),
                "tokens_per_s": tokens / seconds,
                "speedup": (tokens / seconds) / (plain_tokens / plain_seconds),
                "accept_rate": sum(r.accepted for r in group) / drafted if drafted else 0.0,
                "mean_k": drafted / steps,
                "mean_accepted": sum(r.accepted for r in group) / steps,
                "overhead_frac": sum(r.policy_s for r in group) / sum(r.seconds for r in group),
                "lossless": all(by_key[k][0].token_ids == plain_ids[k[1]] for k in keys) if greedy else None,
                "mismatch_rate": (sum(mismatch_rate(by_key[k][0].token_ids, plain_ids[k[1]]) * by_key[("none", k[1])][0].new_tokens
                                      for k in keys) / plain_tokens) if greedy else None,
            }
    if "oracle" in table:
        for policy in policies:
            for category, row in table[policy].items():
                row["fraction_of_oracle"] = row["speedup"] / table["oracle"][category]["speedup"]
    return {"policies": policies, "categories": categories, "table": table}


def _pct(rate) -> str:
    """A mismatch rate as a percentage ('-' when not measured: sampling)."""
    return "-" if rate is None else f"{100 * rate:.2f}%"


def _worst(cells: list[dict]):
    rates = [c.get("mismatch_rate") for c in cells if c.get("mismatch_rate") is not None]
    return max(rates) if rates else None


def format_table(summary: dict) -> str:
    """A fixed-width table: one row per policy, overall columns then speedup per category."""
    cats = summary["categories"]
    oracle = "oracle" in summary["table"]
    head = f"{'policy':<16}{'tok/s':>8}{'speedup':>9}{'acc.rate':>9}{'mean k':>8}{'mean acc':>9}{'ovh%':>6}{'mismatch':>9}"
    head += f"{'/oracle':>8}" if oracle else ""
    head += "".join(f"{c[:11]:>12}" for c in cats)
    lines = [head, "-" * len(head)]
    for policy in summary["policies"]:
        row = summary["table"][policy]
        o = row["overall"]
        line = (f"{policy:<16}{o['tokens_per_s']:>8.2f}{o['speedup']:>8.3f}x{o['accept_rate']:>9.3f}{o['mean_k']:>8.2f}"
                f"{o['mean_accepted']:>9.2f}{100 * o['overhead_frac']:>6.2f}{_pct(o['mismatch_rate']):>9}")
        line += f"{o['fraction_of_oracle']:>8.3f}" if oracle else ""
        line += "".join(f"{row[c]['speedup']:>11.3f}x" if c in row else f"{'-':>12}" for c in cats)
        lines.append(line)
    return "\n".join(lines)


def write_results(out_dir: str | Path, runs: list, summary: dict, meta: dict, name: str = "results.json") -> Path:
    """OUT/NAME: the run's meta, its summary and every run (the raw timings and token ids)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    return atomic_write_text(path, json.dumps({"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}, indent=1))


def decoding_mode(meta: dict) -> str:
    """How a report's runs decoded: greedy, or sampled at the meta's temperature."""
    t = float(meta.get("temperature") or 0.0)
    return f"sampled at temperature {t:g} (outputs differ from plain decoding's by design: no token check)" if t > 0 else "greedy"


def markdown_report(summary: dict, meta: dict, plot_name: str, command: str) -> str:
    """A report page: how it was made, the overall table, speedup per category, the plot."""
    t = summary["table"]
    oracle = "oracle" in t
    lines = [f"# Benchmark: {meta.get('hardware')} ({meta.get('device')})", "",
             f"Regenerate with: `{command}`", "",
             f"target {meta.get('target')}; draft {meta.get('draft')}; {meta.get('prompts')} prompts ({meta.get('split')} split) "
             f"x {meta.get('repeats')} repeats; {meta.get('max_new_tokens')} new tokens; {decoding_mode(meta)}; same process, interleaved, medians.", "",
             "| policy | tokens/s | speedup | accept rate | mean k | mean accepted | overhead % | tokens unlike plain |" + (" fraction of oracle |" if oracle else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if oracle else "")]
    for policy in summary["policies"]:
        o = t[policy]["overall"]
        lines.append(f"| {policy} | {o['tokens_per_s']:.2f} | {o['speedup']:.3f}x | {o['accept_rate']:.3f} | {o['mean_k']:.2f} | "
                     f"{o['mean_accepted']:.2f} | {100 * o['overhead_frac']:.2f} | {_pct(o['mismatch_rate'])} |"
                     + (f" {o['fraction_of_oracle']:.3f} |" if oracle else ""))
    cats = summary["categories"]
    lines += ["", "Speedup over plain decoding per category:", "", "| policy | " + " | ".join(cats) + " |",
              "|---|" + "---|" * len(cats)]
    for policy in summary["policies"]:
        lines.append(f"| {policy} | " + " | ".join(f"{t[policy][c]['speedup']:.3f}x" for c in cats) + " |")
    lines += ["", f"![speedup per category and chosen k]({plot_name})", ""]
    return "\n".join(lines)


def summarize_batches(runs: list[BatchRun], greedy: bool = True) -> dict:
    """Per batch size and policy: tokens/s of all rows, speedup over plain decoding at that batch size."""
    by_key: dict[tuple, list[BatchRun]] = defaultdict(list)
    for run in runs:
        by_key[(run.batch_size, run.policy, run.batch_index)].append(run)
    sizes = sorted({run.batch_size for run in runs})
    policies = list(dict.fromkeys(run.policy for run in runs))
    table: dict[str, dict[str, dict]] = {}
    for b in sizes:
        table[str(b)] = {}
        batches = sorted({k[2] for k in by_key if k[0] == b})
        plain_s = sum(statistics.median(r.seconds for r in by_key[(b, "none", i)]) for i in batches)
        plain_tokens = sum(by_key[(b, "none", i)][0].new_tokens for i in batches)
        for policy in policies:
            group = [r for i in batches for r in by_key[(b, policy, i)]]
            seconds = sum(statistics.median(r.seconds for r in by_key[(b, policy, i)]) for i in batches)
            tokens = sum(by_key[(b, policy, i)][0].new_tokens for i in batches)
            drafted = sum(r.drafted for r in group)
            paired = _paired_speedups(by_key, b, policy, batches)
            table[str(b)][policy] = {
                "batches": len(batches),
                **paired,
                "tokens_per_s": tokens / seconds,
                "speedup": (tokens / seconds) / (plain_tokens / plain_s),
                "accept_rate": sum(r.accepted for r in group) / drafted if drafted else 0.0,
                "mean_k": sum(sum(r.ks) for r in group) / max(1, sum(r.steps for r in group)),
                "overhead_frac": sum(r.policy_s for r in group) / sum(r.seconds for r in group),
                "lossless": all(by_key[(b, policy, i)][0].token_ids == by_key[(b, "none", i)][0].token_ids
                                for i in batches) if greedy else None,
                "mismatch_rate": (sum(mismatch_rate(by_key[(b, policy, i)][0].token_ids, by_key[(b, "none", i)][0].token_ids)
                                      * by_key[(b, "none", i)][0].new_tokens for i in batches) / plain_tokens)
                if greedy else None,
            }
    return {"batch_sizes": sizes, "policies": policies, "table": table}


def _paired_speedups(by_key: dict, b: int, policy: str, batches: list[int]) -> dict:
    """Speedup over plain decoding within each repeat (the policy's and plain's runs of the same batches in
    the same pass over the plan, so slow drift of the machine cancels), their geometric mean and an
    95% interval of it (`paired_ratio`)."""
    repeats: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for i in batches:
        for name, slot in ((policy, 0), ("none", 2)):
            for run in by_key[(b, name, i)]:
                acc = repeats[run.repeat]
                acc[slot] += run.new_tokens
                acc[slot + 1] += run.seconds
    ratios = [(t / s) / (pt / ps) for t, s, pt, ps in repeats.values() if s > 0 and ps > 0 and t and pt]
    if not ratios:
        return {}
    mean, interval = paired_ratio(ratios)
    return {"speedup_per_repeat": ratios, "speedup_paired": mean, "speedup_paired_interval": interval}


# Student's t, two-sided 95% (0.975 quantile) for 1..30 degrees of freedom; the normal's 1.96 beyond
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (1.96 above 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def paired_ratio(ratios: list[float]) -> tuple[float, list[float] | None]:
    """The geometric mean of per-repeat ratios (each measured side by side, so slow drift of the machine cancels)
    and its 95% interval, exp(mean log +- t(n-1) standard errors) (Student's t: three repeats give +- 4.3 standard
    errors, not 2); None with a single repeat."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), [math.exp(mean - half), math.exp(mean + half)]


def paired_cell(cell: dict) -> str:
    """'1.054 [0.948, 1.172]': a cell's paired speedup and its interval (see `_paired_speedups`)."""
    if "speedup_paired" not in cell:
        return "-"
    interval = cell.get("speedup_paired_interval")
    return f"{cell['speedup_paired']:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def format_paired_table(summary: dict) -> str:
    """Rows: policies; columns: batch sizes, each 'paired speedup [95% interval]' over the repeats."""
    sizes = summary["batch_sizes"]
    head = f"{'policy':<16}" + "".join(f"{'B=' + str(b):>25}" for b in sizes)
    lines = [head, "-" * len(head)]
    for policy in summary["policies"]:
        lines.append(f"{policy:<16}" + "".join(f"{paired_cell(summary['table'][str(b)][policy]):>25}" for b in sizes))
    return "\n".join(lines)


def format_batch_table(summary: dict) -> str:
    """Rows: policies; columns: batch sizes, each 'tokens/s (speedup)'."""
    sizes = summary["batch_sizes"]
    head = f"{'policy':<16}" + "".join(f"{'B=' + str(b):>18}" for b in sizes) + f"{'mismatch':>10}"
    lines = [head, "-" * len(head)]
    for policy in summary["policies"]:
        cells = [summary["table"][str(b)][policy] for b in sizes]
        line = f"{policy:<16}" + "".join(f"{c['tokens_per_s']:>9.2f} ({c['speedup']:.3f}x)" for c in cells)
        lines.append(line + f"{_pct(_worst(cells)):>10}")
    return "\n".join(lines)


def batch_markdown_report(summary: dict, meta: dict, plot_name: str, command: str) -> str:
    """The batched benchmark's report page: tokens/s and speedup per batch size, mean k, paired speedups."""
    sizes = summary["batch_sizes"]
    lines = [f"# Batched benchmark: {meta.get('hardware')} ({meta.get('device')})", "", f"Regenerate with: `{command}`", "",
             f"target {meta.get('target')}; draft {meta.get('draft')}; {meta.get('prompts')} prompts ({meta.get('split')} split), "
             f"taken B at a time; {meta.get('max_new_tokens')} new tokens per row; {decoding_mode(meta)}; every policy on the same batches, "
             "interleaved. Cells: tokens/s of all rows (speedup over plain decoding at that batch size).", "",
             "| policy | " + " | ".join(f"B={b}" for b in sizes) + " | tokens unlike plain |", "|---|" + "---|" * (len(sizes) + 1)]
    for policy in summary["policies"]:
        cells = [summary["table"][str(b)][policy] for b in sizes]
        lines.append(f"| {policy} | " + " | ".join(f"{c['tokens_per_s']:.2f} ({c['speedup']:.3f}x)" for c in cells)
                     + f" | {_pct(_worst(cells))} |")
    lines += ["", "Mean k chosen:", "", "| policy | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for policy in summary["policies"]:
        lines.append(f"| {policy} | " + " | ".join(f"{summary['table'][str(b)][policy]['mean_k']:.2f}" for b in sizes) + " |")
    if meta.get("repeats", 1) > 1:
        lines += ["", (f"Speedup over plain within each of the {meta['repeats']} repeats (the policy's and plain "
                       "decoding's runs of the same batches in the same pass, so slow drift of the machine cancels): "
                       "geometric mean [95% interval, exp(mean log +- t(n-1) standard errors)]."), "",
                  "| policy | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for policy in summary["policies"]:
            lines.append(f"| {policy} | " + " | ".join(paired_cell(summary["table"][str(b)][policy]) for b in sizes) + " |")
    lines += ["", f"![tokens/s and speedup vs batch size]({plot_name})", ""]
    return "\n".join(lines)


def summarize_loads(runs: list[BatchRun], greedy: bool = True) -> dict:
    """Per background load, the batched summary of the runs under it: every speedup is over plain decoding
    under the same load (its paired intervals from the repeats, each load's pass in each repeat)."""
    loads = list(dict.fromkeys(run.load for run in runs))
    by_load = {load: summarize_batches([r for r in runs if r.load == load], greedy) for load in loads}
    first = by_load[loads[0]]
    return {"loads": loads, "batch_sizes": first["batch_sizes"], "policies": first["policies"], "by_load": by_load}


def format_loads_table(summary: dict) -> str:
    """Rows: policies; columns: load x batch size, each the paired speedup over plain under that load."""
    cols = [(load, b) for load in summary["loads"] for b in summary["batch_sizes"]]
    head = f"{'policy':<16}" + "".join(f"{load + ' B=' + str(b):>25}" for load, b in cols)
    lines = [head, "-" * len(head)]
    for policy in summary["policies"]:
        lines.append(f"{policy:<16}" + "".join(
            f"{paired_cell(summary['by_load'][load]['table'][str(b)][policy]):>25}" for load, b in cols))
    return "\n".join(lines)


def loads_markdown_report(summary: dict, meta: dict, plot_name: str, command: str) -> str:
    """The report page of a benchmark under background loads: per load, speedup over plain under that load."""
    sizes, loads = summary["batch_sizes"], summary["loads"]
    lines = [f"# Benchmark under background load: {meta.get('hardware')} ({meta.get('device')})", "",
             f"Regenerate with: `{command}`", "",
             f"target {meta.get('target')}; draft {meta.get('draft')}; {meta.get('prompts')} prompts ({meta.get('split')} split), "
             f"taken B at a time; {meta.get('max_new_tokens')} new tokens per row; {decoding_mode(meta)}; {meta.get('repeats')} repeats. "
             "Each repeat runs every policy on the same batches under each load in turn (the order rotating between "
             "repeats; the load started by the benchmark before its pass and stopped after it, env/load.py). "
             "Cells: speedup over plain decoding *under the same load*, paired within each repeat: geometric mean "
             "[95% interval]; then the plain tokens/s, to show the load's scale.", ""]
    cols = [(load, b) for load in loads for b in sizes]
    lines += ["| policy | " + " | ".join(f"{load} B={b}" for load, b in cols) + " | tokens unlike plain |",
              "|---|" + "---|" * (len(cols) + 1)]
    for policy in summary["policies"]:
        cells = [summary["by_load"][load]["table"][str(b)][policy] for load, b in cols]
        lines.append(f"| {policy} | " + " | ".join(paired_cell(c) for c in cells) + f" | {_pct(_worst(cells))} |")
    lines.append("| plain tokens/s | " + " | ".join(
        f"{summary['by_load'][load]['table'][str(b)]['none']['tokens_per_s']:.2f}" for load, b in cols) + " | |")
    lines += ["", "Mean k chosen:", "", "| policy | " + " | ".join(f"{load} B={b}" for load, b in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for policy in summary["policies"]:
        lines.append(f"| {policy} | " + " | ".join(
            f"{summary['by_load'][load]['table'][str(b)][policy]['mean_k']:.2f}" for load, b in cols) + " |")
    lines += ["", f"![speedup under each load]({plot_name})", ""]
    return "\n".join(lines)
