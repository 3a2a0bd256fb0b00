"""Every exercise's check, on the real model and real servers: the hidden solution passes it; a plausible wrong answer
fails it, with a message that does not give the answer away; an empty answer cell is "not answered yet".

The checks share their servers (``LAB``: one slot server, one llama-server, ... started once for the module) and their
measurements (each measured once, as in a learner's kernel); the model-free checks are tests/test_exercises.py's.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import ClassVar

import httpx
import openai
import pytest

from llmkit.course import exercises, tr
from llmkit.course.exercises import ch04, ch05, ch06, ch09, done
from llmkit.course.exercises.core import FAIL, PASS, UNANSWERED
from llmkit.course.exercises.lab import LAB
from llmkit.engine import Engine, EngineConfig
from llmkit.engine.prompt_cache import MIB
from llmkit.engine.request import RequestParams
from llmkit.engine.scheduler import LlamaServerPolicy, build_batch, choose_slot
from llmkit.engine.slot import Slot, common_prefix
from llmkit.sequential.translator import Translator
from llmkit.text import StopMatcher

from solutions import answers_of

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module", autouse=True)
def lab(tmp_path_factory):
    """One lab for the module: its servers and measurements shared by every check, stopped at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(done.ENV, str(tmp_path_factory.mktemp("progress") / "progress.json"))
        yield LAB
    LAB.close()


def context(chapter: int) -> dict:
    """What a chapter's solution cells use from its earlier cells."""
    if chapter == 5:
        original = ch05.chat_history("My name is Ana and I live in a small house by the sea.")
        return {"Slot": Slot, "RequestParams": RequestParams, "choose_slot": choose_slot, "common_prefix": common_prefix, "MIB": MIB,
                "MODEL": LAB.model(), "chat_history": ch05.chat_history, "ORIGINAL": original,
                "EDITS": {"shortened": ch05.chat_history("My name is Ana.")}}  # fmt: skip
    from fastapi import Request

    return {
        "Translator": Translator, "httpx": httpx, "openai": openai, "streamed_for": 5.0, "build_batch": build_batch, "Engine": Engine,
        "EngineConfig": EngineConfig, "QUESTIONS": ch04.QUESTIONS, "math": math, "tr": tr, "SCHEMA": ch06.SCHEMA,
        "WEATHER": ch06.WEATHER, "Request": Request,
    }  # fmt: skip


# --- plausible wrong answers ------------------------------------------------------------------------------------------


class FailsLate(Translator):
    """Fails after its first token: a token reaches the client before the error."""

    def stream(self, text, target_lang="ja"):
        pieces = super().stream(text, target_lang)
        try:
            yield next(pieces)
            raise RuntimeError("late")
        finally:
            pieces.close()


def only_the_status(api, answer, budget):
    """was_cut that trusts the Responses status, as llama-server's answer never says incomplete."""
    if api == "chat":
        return answer["choices"][0]["finish_reason"] == "length"
    if api == "messages":
        return answer["stop_reason"] == "max_tokens"
    return answer["status"] == "incomplete"


def split_each_read(reads):
    """An SSE reader that parses each network read on its own: what a cut read breaks."""
    events = []
    for read in reads:
        for block in read.decode("utf-8", errors="replace").split("\n\n"):
            data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
            name = next((line[7:] for line in block.split("\n") if line.startswith("event: ")), None)
            if data:
                events.append((name, "\n".join(data)))
    return events


def drops_the_last_event(reads):
    """Whole lines and blank lines done right, but an event is kept only when the next one starts: the last is lost."""
    events, name, data = [], None, []
    for line in b"".join(reads).decode().replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            data += [value.removeprefix(" ")] if field == "data" else []
            name = value.removeprefix(" ") if field == "event" else name
    return events[:-1]


@dataclass(frozen=True)
class ArrivalOrder(ch04.ReferenceFewTokensFirst):
    """The queue in arrival order (llama-server's), the prompts by tokens asked."""

    name: ClassVar[str] = "arrival"

    def order(self, waiting, slots):
        return list(waiting)


def prompt_cache_without_the_quarter(entries, held, prompt):
    lcp = common_prefix(held, prompt)
    keep_best, sim_best, best = (lcp / len(held) if held else -1.0), lcp / len(prompt), None
    for i, tokens in enumerate(entries):
        lcp = common_prefix(tokens, prompt)
        if lcp / len(tokens) > keep_best and lcp / len(prompt) > sim_best:
            best, keep_best, sim_best = i, lcp / len(tokens), lcp / len(prompt)
    return best


def blocking_batch_route(app, translator):
    """The translations in the event loop's own thread: the server cannot answer anything else meanwhile."""
    from fastapi import Request

    @app.post("/translate/batch")
    async def translate_batch(request: Request) -> dict:
        body = await request.json()
        return {"translations": [translator.translate(text, body.get("target_lang", "French")) for text in body["texts"]]}


def threaded_batch_route_with_a_typo(app, translator):
    from fastapi import Request

    @app.post("/translate/batch")
    async def translate_batch(request: Request) -> dict:
        body = await request.json()
        return {"translation": [await asyncio.to_thread(translator.translate, t, body.get("target_lang", "French")) for t in body["texts"]]}


class ReleasesAtOnce(StopMatcher):
    """Looks for a stop string within each piece alone, and releases everything else at once."""

    def push(self, text):
        if self.stopped:
            return ""
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.word = min(hits)
            self.stopped = True
            return text[:at]
        return text


class LookupInEverything(ch09.ReferenceLookup):
    """Looks the pattern up anywhere but returns the earliest match: not prompt lookup's latest."""

    def draft(self, seq, tokens, last, n_max):
        prompt, pattern = self.prompts.get(seq, []), [*tokens, last][-self.n :]
        for start in range(len(prompt) - len(pattern)):
            if prompt[start : start + len(pattern)] == pattern:
                return prompt[start + len(pattern) : start + len(pattern) + n_max]
        return []


# (chapter, exercise) -> (wrong answers: a function of the solution's answers, strings a wrong answer's message must not hold)
WRONG = {
    (1, 1): (lambda sol: [(FailsLate, 200), (sol[0], 500)], ["200"]),
    (1, 2): (lambda sol: [1.0], []),
    (1, 3): (lambda sol: [(True, False)], []),
    (2, 1): (lambda sol: [lambda response: response.json()["error"]], []),
    (2, 2): (lambda sol: [(True, "stop"), (False, "stop_sequence")], ["'stop'"]),
    (2, 3): (lambda sol: [(openai.APIStatusError, sol[1]), (sol[0], lambda exc: 2048)], ["BadRequestError", "1024"]),
    (2, 4): (lambda sol: [lambda answer: answer["usage"]["input_tokens"]], ["cache_read_input_tokens"]),
    (2, 5): (lambda sol: [only_the_status], ["output_tokens"]),
    (3, 1): (lambda sol: [{"events_of": True, "naive_parse": True, "sse_parse": True}], []),
    (3, 2): (lambda sol: [True], []),
    (3, 3): (lambda sol: [(True, False)], []),
    (3, 4): (lambda sol: [split_each_read, drops_the_last_event], []),
    (4, 1): (lambda sol: [([64, 64, 64, 64, 44], [300])], ["62", "52"]),
    (4, 2): (lambda sol: [(2, 3), (6, 4)], []),
    (4, 3): (lambda sol: [{"llama-server -b 2048": 1, "llama-server -b 128": 11, "slot server": 11}], []),
    (4, 4): (lambda sol: [ArrivalOrder, LlamaServerPolicy], ["[2, 6, 12, 40]"]),
    (5, 1): (lambda sol: [lambda n: n // 10], []),
    (5, 2): (lambda sol: [(0.5, 0, 0), (sol[0], 12, 0)], []),
    (5, 3): (lambda sol: [(3 * sol[0], sol[1])], []),  # every head counted, not the KV heads
    (5, 4): (lambda sol: [prompt_cache_without_the_quarter], []),
    (6, 1): (lambda sol: ['root ::= [0-9] [0-9] [0-9] [0-9] "-" [0-9] [0-9] "-" [0-9] [0-9]'], []),
    (6, 2): (
        lambda sol: [(sol[0], False), ({**sol[0], "properties": {**sol[0]["properties"], "confidence": {"type": "number"}}}, True)],
        [],
    ),
    (6, 3): (lambda sol: [({**sol[0], "parameters": {**sol[0]["parameters"], "required": ["city"]}}, True)], []),
    (6, 4): (lambda sol: [2], []),
    (6, 5): (lambda sol: [False], []),
    (7, 1): (lambda sol: [(False, sol[1]), (True, {**sol[1], "llmkit --cache-ram 0": 0.9, "llama-server --cache-ram 0": 0.9})], []),
    (7, 2): (lambda sol: [(4096, sol[1]), (sol[0], {"llmkit": False, "llama-server": False})], ["2048"]),
    (7, 3): (lambda sol: [lambda n_prompt, n_batch: n_prompt // n_batch], []),
    (7, 4): (lambda sol: [{"llmkit": "tool_use", "llama-server": "tool_use"}], ["'text'"]),
    (7, 5): (lambda sol: [choose_slot], []),  # llmkit's rule, where it differs from llama-server's
    (8, 1): (lambda sol: [4.0], []),
    (8, 2): (lambda sol: [blocking_batch_route, threaded_batch_route_with_a_typo], []),
    (8, 3): (lambda sol: [ReleasesAtOnce], []),
    (9, 1): (lambda sol: [False], []),
    (9, 2): (lambda sol: [(5, True), (4, False)], []),
    (9, 3): (lambda sol: [lambda draft, sampled, is_eog: sampled[: len(draft) + 1]], []),
    (9, 4): (lambda sol: [LookupInEverything], []),
}
ALL = [ex for ch in exercises.chapters() for ex in ch]


def test_every_exercise_has_its_case_here():
    assert sorted(WRONG) == sorted((ex.chapter, ex.number) for ex in ALL)


@pytest.mark.parametrize("ex", ALL, ids=lambda ex: f"{ex.chapter}.{ex.number}")
def test_the_solution_passes_a_wrong_answer_fails_an_empty_one_is_not_answered(ex):
    solution = answers_of(ex, context(ex.chapter))
    verdict = ex.verdict(*solution)
    assert verdict.status == PASS, verdict
    make_wrong, forbidden = WRONG[ex.chapter, ex.number]
    for wrong in make_wrong(solution):
        answers = wrong if isinstance(wrong, tuple) and len(ex.answers) > 1 else (wrong,)
        verdict = ex.verdict(*answers)
        assert verdict.status == FAIL, (wrong, verdict)
        assert not [f for f in forbidden if f in verdict.message], verdict.message
    assert ex.verdict(*[...] * len(ex.answers)).status == UNANSWERED
