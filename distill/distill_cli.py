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

import gzip
import json
import math
import random
import statistics
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specpilot.decoding.config import parse_config
from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.head_draft import (
    DEFAULT_DRAFT,
    DraftHead,
    HeadConfig,
    HeadDrafter,
    save_head,
    sub_head_weight,
    target_signature,
)
from specpilot.decoding.loop import speculative_step, start
from specpilot.decoding.models import cache_dir, load_target
from specpilot.decoding.paths import atomic_write_text
from specpilot.decoding.prompts import Prompt, load_prompts
from specpilot.decoding.sampling import Sampling
from specpilot.decoding.synth_prompts import synthetic_prompts
from specpilot.decoding.tracking import start_tracking

IGNORE = -100


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


def _say(message: str) -> None:
    print(f"distill: {message}", file=sys.stderr, flush=True)


def collect_prompts(cfg: DistillConfig) -> list[Prompt]:
    prompts = load_prompts(cfg.prompts, split="train")
    if cfg.synthetic_prompts > 0:
        prompts += synthetic_prompts(cfg.synthetic_prompts, cfg.seed)
    return prompts


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: regenerate that prompt
            break
    return rows


@torch.inference_mode()
def generate_answers(target, prompts: list[Prompt], path: Path, max_new_tokens: int, batch: int,
                     max_prompt_tokens: int, progress: bool = True, max_answers: int = 0, seed: int = 0) -> list[dict]:
    """The target's greedy answers, appended to `path` batch by batch (prompts already there are skipped; with
    `max_answers`, a seeded choice of the others up to that many answers in all)."""
    rows = _read_jsonl(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # drop a torn last line
    done = {r["id"] for r in rows}
    todo = []
    for p in prompts:
        if p.question_id in done:
            continue
        ids = target.encode(p.text, chat=True)
        if len(ids) <= max_prompt_tokens:
            todo.append((p.question_id, ids))
    if max_answers:
        random.Random(seed).shuffle(todo)
        todo = todo[: max(0, max_answers - len(rows))]
    todo.sort(key=lambda item: len(item[1]))  # similar lengths together: less padding
    model = target.model
    pad = getattr(target.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else min(target.eos_ids, default=0)
    bar = tqdm(total=len(todo), desc="target answers", disable=not progress, file=sys.stderr)
    with path.open("a") as sink:
        for first in range(0, len(todo), batch):
            chunk = todo[first : first + batch]
            width = max(len(ids) for _, ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (_, ids) in enumerate(chunk):
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                mask[row, width - len(ids):] = 1
            out = model.generate(input_ids=input_ids.to(target.device), attention_mask=mask.to(target.device),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 eos_token_id=sorted(target.eos_ids) or None)
            for row, (qid, ids) in enumerate(chunk):
                answer = []
                for token in out[row, width:].tolist():
                    answer.append(token)
                    if token in target.eos_ids:
                        break
                record = {"id": qid, "prompt_ids": ids, "answer_ids": answer}
                sink.write(json.dumps(record) + "\n")
                rows.append(record)
            sink.flush()
            bar.update(len(chunk))
    bar.close()
    return rows


def parse_layers(text: str, n_layers: int) -> list[int]:
    """`feature_layers` as hidden-state indices: 'auto' = [n/3, 2n/3, -1] for a target of n layers."""
    if text.strip() == "auto":
        return [n_layers // 3, 2 * n_layers // 3, -1]
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise SpecPilotError(f"--feature-layers must be 'auto' or comma-separated integers, got '{text}'") from None
    bad = [i for i in layers if not -(n_layers + 1) <= i <= n_layers]
    if bad or not layers:
        raise SpecPilotError(f"--feature-layers {text}: the target has hidden states 0..{n_layers} (or -1 for the last)")
    return layers


@torch.inference_mode()
def extract_features(target, rows: list[dict], folder: Path, layers: list[int], top: int = 8, shard_size: int = 64,
                     progress: bool = True) -> dict:
    """Per position from the last-but-one prompt token on: the target's hidden states of `layers`
    concatenated (`features`, float16), its last hidden state when -1 is not among them (`final`), the token
    (`tokens`), the target's `top` likeliest next tokens (`top_ids`, greedy first) and their probabilities
    (`top_probs`); sequences are concatenated, `lengths` gives each one's. Shards are written as they finish
    (resumable; a shard of other rows or layers is redone)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = target.model
    stored = layers + ([] if -1 in layers or len(layers) == 0 else [-1])
    shards = []
    bar = tqdm(total=len(rows), desc="target features", disable=not progress, file=sys.stderr)
    for index, first in enumerate(range(0, len(rows), shard_size)):
        chunk = rows[first : first + shard_size]
        path = folder / f"features-{index:04d}.pt"
        if path.exists():
            shard = torch.load(path)
            if shard["ids"] == [r["id"] for r in chunk] and shard.get("layers") == stored and shard.get("top") == top:
                shards.append(shard)
                bar.update(len(chunk))
                continue
        features, tokens, top_ids, top_probs, lengths = [], [], [], [], []
        for r in chunk:
            ids = torch.tensor(r["prompt_ids"] + r["answer_ids"], device=target.device)
            out = model(input_ids=ids[None], output_hidden_states=True)
            keep = max(len(r["prompt_ids"]) - 2, 0)
            features.append(torch.cat([out.hidden_states[i][0, keep:] for i in stored], dim=-1).half().cpu())
            probs, best = torch.softmax(out.logits[0, keep:].float(), dim=-1).topk(top, dim=-1)
            top_ids.append(best.int().cpu())
            top_probs.append(probs.half().cpu())
            tokens.append(ids[keep:].cpu())
            lengths.append(ids.shape[0] - keep)
            bar.update(1)
        shard = {"ids": [r["id"] for r in chunk], "layers": stored, "top": top, "features": torch.cat(features),
                 "tokens": torch.cat(tokens), "top_ids": torch.cat(top_ids), "top_probs": torch.cat(top_probs),
                 "lengths": lengths}
        partial = path.with_suffix(".partial")
        torch.save(shard, partial)
        partial.replace(path)
        shards.append(shard)
    bar.close()
    hidden = model.get_output_embeddings().weight.shape[1]
    features = torch.cat([s["features"] for s in shards])
    last = stored.index(-1)
    data = {
        "features": features[:, : len(layers) * hidden] if len(stored) > len(layers) else features,
        "final": features[:, last * hidden : (last + 1) * hidden],
        "tokens": torch.cat([s["tokens"] for s in shards]),
        "top_ids": torch.cat([s["top_ids"] for s in shards]).long(),
        "top_probs": torch.cat([s["top_probs"] for s in shards]),
        "lengths": [n for s in shards for n in s["lengths"]],
    }
    data["labels"] = data["top_ids"][:, 0]
    return data


SKIPPED_DOC_NAMES = {"LICENSE", "LICENCE", "COPYING", "RECORD", "TOP_LEVEL", "ENTRY_POINTS", "AUTHORS", "NOTICE",
                     "REQUIRES", "DEPENDENCY_LINKS", "SOURCES", "INSTALLER", "WHEEL", "CHANGELOG", "CHANGES", "HISTORY"}


def stdlib_files(seed: int) -> list[Path]:
    """Python's standard-library source files in a seeded order (test suites, IDLE and lib2to3 skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    return files


def doc_files(seed: int, per_package: int = 200) -> list[Path]:
    """English prose shipped on the machine, in a seeded order: installed distributions' descriptions
    (`*.dist-info/METADATA`), the .md / .rst / .txt files of installed packages (at most `per_package` from one
    top-level folder, so no one package dominates) and Debian's /usr/share/doc; licences and changelogs skipped."""
    roots = [Path(sysconfig.get_paths()["purelib"])]
    files, by_package = [], Counter()
    for root in roots:
        files += sorted(root.glob("*.dist-info/METADATA"))
        for path in sorted(p for ext in ("md", "rst", "txt") for p in root.rglob(f"*.{ext}")):
            package = path.relative_to(root).parts[0]
            if path.name.upper().split(".")[0] in SKIPPED_DOC_NAMES or by_package[package] >= per_package:
                continue
            by_package[package] += 1
            files.append(path)
    share = Path("/usr/share/doc")
    if share.is_dir():
        files += sorted(p for ext in ("md", "txt") for p in share.rglob(f"*.{ext}")
                        if p.name.upper().split(".")[0] not in SKIPPED_DOC_NAMES)
    random.Random(seed).shuffle(files)
    return files


def corpus_rows(target, n_tokens: int, seed: int, chunk: int = 256, sources: str = "stdlib,docs") -> list[dict]:
    """About `n_tokens` of offline text in `chunk`-token pieces, as rows with an empty prompt, shared equally by
    the `sources`: 'stdlib' (Python's standard-library source: code, comments, docstrings) and 'docs' (`doc_files`:
    package descriptions and documentation). Nothing from the project's prompt splits."""
    if n_tokens <= 0:
        return []
    listing = {"stdlib": stdlib_files, "docs": doc_files}
    names = [name.strip() for name in sources.split(",") if name.strip()]
    unknown = [name for name in names if name not in listing]
    if unknown or not names:
        raise SpecPilotError(f"--corpus-sources lists {', '.join(listing)}; got '{sources}'")
    rows = []
    for name in names:
        total, share = 0, n_tokens // len(names)
        for path in listing[name](seed):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = target.tokenizer(text)["input_ids"]
            for first in range(0, len(ids) - chunk + 1, chunk):
                rows.append({"id": f"corpus-{name}-{path}-{first}", "prompt_ids": [], "answer_ids": ids[first : first + chunk]})
                total += chunk
                if total >= share:
                    break
            if total >= share:
                break
    return rows


def choose_vocab(features: dict, rows: list[dict], size: int, eos_ids) -> list[int]:
    """The sub-vocabulary: tokens the target predicts most often in its answers (weight 4) and on the
    corpus (1), and prompt tokens (answers copy from prompts; 0.25); EOS always included."""
    n_answer = sum(features["lengths"][: features.get("answers", len(features["lengths"]))])
    counts = Counter(features["labels"][n_answer:].tolist())
    for token, n in Counter(features["labels"][:n_answer].tolist()).items():
        counts[token] += 4 * n
    for r in rows:
        for token in r["prompt_ids"]:
            counts[token] += 0.25
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys(sorted(eos_ids) + ranked))[:size]
    return chosen


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
        _say(f"resuming from {ckpt} at step {step}")

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


SHIPPED_ANSWERS = Path(__file__).parent / "data" / "smollm2-135m-instruct-answers.jsonl.gz"
"""The embedded target's greedy answers (192 tokens at most) to 1,100 train and synthetic prompts, as the distillation
generated them: a new work folder starts from them instead of regenerating (about 35 minutes on 2 cores)."""


def seed_answers(cfg: DistillConfig, path: Path) -> bool:
    """Start an empty work folder's answers from the shipped ones (embedded target only); True when it did."""
    if path.exists() or cfg.target != "embedded" or not SHIPPED_ANSWERS.is_file():
        return False
    with gzip.open(SHIPPED_ANSWERS, "rt") as source:
        atomic_write_text(path, source.read())
    _say(f"answers seeded from {SHIPPED_ANSWERS.name} (the embedded target's, as generated before)")
    return True


def distill(cfg: DistillConfig) -> Path:
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir else cache_dir() / "distill" / out.name
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target, dtype="float32" if cfg.device in ("auto", "cpu") else "auto", device=cfg.device)
    prompts = collect_prompts(cfg)
    _say(f"{len(prompts)} prompts; work folder {work}")
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
    _say(f"{data['labels'].numel()} positions from {len(rows)} answers and {len(corpus)} corpus pieces; "
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
            _say(f"training curve: {plotted}")
    finally:
        if run is not None:
            run.finish()
    _say(f"draft head written to {out} ({sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters)")
    for line in report_lines(head.cfg.trained):
        _say(line)
    return out


def main(argv: list[str] | None = None) -> int:
    """scripts/distill_draft.py: parse the flags and run `distill`."""
    distill(parse_config(DistillConfig, argv))
    return 0
