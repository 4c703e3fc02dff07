"""What an extension's copied token costs the head: `python -m specpilot.bench.advance_share --device cpu`.

The hybrid drafter's `extend` source copies the lookup's tokens and lets the head draft on from its state advanced
through them (decoding/hybrid.py `_extend`): one `advance` per copied token (the head's recurrent step on the token's
embedding), without the projection on the sub-vocabulary and the sampling that a drafted token also pays. The replay
env and the oracle price a copied token at `env.sources.ADVANCE_SHARE` of a drafted one. This times both on real
prompts (the hybrid traces' train prompts, a category at a time, the target's hidden state at each prompt's end): a head token as the cost
profile times it (`propose` of k tokens, per token) and an advance as `_extend` runs it (per copied token), and
prints their ratio. A table on stdout, JSON in --out.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.decoding.config import parse_config, run_cli
from specpilot.decoding.drafters import hidden_features
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.models import load_draft, load_target
from specpilot.decoding.paths import atomic_write_text, traces_path
from specpilot.decoding.sampling import Sampling
from specpilot.env.oracle import load_traces


@dataclass
class AdvanceShareConfig:
    """Seconds of the head's advance through one copied token against one drafted head token, on real prompts."""

    device: str = "auto"
    """Device: auto | cpu | cuda[:N]."""
    target: str = "embedded"
    """Target model (see generate --target); one whose hidden states the head reads."""
    draft: str = "hybrid"
    """The hybrid draft (its head is timed)."""
    prompts: int = 12
    """Train-split prompts of the hybrid traces to time on, taken a category at a time."""
    k: int = 8
    """Tokens per timed draft and advances per timed extension."""
    repeats: int = 15
    """Timed repeats per prompt (after one untimed); medians are reported."""
    out: str = "runs/advance-share"
    """Folder for advance_share.json."""


def time_head(draft, context: torch.Tensor, hidden: torch.Tensor, k: int, repeats: int) -> tuple[float, float]:
    """(seconds per drafted head token, seconds per advance through a copied token), medians over `repeats`."""
    head, greedy = draft.head, Sampling()

    def drafted() -> float:
        t0 = time.perf_counter()
        n = head.propose(context, k, greedy, None, target_hidden=hidden).tokens.shape[0]
        return (time.perf_counter() - t0) / max(n, 1)

    def advanced() -> float:  # decoding/hybrid.py `_extend`'s loop over the copied tokens
        copied = context[-k:][None]
        t0 = time.perf_counter()
        state = head.head.start(hidden)
        token = context[-1:]
        for j in range(k):
            state = head.head.advance(state, head.embed(token))
            token = copied[:, j]
        return (time.perf_counter() - t0) / k

    with torch.inference_mode():
        drafted(), advanced()
        tokens = [drafted() for _ in range(repeats)]
        advances = [advanced() for _ in range(repeats)]
    return statistics.median(tokens), statistics.median(advances)


def advance_share_main(argv: list[str] | None = None) -> int:
    cfg = parse_config(AdvanceShareConfig, argv, description=__doc__.splitlines()[0])
    if cfg.prompts < 1 or cfg.k < 1 or cfg.repeats < 1:
        raise SpecPilotError(f"--prompts, --k and --repeats must be >= 1, got {cfg.prompts}, {cfg.k}, {cfg.repeats}")
    target = load_target(cfg.target, device=cfg.device)
    draft = load_draft(cfg.draft, target)
    if getattr(draft, "head", None) is None or getattr(draft, "lookup", None) is None:
        raise SpecPilotError(f"--draft is a hybrid draft (prompt lookup and a head), got '{cfg.draft}'")
    traces, meta = load_traces(traces_path(cfg.draft))
    splits = meta.get("splits", {})
    train = [t for t in traces if splits.get(t.question_id, "train") == "train"]
    by_category: dict[str, list] = {}
    for t in train:
        by_category.setdefault(t.category, []).append(t)
    chosen = [t for group in zip(*by_category.values()) for t in group][: cfg.prompts]  # a category at a time
    rows = []
    print(f"{'prompt':<28}{'head token ms':>15}{'advance ms':>12}{'share':>8}")
    for trace in chosen:
        context = torch.tensor(trace.prompt_ids, dtype=torch.long, device=target.device)
        with torch.inference_mode():
            out = target.model(input_ids=context[None, :-1], output_hidden_states=True)
        hidden = hidden_features(out.hidden_states, draft.head)[:, -1]
        token_s, advance_s = time_head(draft, context, hidden, cfg.k, cfg.repeats)
        rows.append({"prompt": trace.question_id, "head_token_s": token_s, "advance_s": advance_s,
                     "share": advance_s / token_s})
        print(f"{trace.question_id:<28}{1e3 * token_s:>15.3f}{1e3 * advance_s:>12.3f}{advance_s / token_s:>8.2f}")
    share = statistics.median(r["share"] for r in rows)
    out = Path(cfg.out)
    atomic_write_text(out / "advance_share.json", json.dumps(
        {"target": target.name, "draft": cfg.draft, "device": str(target.device), "k": cfg.k, "repeats": cfg.repeats,
         "share": share, "rows": rows}, indent=1))
    print(f"advance through a copied token / drafted head token: median {share:.2f} over {len(rows)} prompts "
          f"(env.sources.ADVANCE_SHARE prices it); results: {out / 'advance_share.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(advance_share_main))
