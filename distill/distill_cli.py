"""Distil a draft head (decoding/head_draft.py) for a target, offline, on a CPU in a few hours (resumable).

Stages, each resumable from the work folder:
1. prompts: the project's train split + synthetic prompts built from Python's standard library;
2. the target's own greedy answers to them (batched generation), appended to generations.jsonl;
3. teacher-forced features: one target forward per sequence gives, at every position, its hidden states
   of the layers the head reads (EAGLE-3's low / middle / high features, float16), its last hidden state H
   and its top-8 next-token probabilities (feature shards); Python's standard-library source is added as
   teacher-forced text;
4. training: from a start position t the head is unrolled `depth` steps exactly as it runs at
   inference (its own state fed back, the true next tokens as input), with cross-entropy against the
   target's top-8 probabilities on the sub-vocabulary plus a smooth-L1 pull of its state towards H;
   checkpoints every few hundred steps (optimizer, schedule and sampler state included); the held-out
   answers give top-1 by depth and the tokens accepted per step at k = 1 .. 8;
5. export: the head's folder (tens of MB), loadable with `--draft PATH` (or `--draft default`); its config records
   the ids of the prompts whose answers it learned from (`trained.prompt_ids`), which the policy chain and the rule
   tuning then leave out of the train split (`HeadConfig.distilled_on`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specpilot.decoding.config import parse_config
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import (
    DEFAULT_DRAFT,
    HeadDrafter,
    save_head,
)
from specpilot.decoding.models import cache_dir, load_target
from specpilot.decoding.tracking import start_tracking

from .corpus import (IGNORE, choose_vocab, collect_prompts, corpus_rows, extract_features, generate_answers,
                     parse_layers, say, seed_answers)
from .head_training import measure_cost, plot_history, report_lines, train_head


@dataclass
class DistillConfig:
    """Distil a draft head for a target from the target's own answers (offline; CPU or GPU)."""

    target: str = "embedded"
    """Target model: 'embedded' (SmolLM2-135M-Instruct, offline), a hub id, a folder or a .gguf file."""
    out: str = DEFAULT_DRAFT
    """Folder of the exported head (draft_head.json + draft_head.safetensors)."""
    work_dir: str = ""
    """Data, features and checkpoints (default: the specpilot cache folder, distill/NAME); reused on
    rerun, so a killed run resumes."""
    prompts: str | None = None
    """Prompt JSONL whose train split is used (default: the project's set; the test split is never used)."""
    synthetic_prompts: int = 640
    """Extra prompts built from Python's standard library (code, docstrings) over the eight categories."""
    corpus_tokens: int = 160000
    """Teacher-forced tokens of Python's standard-library source (code, comments, docstrings) added to
    the target's answers: the head learns the same map (target state, next token) -> target's next
    prediction on any text, and 60k answer tokens alone overfit (0 = answers only)."""
    corpus_sources: str = "stdlib,docs"
    """Where the teacher-forced text comes from, sharing `corpus_tokens` equally: 'stdlib' (Python's standard
    library source) and 'docs' (installed packages' descriptions and documentation, Debian's /usr/share/doc)."""
    max_answers: int = 0
    """Generate the target's answers for at most this many prompts in all (a seeded choice beyond those already
    generated; 0 = every prompt)."""
    answer_weight: int = 2
    """How many times more often a position of the target's own answers is sampled than a corpus one."""
    max_prompt_tokens: int = 384
    """Prompts longer than this (chat-formatted) are skipped."""
    max_new_tokens: int = 128
    """Length of the target's greedy answer per prompt."""
    gen_batch: int = 16
    """Prompts generated together (left-padded batch)."""
    vocab: int = 8192
    """Sub-vocabulary size: the most frequent target tokens the head can propose (FR-Spec)."""
    feature_layers: str = "auto"
    """The target's layers the head reads at its first step, as indices into its `hidden_states` (0 = the
    embeddings, -1 = the last layer after the final norm), comma-separated; 'auto' = a third and two thirds of
    the way up plus the last (EAGLE-3's low, middle and high features); '-1' = the last layer only."""
    soft_labels: int = 8
    """Train on the target's top-N next-token probabilities (renormalised on the sub-vocabulary) rather than
    its greedy token alone (1 = the greedy token)."""
    blocks: int = 2
    """Residual MLP blocks in the head."""
    intermediate_size: int = 1536
    """Width of each block's SwiGLU MLP."""
    depth: int = 4
    """Draft steps unrolled in training (the head is trained as it runs: on its own state)."""
    steps: int = 2000
    """Optimizer steps."""
    batch_size: int = 128
    """Start positions per step (each unrolled `depth` times)."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    feature_weight: float = 0.1
    """Weight of the smooth-L1 loss between the head's state and the target's hidden state."""
    val_fraction: float = 0.05
    """Share of sequences held out to report accuracy (never trained on)."""
    checkpoint_every: int = 250
    """Save a checkpoint every this many steps (and on Ctrl-C)."""
    fresh: bool = False
    """Ignore an existing checkpoint and train from scratch (data and features are still reused)."""
    device: str = "auto"
    """Torch device: auto | cpu | cuda[:N]."""
    seed: int = 0
    """Seed of the synthetic prompts, the head's initialisation and the batch sampler."""
    track: bool = True
    """Track the run with W&B (online with WANDB_API_KEY, else offline)."""
    wandb_project: str = "specpilot"
    """W&B project name."""
    progress: bool = True
    """Show progress bars."""


def distill(cfg: DistillConfig) -> Path:
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else cache_dir() / "distill" / out.name
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, dtype="float32" if cfg.device in ("auto", "cpu") else "auto", device=cfg.device)
    prompts = collect_prompts(cfg)
    say(f"{len(prompts)} prompts; work folder {work}")
    seed_answers(cfg, work / "generations.jsonl")
    rows = generate_answers(target, prompts, work / "generations.jsonl", cfg.max_new_tokens, cfg.gen_batch,
                            cfg.max_prompt_tokens, cfg.progress, cfg.max_answers, cfg.seed)
    if not rows:
        raise SpecPilotError(f"no prompt fits in --max-prompt-tokens {cfg.max_prompt_tokens}")
    corpus = corpus_rows(target, cfg.corpus_tokens, cfg.seed, sources=cfg.corpus_sources)
    layers = parse_layers(cfg.feature_layers, int(target.model.config.num_hidden_layers))
    data = extract_features(target, rows + corpus, work / "features", layers, top=max(1, cfg.soft_labels),
                            progress=cfg.progress)
    data["answers"] = len(rows)
    vocab_ids = choose_vocab(data, rows, cfg.vocab, target.eos_ids)
    index = torch.full((target.vocab_size,), IGNORE, dtype=torch.long)
    index[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    data["sub_labels"] = index[data["labels"]]
    data["sub_top"] = index[data["top_ids"]]
    coverage = float((data["sub_labels"] != IGNORE).float().mean())
    say(f"{data['labels'].numel()} positions from {len(rows)} answers and {len(corpus)} corpus pieces; "
         f"sub-vocabulary {len(vocab_ids)} covers {coverage:.1%}")
    data = {k: (v.to(target.device) if torch.is_tensor(v) else v) for k, v in data.items()}
    run = start_tracking(cfg.track, cfg.wandb_project, work, {**asdict(cfg), "positions": int(data["labels"].numel()),
                                                              "vocab_coverage": coverage})
    try:
        head, result = train_head(cfg, target, data, vocab_ids, work, run, layers=tuple(layers))
        head.cfg.trained["vocab_coverage"] = round(coverage, 4)
        # which prompts' answers it learned from: a policy for this head must not be tuned on them (head_draft.distilled_on)
        head.cfg.trained["prompt_ids"] = sorted({str(r["id"]) for r in rows})
        probe = rows[0]["prompt_ids"] + rows[0]["answer_ids"][:32]
        head.cfg.trained["cost"] = measure_cost(target, HeadDrafter(head, target.model), probe)
        if run is not None:
            run.log({f"cost/{k}": v for k, v in head.cfg.trained["cost"].items()})
        save_head(head, out)
        (work / "history.json").write_text(json.dumps(result["history"]))
        plotted = plot_history(result["history"], work / "history.png")
        if plotted:
            say(f"training curve: {plotted}")
    finally:
        if run is not None:
            run.finish()
    say(f"draft head written to {out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters)")
    for line in report_lines(head.cfg.trained):
        say(line)
    return out


def main(argv: list[str] | None = None) -> int:
    """scripts/distill_draft.py: parse the flags and run `distill`."""
    distill(parse_config(DistillConfig, argv))
    return 0
