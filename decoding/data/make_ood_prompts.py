"""Writes the `ood` split of prompts.jsonl: 48 prompts in styles unlike the train split, never used for
training or for tuning anything (reported separately).

Run `python decoding/data/make_ood_prompts.py` (it replaces the ood lines, keeps the others); the JSONL is
committed. Four styles, 12 prompts each, deterministic:
- long_document: summarise or answer questions about a long technical document (>= 1,500 tokens of
  numpy's reference documentation, a source no other prompt set draws from);
- multi_turn: a conversation transcript of several earlier turns, then a new request;
- long_translation: translate a long passage (numpy documentation prose) into another language;
- word_problem: arithmetic word problems with several steps.
"""
import json
import random
import re
from pathlib import Path

import numpy
import numpy.fft
import numpy.linalg

OUT = Path(__file__).with_name("prompts.jsonl")
SEED = 20261201


def numpy_paragraphs() -> list[str]:
    """Prose paragraphs of numpy's docstrings (no parameter tables, no examples)."""
    paragraphs = []
    for module in (numpy, numpy.linalg, numpy.fft):
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name, None), "__doc__", None)
            if not isinstance(doc, str):
                continue
            for part in re.split(r"\n\s*\n", doc):
                text = " ".join(part.split())
                if 200 <= len(text) <= 1200 and not re.search(r"(>>>|----|\.\. |: [a-z_]+, optional|^[A-Z][a-z]+$)", text):
                    paragraphs.append(text)
    return sorted(set(paragraphs))


def long_documents(rng: random.Random, paragraphs: list[str]) -> list[str]:
    asks = [
        "Summarise the following document in five bullet points.",
        "Read the document below and explain, in plain words, what it is about and who would need it.",
        "Which operations does the following documentation describe? List each with one sentence.",
        "Write a short abstract (about 100 words) for the following technical document.",
    ]
    out = []
    for i in range(12):
        chosen, size = [], 0
        while size < 7000:  # ~1,700 tokens of English technical prose
            p = rng.choice(paragraphs)
            if p not in chosen:
                chosen.append(p)
                size += len(p)
        out.append(f"{asks[i % len(asks)]}\n\nDocument:\n\n" + "\n\n".join(chosen))
    return out


def multi_turn(rng: random.Random) -> list[str]:
    trips = ["Lisbon", "Kyoto", "Oaxaca", "Tallinn", "Marrakesh", "Quebec City"]
    hobbies = ["sourdough baking", "bouldering", "film photography", "birdwatching", "chess openings", "beekeeping"]
    out = []
    for i in range(12):
        if i % 2 == 0:
            city = trips[i // 2 % len(trips)]
            turns = [
                ("User", f"I'm planning a four-day trip to {city} in October. Any advice?"),
                ("Assistant", f"October is a good time for {city}: fewer crowds and mild weather. Plan one "
                              "neighbourhood per day, book the most popular museum ahead, and leave an "
                              "afternoon free for wandering."),
                ("User", "I don't like museums much. I prefer food and walking."),
                ("Assistant", f"Then build each day around a market in the morning and a long walk in the "
                              f"afternoon. {city} has food halls and old quarters that are best explored on foot."),
                ("User", "Great. Can you make that into a day-by-day plan with one restaurant idea per evening?"),
            ]
        else:
            hobby = hobbies[i // 2 % len(hobbies)]
            turns = [
                ("User", f"I want to get into {hobby}. Where do I start?"),
                ("Assistant", f"Start small: learn the basic vocabulary of {hobby}, get the minimum equipment, "
                              "and practise a little every week rather than a lot once."),
                ("User", "How much should I expect to spend in the first three months?"),
                ("Assistant", "A modest budget is enough at first; spend on the one piece of equipment that "
                              "matters most and borrow or skip the rest until you know you will keep going."),
                ("User", "Thanks. Now write me a simple week-by-week plan for the first month, "
                         "and repeat the budget advice at the end."),
            ]
        out.append("Here is our conversation so far:\n\n" + "\n\n".join(f"{who}: {text}" for who, text in turns)
                   + "\n\nContinue as the assistant and answer the last message.")
    return out


def long_translations(rng: random.Random, paragraphs: list[str]) -> list[str]:
    languages = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
    out = []
    for i in range(12):
        chosen, size = [], 0
        while size < 1500:
            p = rng.choice(paragraphs)
            if p not in chosen:
                chosen.append(p)
                size += len(p)
        out.append(f"Translate the following passage into {languages[i % len(languages)]}, keeping the technical "
                   "terms that are names of functions unchanged:\n\n" + "\n\n".join(chosen))
    return out


def word_problems(rng: random.Random) -> list[str]:
    names = ["Amara", "Bastien", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lucia"]
    out = []
    for i in range(12):
        a, b, c = rng.randint(3, 19), rng.randint(2, 9), rng.randint(20, 90)
        name = names[i]
        templates = [
            f"{name} buys {a} notebooks at {b} dollars each and pays with a {c + a * b} dollar note. How much "
            "change does {name} get? Explain each step.",
            f"A train leaves at 9:15 and travels {c} km at {a * 5} km per hour, then stops for {b * 5} minutes "
            f"and travels another {a * 4} km at the same speed. When does it arrive? Show your working.",
            f"{name} reads {a} pages on Monday and {b} more pages each day than the day before. How many pages "
            f"has {name} read after one week? Show the calculation.",
            f"A rectangular garden is {a} m by {a + b} m. A path {b // 2 + 1} m wide runs around the outside. "
            "What is the area of the path? Explain step by step.",
        ]
        out.append(templates[i % len(templates)].replace("{name}", name))
    return out


def main() -> None:
    rng = random.Random(SEED)
    paragraphs = numpy_paragraphs()
    styles = {"long_document": long_documents(rng, paragraphs), "multi_turn": multi_turn(rng),
              "long_translation": long_translations(rng, paragraphs), "word_problem": word_problems(rng)}
    kept = [line for line in OUT.read_text().splitlines() if line.strip() and json.loads(line).get("split") != "ood"]
    new = [json.dumps({"question_id": f"ood_{style}-{i:02d}", "category": f"ood_{style}", "split": "ood", "turns": [text]})
           for style, texts in styles.items() for i, text in enumerate(texts)]
    OUT.write_text("\n".join(kept + new) + "\n")
    print(f"{OUT}: {len(kept)} prompts kept, {len(new)} ood prompts written")


if __name__ == "__main__":
    main()
