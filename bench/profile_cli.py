"""The profile command: `python scripts/profile_device.py --device auto` measures this device's cost
profile (draft and verify seconds per k, context length and batch size) and records acceptance traces."""
from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specpilot.decoding.config import at_least, parse_config, parse_ints
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import CO_RUNNING, HW_FEATURES, LOAD_READING, resolve
from specpilot.decoding.models import ModelDrafter, load_draft, load_target, random_init_target
from specpilot.decoding.paths import atomic_write_text, output_dir, pair_name, traces_path
from specpilot.decoding.policies import DEFAULT_K_MAX
from specpilot.decoding.prompts import load_prompts
from specpilot.decoding.sampling import Sampling
from specpilot.env.oracle import load_traces, model_identity, record_trace, save_traces, trace_dtype, trace_temperature
from specpilot.env.oracle import load_profile
from specpilot.env.profile import fit_grid_in_context, measure_counters, profile_costs
from specpilot.env.simulate import compare_profiles, save_profile, simulate_profile

from specpilot.env.load import LOADS, background_load
from .plots import plot_profile

CONTEXT_FITS = ("linear", "none")
"""How a measured grid is smoothed over the context (--context-fit)."""


@dataclass
class ProfileConfig:
    """Measure this device's cost profile (draft and verify seconds vs k) and record acceptance traces."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N] | a device key such as h100 (the first visible GPU of that kind; must be present)."""
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
    grid_context_lens: str = ""
    """Comma-separated context lengths at which every batch size is profiled too (a measured batch x context
    grid the replay env then looks up directly, e.g. 64,512,1024,2048); empty = batch sizes at the first
    context length only, scaled by the one-row context curve."""
    costs: bool = True
    """Measure the cost profile (--no-costs: record traces only)."""
    traces: bool = True
    """Also record greedy acceptance traces on the prompt set (real weights only)."""
    prompts: str | None = None
    """Prompt JSONL for the traces (default: the project's set, all splits)."""
    trace_split: str = "all"
    """Which split's prompts to trace: all | train | test | ood | outside. Traces recorded now replace those of the same
    prompts in an existing traces file of the same draft, budget and k_max; the others are kept."""
    max_new_tokens: int = 64
    """Tokens per traced prompt."""
    temperature: float = 0.0
    """Record the traces of sampled decoding at this temperature (0: greedy). Prompt-lookup drafts only: their
    proposal is kept exactly when it equals the target's own sample, so one sampled continuation per prompt
    replays any policy exactly (env/oracle.py). Written to a file of its own, traces-DRAFT-tT.json."""
    trace_seed: int = 0
    """Seed of the sampled traces: a prompt's sampler is seeded with this plus the CRC-32 of its question id."""
    dtype: str = "auto"
    """Model dtype: auto | float32 | bfloat16 | float16."""
    threads: str = "auto"
    """CPU threads: auto (they follow the cores other processes leave free, torch's or llama.cpp's) | fixed."""
    gemm: str = "auto"
    """CPU fp32 matrix products: auto (small-rows on the CPUs of decoding.models.SMALL_ROW_CPUS, else linear) | linear (torch's) | small-rows
    (decoding.models.SmallRowLinear, W @ x^T for 1-4 rows, one padded to two: cheaper plain steps and verify passes
    of 1-3 drafted tokens on this CPU; `python -m specpilot.bench.gemm` times both)."""
    context_fit: str = "linear"
    """How a measured grid (--grid-context-lens, three lengths or more) is smoothed over the context: linear (per
    batch size and k, the least-squares line through its cells, env.profile.fit_grid_in_context; the medians
    are kept beside it) | none (the medians as measured)."""
    refit: str | None = None
    """Refit the grid of this existing profile file with --context-fit and rewrite it in place; nothing runs."""
    out: str = ""
    """Folder for <device>.json, <device>.png and the traces (default: profiles/ in the working directory when it has
    one, as a checkout does, else the user folder's)."""
    progress: bool = True
    """Show a progress bar."""
    simulate: str | None = None
    """a100 | h100 | h200 | l4: write a simulated profile of that chip (a roofline model, env/simulate.py) for
    --target-config verifying --draft-config drafts (or n-gram drafts without it), at --simulate-batch-sizes
    x --simulate-context-lens; no model runs, no GPU needed. Written as OUT/DEVICE-simulated.json (with
    --draft-config: OUT/DEVICE-SHAPE-simulated.json, SHAPE its folder's name)."""
    simulate_batch_sizes: str = "1,2,4,8,16,32,64,128,256"
    """Batch sizes of a simulated profile."""
    simulate_context_lens: str = "128,512,1024,2048,4096,8192,16384,32768"
    """Context lengths of a simulated profile."""
    background_load: str = "none"
    """Profile under a background load the command starts and stops itself: none | compute (one core of
    matrix multiplies) | memory (a stream of large copies) | both (env/load.py); the profile is written as
    DEVICE[-DRAFT]-load-KIND.json and records the load and the counters as they read under it."""
    condition: str = "none"
    """With --simulate: the machine condition simulated (env/simulate.py CONDITIONS): none | power-cap (SM clock
    at 55%) | cotenant (half the HBM bandwidth taken) | both; the profile records the counters as NVML would
    read under it and is written as OUT/DEVICE-CONDITION-simulated.json."""
    record_counters: str | None = None
    """Measure only the hardware counters (decoding.hardware.HW_FEATURES) as they read while the target decodes here for
    --counter-seconds (under --background-load), and write them into this existing profile of this device in place,
    its costs untouched: a profile recorded before a counter was added reads it measured, not neutral."""
    counter_seconds: float = 10.0
    """With --record-counters: seconds of plain decoding the counters are averaged over."""
    compare: str | None = None
    """With --simulate: a measured profile of the same chip (scripts/gpu_check.sh writes one) to compare with
    the simulated one cell by cell (measured / simulated seconds)."""


def profile_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ProfileConfig, argv)
    at_least(1, repeats=cfg.repeats, max_new_tokens=cfg.max_new_tokens)
    at_least(0, k_max=cfg.k_max)
    if cfg.context_fit not in CONTEXT_FITS:
        raise SpecPilotError(f"--context-fit must be one of {', '.join(CONTEXT_FITS)}, got '{cfg.context_fit}'")
    if cfg.refit:
        return _refit(cfg)
    if cfg.simulate:
        return _simulate(cfg)
    device = resolve(cfg.device)
    device_key, hardware_name, torch_device = device.key, device.name, device.torch
    if cfg.background_load not in LOADS:
        raise SpecPilotError(f"--background-load must be one of {', '.join(LOADS)}, got '{cfg.background_load}'")
    if cfg.record_counters:
        return _record_counters(cfg, device_key, torch_device)
    lens = parse_ints(cfg.context_lens, "--context-lens")
    if cfg.target_config:
        target = random_init_target(cfg.target_config, cfg.dtype, torch_device)
        prompt_ids = list(range(100, 164))
    else:
        target = load_target(cfg.target, cfg.dtype, torch_device, cfg.gemm, cfg.threads)
        prompt_ids = target.encode(load_prompts(cfg.prompts)[0].text, chat=True)
    if cfg.draft_config:
        draft_target = random_init_target(cfg.draft_config, cfg.dtype, torch_device)
        draft = ModelDrafter(draft_target.model, draft_target.name, target.vocab_size)
    else:
        draft = load_draft(cfg.draft, target, cfg.dtype)
    out = Path(cfg.out or output_dir("profiles"))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.costs:
        with background_load(cfg.background_load):
            write_profile(cfg, target, draft, prompt_ids, lens, device_key, hardware_name, out)
    if cfg.traces and not cfg.target_config and not cfg.draft_config:
        write_traces(cfg, target, draft, out)
    return 0


def _record_counters(cfg, device_key: str, torch_device: str) -> int:
    """--record-counters PATH: the counters while plain decoding runs here, written into PATH's `hardware`."""
    path = Path(cfg.record_counters)
    profile = load_profile(path, device_key)
    if cfg.counter_seconds <= 0:
        raise SpecPilotError(f"--counter-seconds must be > 0, got {cfg.counter_seconds}")
    if profile.get("background_load", "none") != cfg.background_load:
        raise SpecPilotError(f"{path} was measured under the load '{profile.get('background_load', 'none')}', "
                             f"not --background-load {cfg.background_load}")
    target = load_target(cfg.target, cfg.dtype, torch_device, cfg.gemm, cfg.threads)
    prompt_ids = target.encode(load_prompts(cfg.prompts)[0].text, chat=True)
    counters = record_counters(path, profile, target, prompt_ids, cfg.background_load, cfg.counter_seconds)
    print(f"counters of {device_key} under load '{cfg.background_load}' written into {path}: "
          + ", ".join(f"{n} {v:.3f}" for n, v in zip(HW_FEATURES, counters) if n.startswith("hw_cpu") or n in CO_RUNNING))
    return 0


def record_counters(path: Path, profile: dict, target, prompt_ids: list[int], load: str, seconds: float) -> np.ndarray:
    """The counters while plain decoding runs here under `load` for `seconds`, written into the profile at `path`
    (`hardware`, with the load reading they were read with), its costs untouched."""
    with background_load(load):
        counters = measure_counters(target, prompt_ids, seconds)
    profile.update({"hardware": counters.round(4).tolist(), "hardware_features": list(HW_FEATURES),
                    "load_reading": LOAD_READING, "hardware_recorded": f"--record-counters, {seconds:g} s of plain decoding"})
    atomic_write_text(path, json.dumps(profile, indent=1))
    return counters


def write_profile(cfg, target, draft, prompt_ids, lens, device_key, hardware_name, out: Path) -> Path:
    """Measure the cost profile of this target and draft here (under no load of its own making) into OUT."""
    batch_sizes = parse_ints(cfg.batch_sizes, "--batch-sizes") if cfg.batch_sizes.strip() else []
    grid_lens = parse_ints(cfg.grid_context_lens, "--grid-context-lens") if cfg.grid_context_lens.strip() else []
    if grid_lens and not batch_sizes:
        raise SpecPilotError("--grid-context-lens needs --batch-sizes (the grid is batch size x context length)")
    cells = len(lens) + len(batch_sizes) * (1 + len(grid_lens))
    bar = tqdm(total=cells * cfg.repeats * (cfg.k_max + 1), desc="profile", disable=not cfg.progress, file=sys.stderr)
    profile = profile_costs(target, draft, prompt_ids, cfg.k_max, lens, cfg.repeats, progress=bar, batch_sizes=batch_sizes,
                            grid_context_lens=grid_lens)
    bar.close()
    if "grid" in profile and cfg.context_fit == "linear":
        profile["grid"] = fit_grid_in_context(profile["grid"])
    profile.update({"device": device_key, "hardware_name": hardware_name, "target": target.name, "load_reading": LOAD_READING,
                    "draft": getattr(draft, "name", None), "draft_weights": getattr(draft, "weights_id", None) or None,
                    "dtype": str(target.dtype),
                    "shapes": {"target": cfg.target_config or "real weights", "draft": cfg.draft_config or "real weights"}})
    # the default draft's profile is DEVICE.json; another draft's (its own draft cost) DEVICE-DRAFT.json; a profile
    # beside a load always names its pair (decoding.paths.load_profile_path, where the chain looks for it)
    stem = (device_key if (cfg.draft == "default" and cfg.background_load == "none") or cfg.draft_config or cfg.target_config
            else f"{device_key}-{pair_name(draft.name, target.name)}")
    if cfg.background_load != "none":
        stem += f"-load-{cfg.background_load}"
        profile["background_load"] = cfg.background_load
    path = out / f"{stem}.json"
    atomic_write_text(path, json.dumps(profile, indent=1))
    plot_profile(profile, out / f"{stem}.png")
    print(f"cost profile of {device_key} ({hardware_name}): {path}")
    for c, row in zip(profile["context_lens"], profile["verify_s"]):
        print(f"  context {c:>5}: verify ms for k=0..{cfg.k_max}: " + " ".join(f"{1000 * s:.1f}" for s in row)
              + f" | draft ms/token {1000 * profile['draft_s_per_token'][profile['context_lens'].index(c)]:.2f}")
    for b, row, d in zip(profile.get("batch_sizes", []), profile.get("batch_verify_s", []), profile.get("batch_draft_s_per_token", [])):
        print(f"  batch {b:>3} (context {profile['batch_context_len']}): verify ms for k=0..{cfg.k_max}: "
              + " ".join(f"{1000 * s:.1f}" for s in row) + f" | draft ms/position {1000 * d:.2f}")
    if "grid" in profile:
        print_grid(profile["grid"], cfg.k_max)
    return path


def _refit(cfg) -> int:
    """--refit PATH: the profile's grid smoothed again from its measured medians (or restored to them)."""
    path = Path(cfg.refit)
    profile = load_profile(path)
    grid = profile.get("grid")
    if not grid or not grid.get("measured"):
        raise SpecPilotError(f"{path} has no measured grid to refit (profile with --grid-context-lens)")
    if cfg.context_fit == "linear":
        grid = fit_grid_in_context(grid)
    else:
        grid = {**grid, "verify_s": grid.get("verify_s_measured", grid["verify_s"]),
                "draft_s_per_token": grid.get("draft_s_per_token_measured", grid["draft_s_per_token"]), "context_fit": "none"}
    profile["grid"] = grid
    atomic_write_text(path, json.dumps(profile, indent=1))  # its plot shows the one-row curve: unchanged
    print(f"refit {path} ({grid['context_fit']} in context):")
    print_grid(grid, len(grid["verify_s"][0][0]) - 1)
    return 0


def print_grid(grid: dict, k_max: int) -> None:
    """One line per batch size: the plain step and the k_max step's ratio to it at each context length."""
    for b_i, b in enumerate(grid["batch_sizes"]):
        cells = [f"{c}:{1000 * row[0]:.1f}ms/{row[-1] / row[0]:.2f}" for c, row in zip(grid["context_lens"], grid["verify_s"][b_i])]
        print(f"  B={b:<4} plain step ms / verify(k={k_max}) ratio at context " + " ".join(cells))


def _simulate(cfg) -> int:
    if not cfg.target_config:
        raise SpecPilotError("--simulate needs --target-config (the target's shape, e.g. configs/llama-3.1-8b)")
    profile = simulate_profile(cfg.simulate.strip().lower(), cfg.target_config, cfg.draft_config, cfg.k_max,
                               parse_ints(cfg.simulate_batch_sizes, "--simulate-batch-sizes"),
                               parse_ints(cfg.simulate_context_lens, "--simulate-context-lens"), cfg.condition)
    suffix = ("" if cfg.condition == "none" else f"-{cfg.condition}") + (f"-{Path(cfg.draft_config).name}"
                                                                      if cfg.draft_config else "")
    path = save_profile(profile, Path(cfg.out or output_dir("profiles")) / f"{profile['device']}{suffix}-simulated.json")
    print(f"SIMULATED cost profile of {profile['hardware_name']}: {path} (roofline model, not a measurement)")
    print_grid(profile["grid"], cfg.k_max)
    if cfg.compare:
        rows = compare_profiles(profile, load_profile(cfg.compare))
        if not rows:
            raise SpecPilotError(f"{cfg.compare} shares no (context, batch) cell with the simulated profile")
        print(f"measured {cfg.compare} / simulated, cell by cell (batch, context, k: ratio):")
        for r in rows:
            print(f"  B={r['batch']:<4} context {r['context']:<6} k={r['k']}: {r['measured_s'] * 1000:.2f} ms measured, "
                  f"{r['simulated_s'] * 1000:.2f} ms simulated, ratio {r['ratio']:.2f}")
        ratios = [r["ratio"] for r in rows]
        print(f"  ratio median {sorted(ratios)[len(ratios) // 2]:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


def write_traces(cfg, target, draft, out: Path) -> Path:
    """Record greedy (or sampled) acceptance traces of this target and draft on --trace-split's prompts into OUT."""
    prompts = load_prompts(cfg.prompts, cfg.trace_split)
    seen = getattr(draft, "distilled_on", None)  # a trained head's own training prompts: nothing is tuned on them
    if seen is not None and draft.name == "hybrid":  # (the head's own traces keep them, for reports/draft-seen.md)
        prompts = [p for p in prompts if not (p.split == "train" and seen(p.question_id, p.category))]
    trace_path = out / traces_path(draft.name, cfg.temperature, target.name).name
    sampling = Sampling(cfg.temperature)
    meta = {"target": target.name, "draft": draft.name, "draft_weights": getattr(draft, "weights_id", None) or None,
            "k_max": cfg.k_max, "max_new_tokens": cfg.max_new_tokens, "dtype": str(target.dtype), "splits": {}}
    if not sampling.greedy:
        meta.update(temperature=cfg.temperature, seed=cfg.trace_seed)
    kept = []
    if trace_path.exists():
        old, old_meta = load_traces(trace_path)
        if (all(old_meta.get(key) == meta.get(key) for key in ("draft", "draft_weights", "k_max", "max_new_tokens", "seed"))
                and trace_dtype(old_meta) == meta["dtype"] and trace_temperature(old_meta) == cfg.temperature
                and model_identity(str(old_meta.get("target") or target.name)) == model_identity(target.name)):
            wanted = {p.question_id for p in prompts}
            kept = [t for t in old if t.question_id not in wanted]
            meta["splits"] = {q: s for q, s in (old_meta.get("splits") or {}).items() if q not in wanted}
    traces = [record_trace(target, draft, target.encode(p.text, chat=True), cfg.max_new_tokens, cfg.k_max,
                           p.question_id, p.category, sampling, cfg.trace_seed + zlib.crc32(p.question_id.encode()))
              for p in tqdm(prompts, desc="traces", disable=not cfg.progress, file=sys.stderr)]
    meta["splits"].update({p.question_id: p.split for p in prompts})
    save_traces(kept + traces, trace_path, meta)
    rate = sum(min(m, cfg.k_max) for t in traces for m in t.matches) / max(1, sum(t.available[i] for t in traces for i in range(len(t.matches))))
    print(f"traces of {len(traces)} prompts ({len(kept)} kept from before): {trace_path} "
          f"(mean matched share of available drafts {rate:.3f})")
    return trace_path
