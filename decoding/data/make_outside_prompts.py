"""Writes the `outside` split of prompts.jsonl: 24 prompts in the six kinds of the external check of the
project (multi-turn chat, translation, summarisation of long passages, QA, math, retrieval-augmented answers
over long contexts), written after the `ood` split had been looked at by category, from a source no other
split draws on (PyTorch's documentation prose, hand-written everyday text). Never used for training, for
tuning anything or for choosing between policies: it is the check no one has looked at before the numbers.

Run `python decoding/data/make_outside_prompts.py` (it replaces the outside lines, keeps the others); the JSONL
is committed. Six kinds, 4 prompts each, deterministic.
"""
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specpilot.decoding.data.make_extra_train_prompts import docstring_paragraphs, draw, retrieval_prompts  # noqa: E402

OUT = Path(__file__).with_name("prompts.jsonl")
SEED = 20261203
LONG_CHARS = 7200
"""About 1,700 tokens of English technical prose (4.2 characters a token)."""


def torch_paragraphs() -> list[tuple[str, str]]:
    """(module.name, a prose paragraph of its docstring) from PyTorch's nn / optim / data / distributions /
    autograd, reST roles reduced to their text, no code, maths or argument lists."""
    found = docstring_paragraphs(
        ("torch.nn", "torch.optim", "torch.utils.data", "torch.distributions", "torch.autograd"), defined_here=False,
        skip=lambda text: re.search(r"(>>>|\.\. |:math:|Args:|Shape:|Example|\\|\$|Attributes:)", text),
        clean=lambda text: re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", text).replace("``", ""))
    return sorted(set(found))


def chats() -> list[str]:
    conversations = [
        [("User", "My sourdough starter smells like nail polish remover. Did I kill it?"),
         ("Assistant", "Probably not. That smell usually means it is hungry: the yeast has run out of food and is "
                       "making acetone-like by-products. Feed it more often, or feed it a larger amount of flour."),
         ("User", "I feed it once a day with equal weights of flour and water."),
         ("Assistant", "Try twice a day for a week, or keep it in the fridge between bakes and feed it weekly."),
         ("User", "OK. How will I know when it is ready to bake with again?")],
        [("User", "I have a job interview for a junior data analyst role on Thursday."),
         ("Assistant", "Congratulations! Do you know what format the interview will take?"),
         ("User", "Thirty minutes with the team lead, then a short SQL exercise."),
         ("Assistant", "Then prepare two short stories about projects you did, and practise joins, grouping and "
                       "window functions on a sample database."),
         ("User", "What questions should I ask them at the end?")],
        [("User", "We are moving to a new flat next month with two cats."),
         ("Assistant", "Moving with cats goes better when they keep some routine. Will you move them on the same "
                       "day as the furniture?"),
         ("User", "Yes, everything happens on one Saturday."),
         ("Assistant", "Then keep the cats in one closed room with their litter, water and a carrier while the "
                       "movers work, and move that room last."),
         ("User", "And once we arrive? How do I help them settle in?")],
        [("User", "I want to learn Spanish before a trip to Mexico in six months."),
         ("Assistant", "Six months is enough for useful conversation if you practise most days. How much time "
                       "can you give it each day?"),
         ("User", "About twenty minutes on weekdays and an hour at the weekend."),
         ("Assistant", "Good: use the weekday slots for vocabulary and listening, and the weekend hour for "
                       "speaking with a tutor or a language partner."),
         ("User", "Can you suggest a plan for the first four weeks?")],
    ]
    return ["\n\n".join(f"{who}: {text}" for who, text in turns) + "\n\nAssistant:" for turns in conversations]


def translations() -> list[str]:
    texts = [
        ("French", "Dear neighbours, the water will be turned off on Tuesday between nine and noon while the "
                   "pipes in the basement are replaced. Please fill a few bottles the evening before. We are "
                   "sorry for the trouble and thank you for your patience."),
        ("German", "Thank you for your order. Your parcel left our warehouse this morning and should arrive "
                   "within three working days. If nobody is at home, the driver will leave a card with the "
                   "address of the nearest pick-up point."),
        ("Spanish", "The museum is open every day except Monday, from ten in the morning until six in the "
                    "evening. Entry is free on the first Sunday of each month. Large bags must be left in the "
                    "cloakroom near the main entrance."),
        ("Italian", "To reset your password, click the link in this email within the next hour. If you did "
                    "not ask for a new password, you can ignore this message; your account is still safe."),
    ]
    return [f"Translate into {language}:\n\n{text}" for language, text in texts]


def long_summaries(rng: random.Random, pool) -> list[str]:
    asks = ["Summarise the following passage in five bullet points.",
            "Write a short summary of the text below for someone new to deep learning.",
            "What are the main points of the following documentation? Answer in one paragraph.",
            "Summarise this text, then say which part a beginner would find hardest."]
    return [f"{ask}\n\n" + "\n\n".join(p for _, p in draw(rng, pool, LONG_CHARS)) for ask in asks]


def questions() -> list[str]:
    return ["Why do onions make people cry when they are cut?",
            "How do noise-cancelling headphones work?",
            "Who wrote 'One Hundred Years of Solitude', and what is it about?",
            "How does a refrigerator keep food cold?"]


def maths() -> list[str]:
    return ["Solve for x: 4x - 7 = 2x + 9. Show each step.",
            "A jacket costs 80 euros. It is discounted by 25%, and then the discounted price is raised by 10%. "
            "What is the final price?",
            "Two fair six-sided dice are rolled. What is the probability that the sum is 8? Explain.",
            "The sum of three consecutive even numbers is 138. What are the numbers?"]


def retrieval(rng: random.Random, pool) -> list[str]:
    return retrieval_prompts(rng, pool, 4, LONG_CHARS, "{}", lambda passages, source: (
        "Use the retrieved passages below to answer the question, citing passage numbers.\n\n"
        f"{passages}\n\nQuestion: According to the passages, what is {source} for, and what should "
        "I watch out for when using it?"))


def main() -> None:
    rng = random.Random(SEED)
    pool = torch_paragraphs()
    kinds = {"chat": chats(), "translation": translations(), "long_summary": long_summaries(rng, pool),
             "qa": questions(), "math": maths(), "rag": retrieval(rng, pool)}
    kept = [line for line in OUT.read_text().splitlines() if line.strip() and json.loads(line).get("split") != "outside"]
    new = [json.dumps({"question_id": f"outside_{kind}-{i:02d}", "category": f"outside_{kind}", "split": "outside",
                       "turns": [text]}) for kind, texts in kinds.items() for i, text in enumerate(texts)]
    OUT.write_text("\n".join(kept + new) + "\n")
    print(f"{OUT}: {len(kept)} prompts kept, {len(new)} outside prompts written")


if __name__ == "__main__":
    main()
