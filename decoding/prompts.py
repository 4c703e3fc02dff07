"""Prompt sets: JSONL, one object per line with `category` and `turns` (a list of strings; the first
turn is the user message), optionally `question_id` and `split` ('train' / 'test')."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecPilotError
from .paths import read_text_file

DEFAULT_PROMPTS = Path(__file__).with_name("data") / "prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    text: str
    split: str = "train"


def load_prompts(path: str | Path | None = None, split: str | None = None) -> list[Prompt]:
    """The prompts of a JSONL file (default: the project's set), optionally one split only."""
    path = Path(path) if path else DEFAULT_PROMPTS
    prompts = []
    for number, line in enumerate(read_text_file(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise ValueError("'turns' must be a non-empty list of strings")
            prompts.append(Prompt(str(row.get("question_id", f"{path.stem}-{number}")), str(row["category"]),
                                  turns[0], str(row.get("split", "train"))))
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecPilotError(f"{path}:{number}: not a prompt line ({exc})") from None
    if split not in (None, "all"):
        prompts = [p for p in prompts if p.split == split]
    if not prompts:
        raise SpecPilotError(f"no prompts in {path}" + (f" for split '{split}'" if split else ""))
    return prompts


def per_category(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The first n prompts of each category (all of them when n <= 0), in file order."""
    if n <= 0:
        return list(prompts)
    taken: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        if taken[prompt.category] <= n:
            kept.append(prompt)
    return kept


def batches_of(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices in consecutive groups of batch_size (the first batch_size, cycled, if too few)."""
    if n_prompts >= batch_size:
        return [list(range(i, i + batch_size)) for i in range(0, n_prompts - batch_size + 1, batch_size)]
    return [[i % n_prompts for i in range(batch_size)]]
