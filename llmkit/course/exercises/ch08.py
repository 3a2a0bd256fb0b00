"""Chapter 8 (making it your own): one slot measured, your own endpoint, your own stop-string matcher."""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from llmkit.course import client, tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, LLAMA, SERVER, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, one_by_one, quiet_engine
from llmkit.text import StopMatcher

CHAPTER = Chapter(8)
QUESTIONS = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city."]


# --- exercise 1: point measure() at another server ------------------------------------------------------------------


def measure(url: str, n_clients: int, max_tokens: int) -> float:
    """The chapter's harness: n clients at once, their aggregate tokens per second."""
    call_ = functools.partial(client.stream_chat, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runs = client.concurrently(call_, [(url, [{"role": "user", "content": QUESTIONS[i % 4]}]) for i in range(n_clients)])
    return client.aggregate_tokens_per_second(runs)


def one_slot_gain() -> float:
    """The median of 3 rounds of 4 clients over 1 (48 tokens each): a stall of a shared machine moves one round."""
    server = LAB.server("slots", "-t", "1", "-np", "1", "-c", "4096")
    measure(server.url, 1, 8)  # warm-up
    return statistics.median(measure(server.url, 4, 48) / measure(server.url, 1, 48) for _ in range(3))


@CHAPTER.exercise(1, answers=("gain_predicted",), compares=(LIVE,), writes="a prediction: the gain of 4 clients over 1 on one slot")
def q1(gain_predicted) -> str:
    predicted = expect.number("gain_predicted", gain_predicted)
    measured = one_slot_gain()
    expect.near("gain_predicted", predicted, measured, 0.35,
                tr("on one slot the clients take turns, and the turns' timing on a shared machine moves the gain by "
                   "a few tenths from one run to the next"))  # fmt: skip
    return tr("one slot, 4 clients against 1: {gain:.2f}x the aggregate tokens per second, measured just now", gain=measured)


# --- exercise 2: your own endpoint -------------------------------------------------------------------------------------

HIDDEN_BATCHES = [(["Good luck!", "The shop is closed.", "I like tea."], "German"), (["Where is the station?"], "Spanish"), ([], "French")]


@contextmanager
def served_with(add_route: Callable) -> Iterator[tuple[str, Any]]:
    from llmkit import models
    from llmkit.course import launch
    from llmkit.sequential import app as sequential_app
    from llmkit.sequential.translator import Translator

    translator = Translator(models.default_model_path(), temperature=0, max_tokens=16, n_threads=1)
    app = sequential_app.create_app(translator)
    call(add_route, app, translator, case=tr("adding your route"))
    logging.disable(logging.ERROR)
    try:
        with launch.serve_app(app) as url:
            yield url, translator
    finally:
        logging.disable(logging.NOTSET)
        translator.close()


def health_during(url: str, body: dict) -> tuple[httpx.Response, float, float]:
    """POST /translate/batch, and GET /health while it runs: (the batch's answer, its seconds, /health's seconds)."""
    result: dict[str, Any] = {}

    def batch() -> None:
        t0 = time.perf_counter()
        result["answer"] = httpx.post(f"{url}/translate/batch", json=body, timeout=600)
        result["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=batch)
    thread.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    httpx.get(f"{url}/health", timeout=600)
    health = time.perf_counter() - t0
    thread.join()
    return result["answer"], result["seconds"], health


@CHAPTER.exercise(
    2, answers=("add_batch_route",), compares=(SERVER,), writes="add_batch_route(app, translator): POST /translate/batch (a function)"
)
def q2(add_batch_route) -> str:
    fn = expect.function("add_batch_route", add_batch_route, 2)
    with served_with(fn) as (url, _):
        for texts, lang in HIDDEN_BATCHES:
            case = tr("{n} text(s) to {lang}", n=len(texts), lang=lang)
            answer = httpx.post(f"{url}/translate/batch", json={"texts": texts, "target_lang": lang}, timeout=600)
            if answer.status_code != 200:
                raise Wrong(
                    tr(
                        "{case}: POST /translate/batch answered {status}: {body}",
                        case=case,
                        status=answer.status_code,
                        body=answer.text[:200],
                    )
                )
            body = answer.json()
            if not isinstance(body, dict) or not isinstance(body.get("translations"), list):
                raise Wrong(tr('{case}: expected {{"translations": [...]}}; got {got}', case=case, got=expect.shown(body)))
            one_by_one = [
                httpx.post(f"{url}/translate", json={"text": t, "target_lang": lang}, timeout=600).json()["translation"] for t in texts
            ]
            if body["translations"] != one_by_one:
                raise Wrong(tr("{case}: the translations differ from what POST /translate gives for each text, in order", case=case))
        many = {"texts": [f"Sentence number {i} of the test." for i in range(4)], "target_lang": "French"}
        answer, seconds, health = health_during(url, many)
    if answer.status_code != 200:
        raise Wrong(tr("a batch of four texts answered {status}", status=answer.status_code))
    if health > 1.0 and health > 0.5 * seconds:
        raise Wrong(tr("GET /health waited {seconds:.1f} s while a batch was translated: the server could not answer meanwhile",
                       seconds=health))  # fmt: skip
    return tr("right for {n} batches the notebook never sent, and GET /health answered in {ms:.0f} ms while a batch ran",
              n=len(HIDDEN_BATCHES), ms=1e3 * health)  # fmt: skip


# --- exercise 3: your own stop-string matcher ------------------------------------------------------------------------

# (what the case is, the stop strings, the pieces of text as they come): none of them in the notebook
MATCHER_CASES: list[tuple[str, list[str], list[str]]] = [
    ("no stop string", [], ["Hello", ", world", "!"]),
    ("a stop string inside one piece", ["world"], ["Hello, world!"]),
    ("a stop string split over three pieces", ["STOP"], ["go go S", "T", "OP and more"]),
    ("a prefix that comes to nothing", ["STOP"], ["a ST", "ART b"]),
    ("a prefix at the very end", ["STOP"], ["one two ST"]),
    ("two stop strings, the later listed one first in the text", [".", "!"], ["Wow! Yes."]),
    ("two stop strings starting at the same place", ["ab", "abc"], ["xxabcd"]),
    ("text after the stop string in the same piece", ["\n"], ["line one\nline two"]),
    ("an empty stop string among others", ["", "end"], ["the end."]),
    ("pieces after the stop", ["x"], ["ax", "b", "c"]),
]


def run_matcher(make: Callable[[list[str]], Any], stops: list[str], pieces: list[str], case: str) -> tuple[list[str], str, bool, str]:
    """Each push's output, the flush, whether it stopped, and which word."""
    matcher = call(make, list(stops), case=case)
    pushed = [call(matcher.push, piece, case=case) for piece in pieces]
    flushed = "" if getattr(matcher, "stopped", False) else call(matcher.flush, case=case)
    return (
        pushed,
        flushed,
        bool(getattr(matcher, "stopped", None)),
        getattr(matcher, "word", "") if getattr(matcher, "stopped", False) else "",
    )


def check_matcher(make: Callable[[list[str]], Any]) -> None:
    for case, stops, pieces in MATCHER_CASES:
        yours, expected = run_matcher(make, stops, pieces, case), run_matcher(StopMatcher, stops, pieces, case)
        pushed, flushed, stopped, word = yours
        if not all(isinstance(p, str) for p in pushed) or not isinstance(flushed, str):
            raise Wrong(tr("{case}: push and flush should return strings", case=case))
        if "".join(pushed) + flushed != "".join(expected[0]) + expected[1]:
            raise Wrong(tr("{case}: the text released differs: yours {yours!r}", case=case, yours="".join(pushed) + flushed))
        if stopped != expected[2] or word != expected[3]:
            raise Wrong(tr("{case}: stopped={stopped}, word={word!r} in yours: not what happened", case=case, stopped=stopped, word=word))
        window = max((len(s) for s in stops), default=1) - 1  # the most a stop string not yet whole can have started in
        for k in range(1, len(pieces) + 1):  # released so far: never more than is safe, nor held back beyond the window
            released, safe = "".join(pushed[:k]), "".join(expected[0][:k])
            if not safe.startswith(released):
                raise Wrong(tr("{case}: after push {k} yours had released {yours!r}: text that could still be part of a stop string",
                               case=case, k=k, yours=released))  # fmt: skip
            if len(released) < len(safe) - window:
                raise Wrong(tr("{case}: after push {k} yours still held back {held!r}: more than a stop string could start in, "
                               "so the stream stalls", case=case, k=k, held=safe[len(released) :]))  # fmt: skip


STOP_REQUESTS = [("Count from one to twenty in words: one, two, three,", [" seven", "ten"]),
                 ("Write the days of the week, one per line:\n", ["Thursday", "\nFri"]),
                 ("The recipe for tea: boil water,", [".", "milk"])]  # fmt: skip


def matcher_of(make: Callable[[list[str]], Any] | None) -> Callable[[tuple[str, ...]], StopMatcher]:
    """The engine's stop-matcher seam (``EngineConfig.stop_matcher``) filled with the learner's class, or llmkit's."""
    return StopMatcher if make is None else lambda stops: make(list(stops))


def engine_stops(make: Callable[[list[str]], Any] | None, guard: Guard | None = None) -> list[tuple[str, str]]:
    """Each stop request, greedy, in a real engine: (its text, the stop string that ended it, or "")."""

    from llmkit.engine import Engine, EngineConfig

    with (
        quiet_engine(),
        Engine(LAB.model(), EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, stop_matcher=matcher_of(make))) as engine,
    ):

        def submit(request: tuple[str, list[str]]) -> Any:
            prompt, stops = request
            return engine.complete(prompt, max_tokens=48, temperature=0, stop=stops, cache_prompt=False)

        finished = one_by_one(submit, STOP_REQUESTS, guard)
    return [(r.text, r.outcome.stopping_word if r.outcome is not None else "") for r in finished]


def llama_stops() -> list[tuple[str, str]]:
    url = servers.llama().url
    out = []
    for prompt, stops in STOP_REQUESTS:
        body = {"prompt": prompt, "n_predict": 48, "temperature": 0, "stop": stops, "cache_prompt": False}
        answer = httpx.post(f"{url}/completion", json=body, timeout=300).json()
        out.append((answer["content"], answer.get("stopping_word", "")))
    return out


class Guarded:
    """A learner's matcher whose methods report their first error to ``guard``."""

    def __init__(self, inner: Any, guard: Guard):
        self._inner, self._guard = inner, guard

    def push(self, text: str) -> str:
        return self._guard.wrap(self._inner.push)(text)

    def flush(self) -> str:
        return self._guard.wrap(self._inner.flush)()

    @property
    def stopped(self) -> bool:
        return bool(getattr(self._inner, "stopped", False))

    @property
    def word(self) -> str:
        return getattr(self._inner, "word", "")


@CHAPTER.exercise(
    3,
    answers=("StopStrings",),
    compares=(HIDDEN, ENGINE, LLAMA),
    writes="a stop-string matcher (a class), in the engine and beside llama-server",
)
def q3(StopStrings) -> str:
    cls = expect.klass("StopStrings", StopStrings)
    check_matcher(cls)
    guard = Guard(tr("in the engine"))
    yours = engine_stops(lambda stops: Guarded(guard.wrap(cls)(stops), guard), guard)
    ours, theirs = LAB.memo("ch8-stops", lambda: (engine_stops(None), llama_stops()))
    for (prompt, _), a, b, c in zip(STOP_REQUESTS, yours, ours, theirs, strict=True):
        if a != b:
            raise Wrong(
                tr("in the engine, {prompt!r}: your matcher ended the answer elsewhere (yours: {text!r})", prompt=prompt, text=a[0])
            )
        if b == c and a != c:
            raise Wrong(tr("{prompt!r}: llama-server ended the answer elsewhere", prompt=prompt))
    agree = sum(b == c for b, c in zip(ours, theirs, strict=True))
    return tr("right on {n} hidden cases; in a real engine your matcher cut {m} answers where llmkit's does ({agree} of them where "
              "llama-server does too, on the same greedy text)", n=len(MATCHER_CASES), m=len(STOP_REQUESTS), agree=agree)  # fmt: skip
