"""The committed prompt set: the held-out splits share no text with the train split, and every prompt has a
trace recorded under its own split (the replay and the tuning read the split from the traces file)."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows():
    return [json.loads(line) for line in (ROOT / "decoding" / "data" / "prompts.jsonl").read_text().splitlines() if line.strip()]


def _passages(text: str) -> set[str]:
    """Paragraphs long enough to be a drawn passage, without the labels the generators put before them."""
    out = set()
    for part in re.split(r"\n\s*\n", text):
        part = re.sub(r"^(\[\d+\] \([^)]*\)\n|Section \d+\. |(User|Assistant): )", "", part.strip())
        if len(part) >= 200:
            out.add(part)
    return out


def test_held_out_splits_share_no_passage_with_train():
    rows = _rows()
    splits = {r["split"] for r in rows}
    assert {"train", "test", "ood", "outside"} <= splits
    train = set().union(*(_passages(r["turns"][0]) for r in rows if r["split"] == "train"))
    assert len(train) > 100  # the long train prompts' passages were found (the check has something to compare)
    for split in ("test", "ood", "outside"):
        held = [r for r in rows if r["split"] == split]
        shared = {r["question_id"] for r in held if _passages(r["turns"][0]) & train}
        assert not shared, f"{split} prompts sharing a passage with train: {sorted(shared)}"
        assert not {r["turns"][0] for r in held} & {r["turns"][0] for r in rows if r["split"] == "train"}


def test_outside_split_covers_the_six_kinds_of_the_outside_check():
    rows = [r for r in _rows() if r["split"] == "outside"]
    kinds = {r["category"] for r in rows}
    assert kinds == {f"outside_{k}" for k in ("chat", "translation", "long_summary", "qa", "math", "rag")}
    assert len(rows) == 24
    long = [r for r in rows if r["category"] in ("outside_long_summary", "outside_rag")]
    assert all(len(r["turns"][0]) >= 7200 for r in long)  # >= ~1,700 tokens


def test_every_prompt_has_a_trace_under_its_split():
    rows = _rows()
    meta = json.loads((ROOT / "profiles" / "traces-ngram-3.json").read_text())
    splits = meta["meta"]["splits"]
    traced = {t["question_id"] for t in meta["traces"]}
    missing = [r["question_id"] for r in rows if r["question_id"] not in traced]
    assert not missing, missing
    wrong = [r["question_id"] for r in rows if splits.get(r["question_id"]) != r["split"]]
    assert not wrong, wrong
