"""Simulated GPU cost profiles: a roofline model of decode and verify forwards on a chip's published numbers.

A forward of a decoder-only model over `tokens` new tokens per row, for `batch` rows at context `c`:
    bytes  = the weights (once) + the KV cache each row reads (c tokens) and writes (its new tokens)
    flops  = 2 * matmul parameters * batch * tokens + 4 * layers * attention width * batch * tokens * c
    time   = max(bytes / (HBM bandwidth * BW_EFFICIENCY), flops / (bf16 peak * FLOP_EFFICIENCY))
             + layers * LAYER_FLOOR_S                       (kernel launches: the fixed floor)
The target verifying k drafted tokens runs one forward over k + 1 tokens per row; a draft model proposing
k tokens runs k forwards of one token; the n-gram draft's host-side lookup (tens of microseconds against
steps of milliseconds) is left out. The
cost of a forward does not depend on the weights' values and the acceptance of a greedy draft does not
depend on the chip, so such a profile plus the acceptance traces recorded on the CPU make a replay env
for the chip. Everything written from here says "simulated".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import read_json_file


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_gb_s: float
    """HBM bandwidth, GB/s."""
    bf16_tflop_s: float
    """Dense bf16 tensor-core peak, TFLOP/s (no sparsity)."""
    memory_gb: float
    source: str


CHIPS = {
    "a100": Chip("NVIDIA A100-SXM4-80GB", 2039, 312, 80, "NVIDIA A100 datasheet, SXM 80 GB"),
    "h100": Chip("NVIDIA H100 80GB HBM3", 3350, 989, 80, "NVIDIA H100 datasheet, SXM"),
    "h200": Chip("NVIDIA H200", 4800, 989, 141, "NVIDIA H200 datasheet, SXM"),
    "l4": Chip("NVIDIA L4", 300, 121, 24, "NVIDIA L4 datasheet"),
}
BW_EFFICIENCY = 0.75
"""Share of the HBM bandwidth decode kernels reach (60-85% is typical)."""
FLOP_EFFICIENCY = 0.6
"""Share of the tensor peak reached (50-70% is typical)."""
LAYER_FLOOR_S = 10e-6
"""Fixed cost per layer and forward (kernel launches; CUDA graphs bring it down to a few microseconds)."""
BYTES = 2  # bf16


@dataclass(frozen=True)
class Condition:
    """A machine condition a shared or throttled GPU runs under, and what its NVML counters read under it."""

    name: str
    sm_clock_ratio: float
    """SM clock / its maximum (a power cap or thermal throttling lowers it): the FLOP peak and the small
    kernels' fixed floor scale with it; the HBM bandwidth does not (the memory clock is separate)."""
    hbm_share: float
    """Share of the HBM bandwidth a co-tenant process takes (MPS or time-sliced sharing)."""
    description: str


CONDITIONS = {
    "none": Condition("none", 1.0, 0.0, "the chip to itself at full clock"),
    "power-cap": Condition("power-cap", 0.55, 0.0, "a power cap (nvidia-smi -pl) or thermal throttling: SM clock at 55%"),
    "cotenant": Condition("cotenant", 1.0, 0.5, "a memory-bound co-tenant takes half of the HBM bandwidth"),
    "both": Condition("both", 0.55, 0.5, "power cap and co-tenant together"),
}


def condition_counters(device: str, condition: Condition) -> list[float]:
    """The hardware features (decoding.hardware.HW_FEATURES) as NVML would read them while this device decodes
    under `condition`: GPU busy, SM clock ratio, power near the cap when capped, memory-busy time and (Hopper
    and newer: GPM) DRAM bandwidth utilisation raised by a co-tenant. Decoding alone keeps HBM ~70% busy."""
    from specpilot.decoding.hardware import HW_FEATURES, NEUTRAL

    gpm = device in ("h100", "h200")
    own = 0.7 * (1.0 - condition.hbm_share)  # our share of the memory traffic
    values = {"hw_is_gpu": 1.0, "hw_gpu_util": 1.0, "hw_gpu_mem_util": min(1.0, own + condition.hbm_share),
              "hw_sm_clock_ratio": condition.sm_clock_ratio,
              "hw_power_ratio": 0.98 if condition.sm_clock_ratio < 1.0 else 0.55 + 0.3 * condition.hbm_share,
              "hw_temperature": 0.6 + 0.15 * condition.hbm_share,
              "hw_gpm_available": 1.0 if gpm else 0.0,
              "hw_gpm_dram_bw_util": min(1.0, own + condition.hbm_share) if gpm else 0.0,
              "hw_gpm_sm_occupancy": (0.3 + 0.2 * condition.hbm_share) if gpm else 0.0,
              "hw_cpu_available": 1.0, "hw_cpu_util": 0.15, "hw_cpu_freq_ratio": 1.0, "hw_load_per_core": 0.1}
    return [float(values.get(name, NEUTRAL.get(name, 0.0))) for name in HW_FEATURES]


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's shape (from its config.json)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, path: str | Path) -> "Shape":
        folder = Path(path)
        config = read_json_file(folder / "config.json" if folder.is_dir() else folder, "model config")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(int(config["num_hidden_layers"]), hidden, heads, int(config.get("num_key_value_heads", heads)),
                       int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                       int(config["vocab_size"]), bool(config.get("tie_word_embeddings", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecPilotError(f"model config {path} lacks a decoder's shape ({exc})") from None

    @property
    def matmul_params(self) -> int:
        """Parameters in matrix multiplies per token: attention, MLP and the LM head."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.matmul_params + (0 if self.tied else self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES


def forward_seconds(shape: Shape, chip: Chip, batch: int, tokens: int, context: int,
                    condition: Condition = CONDITIONS["none"]) -> float:
    """Roofline seconds of one forward over `tokens` new tokens per row (module docstring), under `condition`."""
    moved = shape.matmul_params * BYTES + batch * (context + tokens) * shape.kv_bytes_per_token
    flops = 2 * shape.matmul_params * batch * tokens + 4 * shape.layers * shape.heads * shape.head_dim * batch * tokens * context
    bandwidth = chip.hbm_gb_s * 1e9 * BW_EFFICIENCY * (1.0 - condition.hbm_share)
    peak = chip.bf16_tflop_s * 1e12 * FLOP_EFFICIENCY * condition.sm_clock_ratio
    return max(moved / bandwidth, flops / peak) + shape.layers * LAYER_FLOOR_S / condition.sm_clock_ratio


def simulate_profile(device: str, target_config: str, draft_config: str | None, k_max: int, batch_sizes: list[int],
                     context_lens: list[int], condition: str = "none") -> dict:
    """A cost profile in the measured profiles' format (plus the full batch x context grid), for `device`
    under the machine `condition` (CONDITIONS), with the hardware counters as they would read under it."""
    if device not in CHIPS:
        raise SpecPilotError(f"--simulate {device}: known chips are {', '.join(CHIPS)}")
    if condition not in CONDITIONS:
        raise SpecPilotError(f"--condition {condition}: known conditions are {', '.join(CONDITIONS)}")
    state = CONDITIONS[condition]
    chip, target = CHIPS[device], Shape.from_config(target_config)
    draft = Shape.from_config(draft_config) if draft_config else None
    fits = chip.memory_gb * 1e9 - target.params * BYTES - (draft.params * BYTES if draft else 0)
    if fits <= 0:
        raise SpecPilotError(f"{target_config} does not fit in the {chip.memory_gb:g} GB of a {device}")

    def verify(b, k, c):
        return forward_seconds(target, chip, b, k + 1, c, state)

    def draft_per_token(b, c):
        return forward_seconds(draft, chip, b, 1, c, state) if draft else 0.0

    contexts, sizes = sorted(context_lens), sorted(batch_sizes)
    base = contexts[0]
    grid = {"batch_sizes": sizes, "context_lens": contexts,
            "verify_s": [[[verify(b, k, c) for k in range(k_max + 1)] for c in contexts] for b in sizes],
            "draft_s_per_token": [[draft_per_token(b, c) for c in contexts] for b in sizes]}
    kv_limit = {b: int(fits / (b * target.kv_bytes_per_token)) for b in sizes}
    return {
        "simulated": True, "condition": asdict(state),
        "device": device, "hardware_name": f"{chip.name} (simulated{'' if condition == 'none' else ', ' + condition})",
        "target": f"shape of {target_config}", "draft": f"shape of {draft_config}" if draft_config else "ngram",
        "dtype": "bfloat16",
        "model": {"chip": asdict(chip), "bw_efficiency": BW_EFFICIENCY, "flop_efficiency": FLOP_EFFICIENCY,
                  "layer_floor_s": LAYER_FLOOR_S,
                  "target_shape": asdict(target), "target_params": target.params,
                  "draft_shape": asdict(draft) if draft else None, "draft_params": draft.params if draft else 0,
                  "kv_cache_tokens_that_fit_per_row": kv_limit,
                  "formula": "max(bytes / (HBM GB/s * bw_eff), flops / (bf16 peak * flop_eff)) + layers * floor"},
        "context_lens": contexts, "k": list(range(k_max + 1)),
        "verify_s": [[verify(1, k, c) for k in range(k_max + 1)] for c in contexts],
        "draft_s_per_token": [draft_per_token(1, c) for c in contexts],
        "noise": 0.02, "repeats": 0, "hardware": condition_counters(device, state),
        "batch_sizes": sizes, "batch_context_len": base,
        "batch_verify_s": [[verify(b, k, base) for k in range(k_max + 1)] for b in sizes],
        "batch_draft_s_per_token": [draft_per_token(b, base) for b in sizes],
        "grid": grid,
    }


def compare_profiles(simulated: dict, measured: dict) -> list[dict]:
    """Cell by cell (context, k at B = 1; batch, k at the batch context): measured / simulated seconds."""
    rows = []
    for c in simulated["context_lens"]:
        if c in measured["context_lens"]:
            i, j = simulated["context_lens"].index(c), measured["context_lens"].index(c)
            for k, (s, m) in enumerate(zip(simulated["verify_s"][i], measured["verify_s"][j])):
                rows.append({"batch": 1, "context": c, "k": k, "simulated_s": s, "measured_s": m, "ratio": m / s})
    for b in simulated.get("batch_sizes", []):
        if b in measured.get("batch_sizes", []) and measured.get("batch_context_len") == simulated.get("batch_context_len"):
            i, j = simulated["batch_sizes"].index(b), measured["batch_sizes"].index(b)
            for k, (s, m) in enumerate(zip(simulated["batch_verify_s"][i], measured["batch_verify_s"][j])):
                rows.append({"batch": b, "context": simulated["batch_context_len"], "k": k, "simulated_s": s,
                             "measured_s": m, "ratio": m / s})
    return rows


def save_profile(profile: dict, path: str | Path) -> Path:
    from specpilot.decoding.paths import atomic_write_text

    return atomic_write_text(path, json.dumps(profile, indent=1))
