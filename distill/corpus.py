"""What a draft head is distilled from: prompts, the target's own answers (batched, appended, resumable), its
teacher-forced features (sharded) and the standard library's and installed packages' text; the sub-vocabulary."""
from __future__ import annotations

from typing import TYPE_CHECKING

import gzip
import json
import random
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from specpilot.decoding.errors import SpecPilotError
from specpilot.decoding.paths import atomic_write_text
from specpilot.decoding.prompts import Prompt, load_prompts
from specpilot.decoding.synth_prompts import synthetic_prompts


if TYPE_CHECKING:
    from .distill_cli import DistillConfig


IGNORE = -100


def say(message: str) -> None:
    print(f"distill: {message}", file=sys.stderr, flush=True)


def collect_prompts(cfg: DistillConfig) -> list[Prompt]:
    prompts = load_prompts(cfg.prompts, split="train")
    if cfg.synthetic_prompts > 0:
        prompts += synthetic_prompts(cfg.synthetic_prompts, cfg.seed)
    return prompts


def read_jsonl(path: Path) -> list[dict]:
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
    rows = read_jsonl(path)
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


SHIPPED_ANSWERS = Path(__file__).parent / "data" / "smollm2-135m-instruct-answers.jsonl.gz"
"""The embedded target's greedy answers (192 tokens at most) to 1,100 train and synthetic prompts, as the distillation
generated them: a new work folder starts from them instead of regenerating (about 35 minutes on 2 cores)."""


def seed_answers(cfg: DistillConfig, path: Path) -> bool:
    """Start an empty work folder's answers from the shipped ones (embedded target only); True when it did."""
    if path.exists() or cfg.target != "embedded" or not SHIPPED_ANSWERS.is_file():
        return False
    with gzip.open(SHIPPED_ANSWERS, "rt") as source:
        atomic_write_text(path, source.read())
    say(f"answers seeded from {SHIPPED_ANSWERS.name} (the embedded target's, as generated before)")
    return True
