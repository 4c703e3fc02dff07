"""Which fp32 matrix-product path a CPU target should run: `python -m specpilot.bench.gemm` (about 3 minutes).

A verify pass of k >= 1 drafted tokens costs this CPU 1.6-2.1x a plain step at one row, and that ratio decides
when drafting pays. Most of it is the kernel: torch's x @ W^T for 2-4 rows is 2-2.5x the cost of one row here,
while the same product handed over as W @ x^T is not (`decoding.models.SmallRowLinear`), and one row padded
with a zero row to two costs less than one row either way (a plain step 1.44x faster). This times real steps
of the loop (`speculative_step` verifying k random drafted tokens, as `profile_device.py` does) with nn.Linear
and with SmallRowLinear, alternating within each repeat so that the machine's drift cancels, and reports per
(batch size, k) the median step of each, their paired ratio with an interval, and each path's verify cost over
its own plain step. It also decodes a prompt greedily with both paths and says whether the tokens agree.
Prints a table and writes JSON."""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass

from tqdm import tqdm

from specpilot.decoding.config import at_least, parse_config, parse_ints, run_cli
from specpilot.decoding.loop import generate
from specpilot.decoding.models import NgramDrafter, load_target, use_small_row_gemm
from specpilot.decoding.paths import atomic_write_text
from specpilot.decoding.policies import StaticK
from specpilot.decoding.prompts import load_prompts
from specpilot.env.profile import profile_batches

from .benchmark import paired_ratio

KERNELS = ("linear", "small-rows")


@dataclass
class GemmConfig:
    """Step cost of the CPU target with torch's linear and with SmallRowLinear, side by side."""

    target: str = "embedded"
    """Target model (fp32 on the CPU)."""
    batch_sizes: str = "1,2,4"
    """Comma-separated batch sizes timed (rows x (k + 1) tokens per verify pass)."""
    k_max: int = 8
    """Largest k timed (k = 0 is the plain step)."""
    context_len: int = 256
    """Tokens in each row's cache when the steps are timed."""
    repeats: int = 7
    """Repeats; in each, both paths are timed once at every (batch size, k), in alternating order."""
    check_tokens: int = 48
    """Tokens decoded greedily with both paths (plain and static:4 with prompt lookup) to compare; 0 = skip."""
    out: str = "runs/gemm.json"
    """JSON written with every step time and the summary."""
    progress: bool = True
    """Show a progress bar."""


def time_paths(target, prompt_ids: list[int], batch_sizes: list[int], k_max: int, context_len: int, repeats: int,
               progress: bool = False) -> dict[str, list]:
    """{path: [repeat][batch index][k] step seconds}: both paths timed in every repeat, their order alternating.
    The model is left on nn.Linear."""
    target = dataclasses.replace(target, eos_ids=frozenset())  # an EOS must not end a timing sequence
    seconds: dict[str, list] = {kernel: [] for kernel in KERNELS}
    bar = tqdm(total=repeats * len(KERNELS), desc="gemm", disable=not progress, file=sys.stderr)
    try:
        for r in range(repeats):
            for kernel in (KERNELS if r % 2 == 0 else KERNELS[::-1]):
                use_small_row_gemm(target.model, kernel == "small-rows")
                got = profile_batches(target, None, prompt_ids, k_max, context_len, 1, batch_sizes)
                seconds[kernel].append(got["batch_verify_s"])
                bar.update()
    finally:
        use_small_row_gemm(target.model, False)
        bar.close()
    return seconds


def summarize(seconds: dict[str, list], batch_sizes: list[int], k_max: int) -> list[dict]:
    """One row per (batch size, k): each path's median step (ms) and its verify cost over its own plain step,
    and the paired speedup of small-rows over linear (repeat by repeat) with its interval."""
    rows = []
    for i, b in enumerate(batch_sizes):
        for k in range(k_max + 1):
            row = {"batch_size": b, "k": k}
            for kernel in KERNELS:
                steps = [rep[i][k] for rep in seconds[kernel]]
                plain = [rep[i][0] for rep in seconds[kernel]]
                row[f"{kernel}_ms"] = 1e3 * statistics.median(steps)
                row[f"{kernel}_over_plain"] = statistics.median(s / p for s, p in zip(steps, plain))
            speedup, interval = paired_ratio([a[i][k] / s[i][k] for a, s in zip(seconds["linear"], seconds["small-rows"])])
            row["speedup"], row["interval"] = speedup, interval
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'B':>3} {'k':>2} {'linear ms':>10} {'small-rows ms':>14} {'speedup [interval]':>24}"
            f" {'linear / plain':>15} {'small-rows / plain':>19}")
    lines = [head]
    for r in rows:
        interval = f" [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]" if r["interval"] else ""
        lines.append(f"{r['batch_size']:>3} {r['k']:>2} {r['linear_ms']:>10.1f} {r['small-rows_ms']:>14.1f} "
                     f"{r['speedup']:.3f}{interval:>18} {r['linear_over_plain']:>15.2f} {r['small-rows_over_plain']:>19.2f}")
    return "\n".join(lines)


def same_tokens(target, prompt_ids: list[int], tokens: int) -> dict[str, bool]:
    """{policy: whether greedy decoding gives the same tokens on both paths}, plain and static:4 with lookup."""
    out = {}
    for name, draft, policy in (("plain", None, StaticK(0)), ("static:4", NgramDrafter(max_n=3), StaticK(4))):
        got = []
        for kernel in KERNELS:
            use_small_row_gemm(target.model, kernel == "small-rows")
            got.append(generate(target, draft, policy, prompt_ids, tokens).token_ids)
        use_small_row_gemm(target.model, False)
        out[name] = got[0] == got[1]
    return out


def gemm_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(GemmConfig, argv)
    at_least(1, repeats=cfg.repeats, context_len=cfg.context_len)
    at_least(0, k_max=cfg.k_max, check_tokens=cfg.check_tokens)
    sizes = parse_ints(cfg.batch_sizes, "--batch-sizes")
    target = load_target(cfg.target, "float32", "cpu", gemm="linear")
    prompt_ids = target.encode(load_prompts(None)[0].text, chat=True)
    seconds = time_paths(target, prompt_ids, sizes, cfg.k_max, cfg.context_len, cfg.repeats, cfg.progress)
    rows = summarize(seconds, sizes, cfg.k_max)
    print(f"step seconds at context {cfg.context_len}, {cfg.repeats} repeats; speedup = linear / small-rows, paired "
          "within each repeat")
    print(format_table(rows))
    agree = same_tokens(target, prompt_ids, cfg.check_tokens) if cfg.check_tokens else {}
    for name, same in agree.items():
        print(f"greedy tokens, {name}, {cfg.check_tokens} tokens: {'identical' if same else 'DIFFER'} on both paths")
    atomic_write_text(cfg.out, json.dumps({"config": vars(cfg), "target": target.name, "summary": rows,
                                           "same_tokens": agree, "seconds": seconds}, indent=1))
    print(f"written: {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(gemm_main))
