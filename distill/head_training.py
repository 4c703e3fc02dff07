"""Training a draft head on the distilled data: unrolled as at inference, checkpointed (optimizer, schedule and
sampler state) and resumed; top-1 by depth, tokens per step by k, its cost per drafted token, the training curve."""
from __future__ import annotations

from typing import TYPE_CHECKING

import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import (
    DraftHead,
    HeadConfig,
    sub_head_weight,
    target_signature,
)
from specpilot.decoding.loop import speculative_step, start
from specpilot.decoding.sampling import Sampling

from .corpus import IGNORE, say

if TYPE_CHECKING:
    from .distill_cli import DistillConfig


class Batches:
    """Random start positions whose whole `depth`-step chain lies inside one sequence (a sequence
    listed twice in `sequences` is sampled twice as often)."""

    def __init__(self, lengths: list[int], depth: int, sequences: list[int], seed: int):
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        starts = [torch.arange(offsets[s], offsets[s] + lengths[s] - depth) for s in sequences if lengths[s] > depth]
        self.starts = torch.cat(starts) if starts else torch.empty(0, dtype=torch.long)
        if self.starts.numel() == 0:
            raise SpecPilotError(f"no training positions: every sequence is shorter than depth + 1 = {depth + 1}")
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> torch.Tensor:
        return self.starts[torch.randint(self.starts.numel(), (n,), generator=self.generator)]


def unroll(head: DraftHead, data: dict, starts: torch.Tensor, depth: int, embed: torch.Tensor,
           head_weight: torch.Tensor, feature_weight: float, soft_labels: int = 1):
    """(loss, correct) for chains from `starts`: correct[i, b] = step i's top-1 equals the target's greedy token.
    The loss is the cross-entropy against the target's top-`soft_labels` next-token probabilities renormalised
    on the sub-vocabulary (1: its greedy token), plus `feature_weight` x smooth-L1 to its last hidden state."""
    state = head.start(data["features"][starts].float())
    loss = 0.0
    correct = []
    for i in range(1, depth + 1):
        at = starts + i
        state = head.advance(state, embed[data["tokens"][at]])
        logits = head.logits(state, head_weight)
        labels = data["sub_labels"][at]
        if soft_labels > 1:
            sub = data["sub_top"][at][:, :soft_labels]
            weight = data["top_probs"][at][:, :soft_labels].float() * (sub != IGNORE)
            weight = weight / weight.sum(-1, keepdim=True).clamp_min(1e-6)
            logp = torch.log_softmax(logits, dim=-1).gather(1, sub.clamp_min(0))
            loss = loss - (weight * logp).sum(-1).mean()
        else:
            loss = loss + torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)
        if feature_weight:
            loss = loss + feature_weight * torch.nn.functional.smooth_l1_loss(state, data["final"][at].float())
        correct.append((logits.argmax(-1) == labels) & (labels != IGNORE))
    return loss / depth, torch.stack(correct)


def chain_metrics(correct: torch.Tensor, k: int = 4) -> dict:
    """Top-1 accuracy per step and the accept rate at k a greedy verifier would give (prefix rule)."""
    prefix = torch.cumprod(correct[:k].float(), dim=0)
    return {"accept_rate_k%d" % k: float(prefix.sum(0).mean() / k),
            **{f"top1_step{i + 1}": float(c.float().mean()) for i, c in enumerate(correct)}}


def acceptance_by_k(correct: torch.Tensor) -> list[float]:
    """Mean drafted tokens a greedy verifier accepts per step at k = 1 .. depth (chains on the target's answers)."""
    return [round(float(v), 4) for v in torch.cumprod(correct.float(), dim=0).cumsum(0).mean(1)]


def _lr(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


EVAL_DEPTH = 8
"""Draft steps the held-out evaluation unrolls (top-1 by depth, acceptance at k = 1 .. 8)."""


def train_head(cfg: DistillConfig, target, data: dict, vocab_ids: list[int], work: Path, run=None,
               layers: tuple[int, ...] = (-1,)) -> tuple[DraftHead, dict]:
    device = target.device
    torch.manual_seed(cfg.seed)
    model = target.model
    head_cfg = HeadConfig(
        hidden_size=int(model.get_output_embeddings().weight.shape[1]), intermediate_size=cfg.intermediate_size,
        blocks=cfg.blocks, vocab_ids=vocab_ids, target_vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        target_signature=target_signature(model), target_name=target.name, feature_layers=list(layers),
    )
    head = DraftHead(head_cfg).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.01)
    answers = data.get("answers", len(data["lengths"]))  # the first `answers` sequences are the target's answers
    n_val = max(1, int(answers * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(answers, generator=gen).tolist()
    val_seq = order[:n_val]  # held out: answers only, the distribution the draft serves
    train_seq = order[n_val:] * max(1, cfg.answer_weight) + list(range(answers, len(data["lengths"])))
    batches = Batches(data["lengths"], cfg.depth, train_seq, cfg.seed)
    eval_depth = max(cfg.depth, EVAL_DEPTH)
    val_starts = Batches(data["lengths"], eval_depth, val_seq, cfg.seed).starts if n_val else None
    if val_starts is not None:  # an even spread over the held-out answers, at most 4096 chains
        val_starts = val_starts[:: max(1, val_starts.numel() // 4096)][:4096]
    embed = model.get_input_embeddings().weight.detach().float()
    head_weight = sub_head_weight(model, torch.tensor(vocab_ids, device=device)).float()
    step, history = 0, []
    ckpt = work / "checkpoint.pt"
    shape = {k: getattr(cfg, k) for k in ("vocab", "blocks", "intermediate_size", "depth", "seed", "corpus_tokens", "corpus_sources",
                                          "answer_weight", "soft_labels")}
    shape["feature_layers"] = list(layers)
    if ckpt.exists() and not cfg.fresh:
        saved = torch.load(ckpt, weights_only=False)
        if saved["shape"] != shape:
            raise SpecPilotError(f"checkpoint {ckpt} was made with {saved['shape']}, not {shape}; pass --fresh to restart")
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        batches.generator.set_state(saved["sampler"])
        step, history = saved["step"], saved["history"]
        say(f"resuming from {ckpt} at step {step}")

    def save(sampler_state: torch.Tensor):  # write then rename: a kill mid-save leaves the last checkpoint intact
        partial = ckpt.with_suffix(".partial")
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler_state,
                    "step": step, "history": history, "shape": shape}, partial)
        partial.replace(ckpt)

    def evaluate() -> dict:
        if val_starts is None:
            return {}
        head.eval()
        with torch.no_grad():
            _, correct = unroll(head, data, val_starts.to(device), eval_depth, embed, head_weight, 0.0)
        head.train()
        accepted = {f"val/accepted_k{k + 1}": v for k, v in enumerate(acceptance_by_k(correct))}
        return {**{f"val/{k}": v for k, v in chain_metrics(correct).items()}, **accepted}

    bar = tqdm(total=cfg.steps, initial=step, desc="train head", disable=not cfg.progress, file=sys.stderr)
    head.train()
    t0 = time.perf_counter()
    sampler_state = batches.generator.get_state()
    try:
        while step < cfg.steps:
            for group in optimizer.param_groups:
                group["lr"] = _lr(step, cfg.steps, cfg.lr)
            sampler_state = batches.generator.get_state()  # before this step's draw: what a resume must redo
            starts = batches.sample(cfg.batch_size).to(device)
            loss, correct = unroll(head, data, starts, cfg.depth, embed, head_weight, cfg.feature_weight,
                                   soft_labels=cfg.soft_labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step += 1
            record = {"step": step, "loss": float(loss.detach()), **{f"train/{k}": v for k, v in chain_metrics(correct).items()}}
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                record.update(evaluate())
                save(batches.generator.get_state())
            history.append(record)
            if run is not None:
                run.log(record, step=step)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc4=f"{record['train/accept_rate_k4']:.2f}")
            bar.update(1)
    except KeyboardInterrupt:
        save(sampler_state)
        bar.close()
        raise SpecPilotError(f"interrupted at step {step}; checkpoint saved, rerun the same command to resume") from None
    bar.close()
    final = evaluate()
    head.cfg.trained = {"steps": step, "answers": answers, "corpus_sequences": len(data["lengths"]) - answers,
                        "positions": int(data["labels"].numel()),
                        "seconds_this_run": round(time.perf_counter() - t0, 1), **{k: round(v, 4) for k, v in final.items()},
                        "config": asdict(cfg)}
    return head.eval(), {"history": history, "final": final}


@torch.inference_mode()
def measure_cost(target, drafter, prompt_ids: list[int], repeats: int = 30, k: int = EVAL_DEPTH) -> dict:
    """Median milliseconds of one plain target step (one row, no draft) and of one drafted token (a k-token
    draft, divided by k), at the prompt's context, and their ratio: what a drafted token costs in plain steps."""
    plain_state = start(target, None, prompt_ids, repeats + 2)
    plain = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        speculative_step(plain_state, 0)
        plain.append(time.perf_counter() - t0)
    state = start(target, drafter, prompt_ids, 8)
    drafted = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        drafter.propose(state.context, k, Sampling(), None, target_hidden=state.hidden)
        drafted.append((time.perf_counter() - t0) / k)
    plain_ms, draft_ms = 1e3 * statistics.median(plain), 1e3 * statistics.median(drafted)
    return {"plain_step_ms": round(plain_ms, 3), "draft_token_ms": round(draft_ms, 3),
            "draft_token_over_plain_step": round(draft_ms / plain_ms, 4), "context": len(prompt_ids)}


def plot_history(history: list[dict], path: Path) -> Path | None:
    """The held-out top-1 agreement by depth and tokens accepted per step at k = 4 and 8 over the training steps (a
    PNG beside the history); None without held-out points or matplotlib."""
    points = [h for h in history if "val/top1_step1" in h]
    if not points:
        return None
    try:
        import matplotlib  # slow to import: only here

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [h["step"] for h in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for depth in (1, 2, 4, 8):
        if f"val/top1_step{depth}" in points[-1]:
            left.plot(steps, [h[f"val/top1_step{depth}"] for h in points], label=f"depth {depth}")
    left.set(xlabel="training step", ylabel="top-1 agreement (held out)", title="draft head: agreement with the target")
    left.legend(fontsize=8)
    for k in (2, 4, 8):
        if f"val/accepted_k{k}" in points[-1]:
            right.plot(steps, [h[f"val/accepted_k{k}"] for h in points], label=f"k = {k}")
    right.set(xlabel="training step", ylabel="tokens accepted per step (held out)", title="greedy verify")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_lines(trained: dict) -> list[str]:
    """The held-out report `distill` prints: top-1 agreement by depth, accepted tokens per step at k = 1..8, cost."""
    depth = [trained[f"val/top1_step{d}"] for d in range(1, EVAL_DEPTH + 1) if f"val/top1_step{d}" in trained]
    accepted = [trained[f"val/accepted_k{k}"] for k in range(1, EVAL_DEPTH + 1) if f"val/accepted_k{k}" in trained]
    lines = ["held-out answers (never trained on):",
             "  depth / k              " + " ".join(f"{d:>6}" for d in range(1, len(depth) + 1)),
             "  top-1 agreement        " + " ".join(f"{v:6.3f}" for v in depth),
             "  accepted tokens / step " + " ".join(f"{v:6.3f}" for v in accepted)]
    cost = trained.get("cost")
    if cost:
        lines.append(f"  cost: {cost['draft_token_ms']:.2f} ms per drafted token against {cost['plain_step_ms']:.2f} ms "
                     f"per plain step ({100 * cost['draft_token_over_plain_step']:.1f}%, one row, context {cost['context']})")
    return lines
