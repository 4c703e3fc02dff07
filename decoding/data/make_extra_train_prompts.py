"""Writes the extra training prompts of prompts.jsonl (split `train`): 24 long-context prompts of >= 1,500 tokens
and 200 synthetic prompts (decoding/synth_prompts.py, 25 per category of the original set; the last 160 joined
after `python -m specpilot.agents.fit_check --extra-traces` scored them on held-out train prompts).

Run `python decoding/data/make_extra_train_prompts.py` (it replaces the lines it wrote before, keeps the others);
the JSONL is committed. Every prompt here is for training and tuning; the test and ood splits stay as they were. The train split's own prompts are a few hundred tokens, so a policy trained on them alone never saw
a long prompt (and its context-length feature never left the short range). Four kinds, 6 prompts each,
deterministic, from the docstrings of Python's standard library (the ood split draws on numpy's documentation
instead, so no passage is shared):
- long_summarization: summarise a long passage;
- long_document_qa: answer questions about a document of numbered sections;
- retrieval_qa: several retrieved passages with their sources, then a question about one of them;
- long_multi_turn: a long conversation about library documentation, then a new request.
Also 8 `passage_translation` prompts (a 1,500-4,000 character passage to translate into another language; drawn
with their own random stream, so the prompts above are unchanged): without them the train split's translations
are a sentence or two, and a policy drafted half as much as the rule on the ood split's passage translations.
"""
import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specpilot.decoding.synth_prompts import STDLIB_MODULES, synthetic_prompts  # noqa: E402

OUT = Path(__file__).with_name("prompts.jsonl")
SEED = 20261202
SYNTHETIC = 200
MIN_CHARS = 7200
"""About 1,700 tokens of English technical prose for this tokenizer (4.2 characters a token)."""


def docstring_paragraphs(modules, defined_here: bool = True, skip=None, clean=None) -> list[tuple[str, str]]:
    """(module.name, a prose paragraph of 200-1,100 characters of its docstring) for the functions and classes of
    `modules` (only those defined there with `defined_here`), in a fixed order; `skip(text)` drops a paragraph,
    `clean(text)` rewrites a kept one. Shared by the train and outside prompt writers."""
    out = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        for attr, obj in sorted(vars(module).items()):
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if defined_here and getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = obj.__doc__ if isinstance(obj.__doc__, str) else ""
            for part in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
                text = " ".join(part.split())
                if 200 <= len(text) <= 1100 and not (skip and skip(text)):
                    out.append((f"{name}.{attr}", clean(text) if clean else text))
    return out


def named_paragraphs() -> list[tuple[str, str]]:
    """(module.function, a prose paragraph of its docstring) from the standard library, in a fixed order."""
    return docstring_paragraphs(STDLIB_MODULES, skip=lambda text: text.startswith((">>>", "..", "-", "*", "+")))


def draw(rng: random.Random, pool: list[tuple[str, str]], chars: int) -> list[tuple[str, str]]:
    """Distinct passages of `pool`, drawn at random until they hold `chars` characters."""
    chosen, size = [], 0
    while size < chars:
        item = rng.choice(pool)
        if item not in chosen:
            chosen.append(item)
            size += len(item[1])
    return chosen


def summarization(rng, pool) -> list[str]:
    asks = ["Summarise the following passage in six bullet points.",
            "Write a one-paragraph summary of the text below for a programmer who has not read it.",
            "Summarise the following documentation, then name the three ideas that matter most."]
    return [f"{asks[i % len(asks)]}\n\n" + "\n\n".join(p for _, p in draw(rng, pool, MIN_CHARS)) for i in range(6)]


def document_qa(rng, pool) -> list[str]:
    out = []
    for i in range(6):
        parts = draw(rng, pool, MIN_CHARS)
        a, b = rng.sample(range(1, len(parts) + 1), 2)
        doc = "\n\n".join(f"Section {j}. {p}" for j, (_, p) in enumerate(parts, 1))
        out.append(f"Read the document below, then answer: what does Section {a} describe, and how does it relate "
                   f"to Section {b}? Quote one sentence from each.\n\nDocument:\n\n{doc}")
    return out


def retrieval_prompts(rng, pool, count: int, min_chars: int, tag: str, frame) -> list[str]:
    """`count` prompts over passages drawn from `pool` (`draw`, >= min_chars in all), numbered, each with its source
    as `tag` formats it ('source: {}'), framed by `frame(passages, source)` around a question on one source."""
    out = []
    for _ in range(count):
        parts = draw(rng, pool, min_chars)
        source, _ = rng.choice(parts)
        passages = "\n\n".join(f"[{j}] ({tag.format(name)})\n{p}" for j, (name, p) in enumerate(parts, 1))
        out.append(frame(passages, source))
    return out


def retrieval_qa(rng, pool) -> list[str]:
    return retrieval_prompts(rng, pool, 6, MIN_CHARS, "source: {}", lambda passages, source: (
        "Answer the question using only the retrieved passages, and cite the passage numbers you use.\n\n"
        f"Passages:\n\n{passages}\n\nQuestion: What does {source} do, and when would I use it?"))


def multi_turn(rng, pool) -> list[str]:
    out = []
    for i in range(6):
        turns, size = [], 0
        while size < MIN_CHARS:
            name, text = rng.choice(pool)
            turns += [("User", f"What does {name} do?"), ("Assistant", text)]
            size += len(text) + 30
        turns.append(("User", "Thanks. Now compare the first and the last of these in a short table, "
                              "and tell me which one I should learn first."))
        out.append("Here is our conversation so far:\n\n" + "\n\n".join(f"{who}: {t}" for who, t in turns)
                   + "\n\nContinue as the assistant and answer the last message.")
    return out


def passage_translation(rng, pool) -> list[str]:
    languages = ["French", "Spanish", "German", "Italian", "Swedish", "Polish", "Portuguese", "Czech"]
    out = []
    for i, language in enumerate(languages):
        parts = draw(rng, pool, 1500 + 350 * i)
        out.append(f"Translate the following text into {language}. Keep names of modules and functions as they "
                   "are.\n\n" + "\n\n".join(p for _, p in parts))
    return out


def main() -> None:
    rng = random.Random(SEED)
    pool = named_paragraphs()
    kinds = {"long_summarization": summarization(rng, pool), "long_document_qa": document_qa(rng, pool),
             "retrieval_qa": retrieval_qa(rng, pool), "long_multi_turn": multi_turn(rng, pool),
             "passage_translation": passage_translation(random.Random(SEED + 1), pool)}
    ours = set(kinds)
    kept = [line for line in OUT.read_text().splitlines()
            if line.strip() and not (json.loads(line).get("category") in ours
                                     or json.loads(line).get("category", "").startswith("synth_"))]
    new = [json.dumps({"question_id": f"{kind}-{i:02d}", "category": kind, "split": "train", "turns": [text]})
           for kind, texts in kinds.items() for i, text in enumerate(texts)]
    synth = [json.dumps({"question_id": f"synth_{p.question_id}", "category": f"synth_{p.category}", "split": "train",
                         "turns": [p.text]}) for p in synthetic_prompts(SYNTHETIC, seed=SEED)]
    OUT.write_text("\n".join(kept + new + synth) + "\n")
    print(f"{OUT}: {len(kept)} prompts kept, {len(new)} long-context / passage and {len(synth)} synthetic train prompts written")


if __name__ == "__main__":
    main()
