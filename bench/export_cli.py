"""The export command: `python scripts/export_vllm_table.py` turns a length policy into vLLM's
num_speculative_tokens_per_batch_size table for a device."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specpilot.decoding.config import parse_config, parse_ints, warn
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.hardware import resolve_device
from specpilot.decoding.models import draft_name
from specpilot.decoding.paths import atomic_write_text, output_dir, policy_dir, profile_path, relative, traces_path
from specpilot.decoding.policy_spec import parse_policy
from specpilot.decoding.rule_spec import resolve_k_max
from specpilot.env.oracle import (
    CostModel,
    load_profile,
    load_traces,
    profile_hardware,
    train_traces,
)

from .batch_table import BatchContextTableK, BatchTableK, policy_to_table, trtllm_schedule, vllm_ranges


@dataclass
class ExportVllmConfig:
    """Turn a length policy into vLLM's num_speculative_tokens_per_batch_size table for this device."""

    policy: str = "learned"
    """The policy to query: learned | learned:PATH | batch-table | static:K | heuristic."""
    device: str = "auto"
    """Device whose cost profile and policy are used: auto | cpu | a100 | h100 | ... (a device key)."""
    draft: str = "default"
    """The draft the table is for (names the traces file profiles/traces-DRAFT.json)."""
    max_batch: int = 16
    """Largest batch size in the table (the last range ends here)."""
    episodes: int = 8
    """Replayed batches per batch size on which the policy is queried."""
    profile: str | None = None
    """Cost profile (default: profiles/DEVICE.json; must include batch sizes)."""
    traces: str | None = None
    """Acceptance traces (default: profiles/traces-DRAFT.json); the train split gives the observations."""
    k_max: int | None = None
    """Largest draft length a policy may choose (default: a learned policy's own k_max, else 8; a value
    that differs from a learned policy's is an error: its features are scaled by the k_max it was trained with)."""
    allow_device_mismatch: bool = False
    """Accept a learned policy trained on another device."""
    out: str | None = None
    """JSON file to write (default: policies/DEVICE/DRAFT/vllm_table.json, beside the policy); the TensorRT-LLM
    draft_len_schedule goes beside it, named after it (vllm_table*.json -> trtllm_schedule*.json, else
    NAME-trtllm_schedule.json), so exports of two policies into one folder keep both schedules."""
    context_lens: str = ""
    """Add a context-length axis at these lengths (e.g. 512,4096,16384): 5-item entries [start_bs, end_bs,
    start_ctx, end_ctx, k] (vLLM PR 48944), the policy queried with its rows at each length."""


def schedule_path(table: Path) -> Path:
    """Where the TensorRT-LLM schedule of the vLLM table `table` goes: beside it, named after it."""
    if "vllm_table" in table.name:
        return table.with_name(table.name.replace("vllm_table", "trtllm_schedule"))
    return table.with_name(f"{table.stem}-trtllm_schedule.json")


def export_vllm_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ExportVllmConfig, argv)
    if cfg.max_batch < 1:
        raise SpecPilotError(f"--max-batch must be >= 1, got {cfg.max_batch}")
    # no model runs here: any device's profile can be exported on any machine
    device = resolve_device("auto")[0] if cfg.device == "auto" else cfg.device.strip().lower()
    source = Path(cfg.profile) if cfg.profile else profile_path(device, draft_name(cfg.draft))
    profile = load_profile(source)
    if not profile.get("batch_sizes"):
        raise SpecPilotError(f"the cost profile {source} has no batch sizes; rerun scripts/profile_device.py")
    traces, meta = load_traces(cfg.traces or traces_path(draft_name(cfg.draft)))
    traces = train_traces(traces, meta)
    if cfg.policy == "batch-table":
        cfg.k_max = resolve_k_max(cfg.k_max, [])
        policy = BatchTableK.from_profile(profile, traces, cfg.k_max)
    else:
        policy = parse_policy(cfg.policy, resolve_k_max(cfg.k_max, []), allow_device_mismatch=cfg.allow_device_mismatch,
                              device=device, draft=draft_name(cfg.draft))
        cfg.k_max = resolve_k_max(cfg.k_max, [policy])
    hardware = profile_hardware(profile)
    budget = getattr(policy, "meta", {}).get("max_new_tokens")  # a learned policy: the budget it was trained with
    warn(CostModel.from_profile(profile).outside([cfg.max_batch]))
    chosen, counts = policy_to_table(policy, traces, CostModel.from_profile(profile), cfg.k_max, cfg.max_batch,
                                     hardware, cfg.episodes, max_new_tokens=budget)
    ranges = vllm_ranges(chosen, cfg.max_batch)
    result = {
        "num_speculative_tokens": max(1, max(k for _, _, k in ranges)),
        "num_speculative_tokens_per_batch_size": ranges,
        "device": device, "hardware_name": profile.get("hardware_name"), "policy": relative(policy.path) if getattr(policy, "path", None) else cfg.policy,
        "draft": meta.get("draft"), "target": meta.get("target"),
        "k_chosen_per_batch_size": {str(b): counts[b] for b in counts},
        "note": "inclusive [start_bs, end_bs, k] ranges; k = the policy's mean choice (rounded) at that batch size "
                "on replayed train-split traces (speculative_config.num_speculative_tokens_per_batch_size)",
    }
    if cfg.context_lens:
        contexts = parse_ints(cfg.context_lens, "--context-lens")
        by_cell = {}
        for c in contexts:
            chosen_c, _ = policy_to_table(policy, traces, CostModel.from_profile(profile), cfg.k_max, cfg.max_batch,
                                          hardware, cfg.episodes, max_new_tokens=budget, context_len=c)
            by_cell.update({(b, c): k for b, k in chosen_c.items()})
        result["num_speculative_tokens_per_batch_size_and_context"] = BatchContextTableK(by_cell, cfg.k_max).vllm_entries(
            cfg.max_batch, max(contexts) * 2 - 1)
    out = Path(cfg.out) if cfg.out else policy_dir(device, draft_name(cfg.draft), output_dir("policies")) / "vllm_table.json"
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    schedule = {"draft_len_schedule": {str(b): k for b, k in trtllm_schedule(chosen).items()},
                "note": "TensorRT-LLM: batch size -> draft length, a key covering the sizes up to it; above the largest "
                        f"key speculation is off. From {result['policy']} on {device}.",
                "device": device, "draft": meta.get("draft")}
    atomic_write_text(schedule_path(out), json.dumps(schedule, indent=1) + "\n")
    print(json.dumps({"num_speculative_tokens": result["num_speculative_tokens"],
                      "num_speculative_tokens_per_batch_size": ranges}))
    print(f"written: {out}")
    return 0
