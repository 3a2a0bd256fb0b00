"""Chapter 1 (the sequential server): a stream that fails early, a read timeout, half characters in other scripts."""

from __future__ import annotations

import json
import logging
import time

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import LIVE, SERVER, Chapter, Wrong, call
from llmkit.course.exercises.lab import LAB

CHAPTER = Chapter(1)
TEXT = "Good morning, everyone! The library opens at nine."


def stream_events(body: str) -> list[object]:
    """The data of each event of an SSE body, parsed as JSON where it is JSON."""
    events: list[object] = []
    for block in body.split("\n\n"):
        data = "\n".join(line.removeprefix("data: ") for line in block.splitlines() if line.startswith("data: "))
        if data:
            try:
                events.append(json.loads(data))
            except json.JSONDecodeError:
                events.append(data)
    return events


@CHAPTER.exercise(1, answers=("FailsAtOnce", "status_predicted"), compares=(SERVER, LIVE),
                  writes="a translator whose stream fails before its first token (a class), served; the status predicted")  # fmt: skip
def q1(FailsAtOnce, status_predicted) -> str:
    from llmkit import models
    from llmkit.course import launch
    from llmkit.sequential.app import create_app
    from llmkit.sequential.translator import Translator

    cls = expect.klass("FailsAtOnce", FailsAtOnce, Translator)
    expect.whole_number("status_predicted", status_predicted)
    translator = call(cls, models.default_model_path(), temperature=0, max_tokens=16, case=tr("making your translator"))
    logging.disable(logging.ERROR)  # the server logs the failure with a long traceback: the check says what matters
    try:
        with launch.serve_app(create_app(translator)) as url:
            first = httpx.post(f"{url}/translate/stream", json={"text": TEXT, "target_lang": "French"}, timeout=120)
            t0 = time.perf_counter()
            second = httpx.post(f"{url}/translate/stream", json={"text": "Thank you.", "target_lang": "French"}, timeout=60)
            second_took = time.perf_counter() - t0
    finally:
        logging.disable(logging.NOTSET)
        translator.close()
    events = stream_events(first.text)
    if first.status_code == 200 and first.headers.get("content-type", "").startswith("text/event-stream"):
        if not events or events[-1] == "[DONE]":
            raise Wrong(tr("the stream of your translator ended normally ([DONE]): it did not fail"))
        if any(isinstance(e, str) for e in events[:-1]):
            raise Wrong(tr("your translator's stream sent {n} piece(s) of text before its error: it should fail before its first token",
                           n=sum(isinstance(e, str) for e in events[:-1])))  # fmt: skip
        if not (isinstance(events[-1], dict) and "error" in events[-1]):
            raise Wrong(tr("the stream's last event is not an error event: {got}", got=expect.shown(events[-1])))
    if second.status_code != first.status_code or second_took > 30:
        raise Wrong(tr("a second request to the same server answered differently: the first failure left the translator stuck"))
    expect.same("status_predicted", status_predicted, first.status_code, ordered=False)
    return tr("the client got {status} and the error inside the stream; llama-server answers an early failure with a 400 "
              "and a JSON body instead", status=first.status_code)  # fmt: skip


LONG_TEXT = "The old lighthouse keeper climbed the stairs every evening, lit the lamp, and watched the ships pass until morning."


@CHAPTER.exercise(2, answers=("enough",), compares=(LIVE, SERVER), writes="a read timeout (seconds, or an httpx.Timeout)")
def q2(enough) -> str:
    if isinstance(enough, httpx.Timeout):
        if enough.read is None:
            raise Wrong(tr("enough has no read timeout (None): that waits forever, it is not a choice of timeout"))
        read = float(enough.read)
    else:
        read = expect.number("enough", enough)
    if read <= 0:
        raise Wrong(tr("a read timeout must be positive, not {got}", got=read))
    server = LAB.server("sequential", "--temp", "0", "-n", "200", "-t", "1")
    body = {"text": LONG_TEXT, "target_lang": "Japanese"}
    t0 = time.perf_counter()
    try:
        answer = httpx.post(f"{server.url}/translate", json=body, timeout=httpx.Timeout(10.0, read=read))
    except httpx.ReadTimeout:
        raise Wrong(tr("POST /translate failed with httpx.ReadTimeout after {seconds:.1f} s: a non-streaming answer is silent "
                       "until the whole translation is done", seconds=time.perf_counter() - t0)) from None  # fmt: skip
    silent = time.perf_counter() - t0
    if answer.status_code != 200:
        raise RuntimeError(f"the sequential server answered {answer.status_code}: {answer.text[:200]}")
    if read < 2 * silent:
        raise Wrong(tr("POST /translate succeeded after one silence of {seconds:.1f} s, but your read timeout of {read:.1f} s "
                       "leaves less than twice that: a machine twice as busy would fail it", seconds=silent, read=read))  # fmt: skip
    return tr("POST /translate answered after one silence of {seconds:.1f} s, within your read timeout of {read:.1f} s "
              "(and twice over)", seconds=silent, read=read)  # fmt: skip


OTHER = "Привет, мир! 👋🙂"


def utf8_alone(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@CHAPTER.exercise(3, answers=("split_alone", "naive_shows_fffd"), compares=(LIVE,), writes="two predictions (True or False)")
def q3(split_alone, naive_shows_fffd) -> str:
    model = LAB.model()
    pieces = [model.token_to_piece(t) for t in model.tokenize(OTHER, add_special=False)]
    halves = [p for p in pieces if not utf8_alone(p)]
    naive = "".join(p.decode("utf-8", errors="replace") for p in pieces)
    expect.same("split_alone", expect.truth("split_alone", split_alone), bool(halves))
    expect.same("naive_shows_fffd", expect.truth("naive_shows_fffd", naive_shows_fffd), "\ufffd" in naive)
    return tr("the model spells the text in {n} tokens, {broken} of them not valid UTF-8 alone", n=len(pieces), broken=len(halves))
