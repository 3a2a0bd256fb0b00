"""What the bench sends: texts to translate, the translation prompt, long made-up texts of a given token count, chapter 6's reviews."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from llmkit import models

LANG = "French"
# Texts the default model translates (greedy) into at least 128 tokens: the sequential
# server has no ignore_eos, and a short answer would make it look slower per token.
TEXTS = [
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, January, February, March, April, May, June, July, August",
    "red, blue, green, yellow, black, white, orange, purple, brown, pink, grey, gold, silver, one, two, three, four, five, six, seven",
    "The cat sleeps. The dog runs. The bird sings. The fish swims. The horse eats. The cow sleeps. The duck swims. The child plays.",
    "I like tea. I like coffee. I like milk. I like water. I like juice. I like soup. I like bread. I like rice. I like fish.",
    "Dear friend, thank you for your letter. We are well. The weather is warm. The children are at school. We miss you.",
    "First, boil the water. Then add the pasta. Wait ten minutes. Add salt. Drain the pasta. Add the sauce. Serve it hot.",
    "The sun rises. The sun sets. The moon rises. The moon sets. The stars shine. The wind blows. The rain falls. The snow melts.",
    "spring, summer, autumn, winter, rain, snow, wind, sun, cloud, storm, fog, ice, heat, cold, morning, evening, night",
]

# The greedy-drift scenario's requests: chapter 6's reviews and question, copied from
# notebooks/en/06_structured_output.ipynb, cell 1 (REVIEWS, QUESTION); test_bench checks they still match.
REVIEWS = [
    "The battery lasts all day and the screen is gorgeous.",
    "It broke after two days. Complete waste of money.",
    "Delivery was on time. The box was brown.",
    "Absolutely love it, my kids use it every day!",
    "The sound is tinny and the app keeps crashing.",
    "It does what it says, nothing more, nothing less.",
    "Best purchase I have made this year.",
    "Customer service never answered my emails.",
]
QUESTION = (
    "Analyze the sentiment of this review and return it as JSON with keys "
    "sentiment (positive/negative/neutral) and confidence (0-1).\n\nReview: "
)


def chat_prompt(text: str) -> str:
    """The sequential server's translation prompt for ``text``: what OpenAI-compatible servers get as the user's message."""
    from llmkit.sequential.translator import PROMPT

    return PROMPT.format(lang=LANG, text=text)


def made_up_text(model_path: str | None, n_tokens: int, first: str, line: Callable[[int], str], sep: str = " ") -> str:
    """``first``, then ``line(1)``, ``line(2)``, ... joined by ``sep``, until the text has about ``n_tokens`` tokens."""
    from llmkit.llama import Model

    with Model(models.resolve_model(model_path)) as model:
        lines = [first]
        while len(model.tokenize(sep.join(lines), add_special=False)) < n_tokens:
            lines.append(line(len(lines)))
        return sep.join(lines)


def long_text(model_path: str | None, n_tokens: int, tag: str) -> str:
    """About ``n_tokens`` tokens of a made-up harbour log, starting with ``tag`` (so no two prompts share a prefix)."""
    return made_up_text(
        model_path,
        n_tokens,
        f"{tag}. The harbour log of the week.",
        lambda i: f"Ship {i} came in from port {i * 7 % 23} with {i * 13 % 97} crates of {['tea', 'salt', 'wool'][i % 3]}.",
    )


def long_system_prompt(model_path: str | None, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of a made-up library catalogue, new to every run (a random tag first)."""
    return made_up_text(
        model_path,
        n_tokens,
        f"Session {uuid.uuid4().hex[:12]}. You answer questions about the catalogue of the Harbour Library.",
        lambda i: (
            f"Item {i}: a {['blue', 'red', 'green', 'old'][i % 4]} book about {['ships', 'birds', 'maps', 'bread'][i % 3]}, "
            f"shelf {i * 7 % 31}, catalogued in {1900 + i}."
        ),
        sep="\n",
    )


def edited_chat(model_path: str | None, n_tokens: int) -> tuple[list[dict], list[dict]]:
    """A chat of the given length in tokens, and the same chat with its first message shortened (cache reuse).

    It opens with a system prompt of a fifth of it: so the edited chat still shares over 10 % with the
    cached one and goes back to the same slot (llama-server's similarity rule); moved chunks never
    cross slots, in llama-server as here.
    """
    from llmkit.llama import Model

    system = made_up_text(
        model_path, n_tokens // 5, "You keep the harbour's log.", lambda i: f"Rule {i}: write ship {i}'s cargo in the ledger."
    )

    def chat(first: str, facts: list[str]) -> list[dict]:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        for fact in facts:
            turns += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": fact}]
        return turns

    first = "My name is Ana and I live in a small house by the sea, next to the old harbour."
    facts: list[str] = []
    with Model(models.resolve_model(model_path)) as model:
        while len(model.tokenize_chat(chat(first, facts))) < n_tokens:
            i = len(facts) + 1
            facts.append(
                f"Fact {i}: ship {i} came in from port {i * 7 % 23} with {i * 13 % 97} crates of {['tea', 'salt', 'wool'][i % 3]}."
            )
    return chat(first, facts), chat("My name is Ana.", facts)


# --- the speculation scenario's completions (native /completion, no chat template) ------------------------------------

# A small source file, made up and fixed here (a file of the repository would change the bench whenever it changes).
SPEC_SOURCE = '''"""A small inventory of a harbour shop: items, prices and stock, read from and written to CSV."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    name: str
    price: float
    stock: int

    def value(self) -> float:
        """What the items in stock are worth."""
        return self.price * self.stock


def load(path: Path) -> list[Item]:
    """The items of a CSV file with the columns name, price, stock."""
    with path.open() as f:
        return [Item(row["name"], float(row["price"]), int(row["stock"])) for row in csv.DictReader(f)]


def save(items: list[Item], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "price", "stock"])
        for item in items:
            writer.writerow([item.name, item.price, item.stock])


def total(items: list[Item]) -> float:
    return sum(item.value() for item in items)
'''
SPEC_BOOKS = [("Maps of the North Sea", 12, 4), ("Bread and Salt", 8, 10), ("The Old Lighthouse", 15, 2),
              ("Birds of the Coast", 9, 7), ("Ships in a Storm", 11, 0), ("A Year of Tides", 14, 3),
              ("The Harbour Cookbook", 20, 5), ("Knots and Sails", 7, 12)]  # fmt: skip
SPEC_HARBOUR = [
    "The harbour opens at six. Fishermen bring in the night's catch and sell it on the quay before the town wakes.",
    "At noon the ferry leaves for the island. It carries the post, a few tourists, and crates of bread for the bakery there.",
    "In the evening the lighthouse keeper climbs the hundred steps, lights the lamp, and writes the weather in his book.",
    "On Sundays the market fills the square: cheese, honey, wool, and old maps of the coast that nobody buys.",
]


def spec_prompts() -> dict[str, list[str]]:
    """The speculation scenario's prompts, by kind. "copy": answers that repeat text the prompt holds (the model,
    greedy, copies each for a while, then drifts): a source file's copy begun after it, a JSON document to be
    rewritten, a paragraph quoted from a text. "free": answers that repeat nothing, a story and an essay."""
    import json

    lines = SPEC_SOURCE.splitlines(keepends=True)
    source = "".join(lines[:30]) + "\n\n" + "".join(lines[:8])  # the file's first 30 lines, then its copy begun
    books = {"store": "Harbour Books", "open": True,
             "items": [{"id": i, "title": t, "price": p, "stock": s} for i, (t, p, s) in enumerate(SPEC_BOOKS, 1)]}  # fmt: skip
    document = json.dumps(books, indent=2)
    edit = (
        document + '\n\nThe same JSON document, with the price of "Bread and Salt" set to 9:\n\n' + "".join(document.splitlines(True)[:4])
    )
    quote = ("\n\n".join(SPEC_HARBOUR) + "\n\nQuestion: What does the lighthouse keeper do in the evening? Quote the text.\n"
             'Answer: "In the evening')  # fmt: skip
    return {
        "copy": [source, edit, quote],
        "free": [
            "Once upon a time, in a small village by the sea, there lived an old fisherman and his granddaughter.",
            "Write a short essay about why people enjoy walking in the mountains.\n\n",
        ],
    }
