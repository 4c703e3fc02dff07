"""Offline training prompts for draft distillation, built from text that ships with Python itself.

The project's 80 train prompts are too few to distil a draft from, and the machine has no internet.
Python's standard library holds plenty of real code and English prose (module and function
docstrings), so this module fills the project's eight prompt categories from it with fixed templates,
deterministically for a seed. The test split of `decoding/data/prompts.jsonl` is never used.
"""
from __future__ import annotations

import importlib
import inspect
import random
import re
import textwrap

from .prompts import Prompt

STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "imaplib", "ipaddress", "json", "logging",
    "mailbox", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
    "quopri", "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "statistics",
    "string", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "turtle",
    "typing", "urllib.parse", "uuid", "wave", "weakref", "zipfile",
)

TOPICS = (
    "the ocean at night", "a lost umbrella", "learning to ride a bike", "a city in the rain", "an old lighthouse",
    "friendship", "a robot that learns to paint", "the first day of school", "a mountain village", "winter mornings",
    "a busy train station", "a cat who likes jazz", "the smell of fresh bread", "a garden in spring", "time travel",
    "a quiet library", "moving to a new country", "a thunderstorm", "the last bus home", "a forgotten letter",
    "a chess match", "the moon landing", "a small bakery", "homework", "a rainy Sunday", "a grandmother's recipe",
)
FORMS = ("short poem", "haiku", "short story of five sentences", "limerick", "short speech", "diary entry",
         "product description", "friendly email", "two-paragraph essay", "song chorus")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
GENERAL_QUESTIONS = (
    "What is the capital of {}?", "Where is {} located?", "What language is spoken in {}?",
    "Name three famous landmarks in {}.", "What is {} known for?",
)
COUNTRIES = ("Japan", "Canada", "Brazil", "Egypt", "Norway", "Kenya", "Peru", "Italy", "India", "Australia",
             "Mexico", "Spain", "Germany", "Chile", "Vietnam", "Greece", "Morocco", "Sweden", "Ireland", "Turkey")
CODE_EDITS = (
    "Add type hints to this function and return the whole code:",
    "Add a docstring to this function and return the whole code:",
    "Rewrite this function with clearer variable names:",
    "Explain what this code does, line by line:",
    "Add comments to this code:",
    "Find a possible bug in this code and fix it:",
)


def _paragraphs(doc: str | None) -> list[str]:
    if not doc:
        return []
    parts = [" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc))]
    return [p for p in parts if 120 <= len(p) <= 900 and not p.startswith((">>>", "..", "-", "*", "+"))]


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s) <= 200 and s[0].isupper()]


def stdlib_material() -> tuple[list[str], list[str]]:
    """(prose paragraphs, short function sources) from the standard library, in a fixed order."""
    prose, functions = [], []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # a module missing from a minimal Python: skip it
            continue
        prose += _paragraphs(module.__doc__)
        for _, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or getattr(obj, "__module__", None) != module.__name__:
                continue
            prose += _paragraphs(obj.__doc__)
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 4 <= source.count("\n") <= 25 and len(source) <= 1200:
                functions.append(source)
    return prose, functions


def _signature_and_doc(source: str) -> str | None:
    """The def line(s) and docstring of a function, body removed: a completion prompt."""
    match = re.match(r'(\s*(?:@.*\n)*def [^\n]*:\n\s*(?:"""|\'\'\')[\s\S]*?(?:"""|\'\'\')\n)', source)
    return match.group(1) if match else None


def synthetic_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """n prompts spread over the eight categories, deterministic for (n, seed)."""
    rng = random.Random(seed)
    prose, functions = stdlib_material()
    sentences = [s for p in prose for s in _sentences(p)]
    completable = [c for c in (_signature_and_doc(f) for f in functions) if c]
    makers = {
        "code_completion": lambda: "Complete this Python function:\n\n" + rng.choice(completable),
        "code_edit": lambda: f"{rng.choice(CODE_EDITS)}\n\n{rng.choice(functions)}",
        "summarization": lambda: f"Summarize in {rng.choice(('one sentence', 'two sentences', 'three bullet points'))}:\n\n{rng.choice(prose)}",
        "qa": lambda: (rng.choice(GENERAL_QUESTIONS).format(rng.choice(COUNTRIES)) if rng.random() < 0.4
                       else f"Read this text and answer the question: what is it about, and who would use it?\n\n{rng.choice(prose)}"),
        "math": lambda: _math_problem(rng),
        "chat_writing": lambda: f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}.",
        "translation": lambda: f"Translate into {rng.choice(LANGUAGES)}: {rng.choice(sentences)}",
        "extraction": lambda: rng.choice((
            "Extract all the function and parameter names from this code as a list:\n\n" + rng.choice(functions),
            "List every technical term mentioned in this text:\n\n" + rng.choice(prose),
            "Extract the key facts from this text as a bulleted list:\n\n" + rng.choice(prose),
        )),
    }
    categories = list(makers)
    prompts, seen = [], set()
    attempts = 0
    while len(prompts) < n and attempts < 20 * n:
        attempts += 1
        category = categories[len(prompts) % len(categories)]
        text = makers[category]()
        if text in seen:
            continue
        seen.add(text)
        prompts.append(Prompt(f"synthetic-{category}-{len(prompts):04d}", category, text, "train"))
    return prompts


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 99), rng.randint(3, 99), rng.randint(2, 12)
    return rng.choice((
        f"What is {a} times {b}? Show your steps.",
        f"What is {a * c} divided by {c}? Explain.",
        f"A shop sells pencils for {c} dollars each. How much do {a} pencils cost?",
        f"If a train travels {a} kilometres per hour for {c} hours, how far does it go?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"What is {a}% of {b * 10}?",
        f"Tom has {a} apples and gives away {min(a - 1, b)}. How many are left?",
        f"What is the sum of the numbers from 1 to {a}?",
    ))


def is_synthetic(question_id: str, category: str) -> bool:
    """Whether a prompt came from `synthetic_prompts` (its own ids, or the `synth_` lines of prompts.jsonl's train split
    that decoding/data/make_extra_train_prompts.py drew from it with another seed)."""
    return question_id.startswith("synthetic-") or category.startswith("synth_")
