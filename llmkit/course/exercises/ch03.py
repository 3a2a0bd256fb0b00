"""Chapter 3 (the SSE format): pings in a recorded stream, a client that leaves llama-server, the clients' typed events,
your own SSE reader."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import suppress

import httpx
from httpx_sse import EventSource

from llmkit.course import tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import HIDDEN, LIVE, LLAMA, Chapter, Wrong, call
from llmkit.course.exercises.lab import LAB
from llmkit.sequential.translator import PROMPT

CHAPTER = Chapter(3)
TEXT = "Good morning, everyone! The library opens at nine."
READERS = ("events_of", "naive_parse", "sse_parse")


def chat_body(lang: str) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT.format(lang=lang, text=TEXT)}], "max_tokens": 32,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def replay(raw: bytes, read_size: int) -> httpx.Response:
    reads = [raw[i : i + read_size] for i in range(0, len(raw), read_size)]
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(reads))


# The chapter's three readers, as its cells define them
def events_of(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode("utf-8").split("\n\n") if e]


def naive_parse(response: httpx.Response) -> list[dict]:
    chunks = []
    for read in response.iter_bytes():
        for line in read.decode("utf-8", errors="replace").split("\n"):
            if line.startswith("data: {"):
                with suppress(json.JSONDecodeError):  # half an event: lost
                    chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def sse_parse(response: httpx.Response) -> list[dict]:
    return [json.loads(e.data) for e in EventSource(response).iter_sse() if e.data != "[DONE]"]


def readers_intact() -> dict[str, bool]:
    """The French stream, recorded from the slot server now, with ``: ping`` between its events: which reader still
    gives exactly its chunks, as the exercise reads them (events_of and json.loads, naive_parse in one read, sse_parse in 7-byte reads)."""
    raw = httpx.post(f"{servers.slots().url}/v1/chat/completions", json=chat_body("French"), timeout=120).content
    pinged = raw.replace(b"\n\n", b"\n\n: ping\n\n")
    clean = [json.loads(e) for e in events_of(raw)[:-1]]
    try:
        by_split = [json.loads(e) for e in events_of(pinged)[:-1]] == clean
    except json.JSONDecodeError:
        by_split = False
    return {"events_of": by_split, "naive_parse": naive_parse(replay(pinged, len(pinged))) == clean,
            "sse_parse": sse_parse(replay(pinged, 7)) == clean}  # fmt: skip


@CHAPTER.exercise(1, answers=("intact",), compares=(LIVE,), writes="a prediction per reader (a dict of True or False)")
def q1(intact) -> str:
    expect.mapping("intact", intact, READERS)
    measured = LAB.memo("ch3-readers", readers_intact)
    for reader in READERS:
        expect.same(f"intact[{reader!r}]", expect.truth(f"intact[{reader!r}]", intact[reader]), measured[reader])
    return tr("a stream recorded just now, with pings: {kept} gave exactly its chunks", kept=", ".join(r for r in READERS if measured[r]))


# --- exercise 2: does llama-server stop when the client leaves? -----------------------------------------------------


def idle_after_leaving() -> float:
    """llama-server, 1 slot: read 8 events of a 2,000-token answer, close; seconds until its slot is idle."""
    server = LAB.server("llama-server", "-np", "1", "-c", "4096", "-t", "1")
    body = {"messages": [{"role": "user", "content": "Write a long story about a cat."}], "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    read = 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            read += line.startswith("data: ")
            if read == 8:
                break
    t0 = time.perf_counter()
    while any(s["is_processing"] for s in httpx.get(f"{server.url}/slots", timeout=10).json()) and time.perf_counter() - t0 < 60:
        time.sleep(0.05)
    return time.perf_counter() - t0


@CHAPTER.exercise(2, answers=("goes_on_for_nobody",), compares=(LIVE, LLAMA), writes="a prediction (True or False), against llama-server")
def q2(goes_on_for_nobody) -> str:
    expect.truth("goes_on_for_nobody", goes_on_for_nobody)
    idle_after = idle_after_leaving()
    goes_on = idle_after > 10  # 2,000 tokens take far longer than 10 s here: a slot idle sooner stopped for the client
    expect.same("goes_on_for_nobody", goes_on_for_nobody, goes_on)
    return tr("llama-server's slot was idle {seconds:.2f} s after the client left", seconds=idle_after)


# --- exercise 3: the clients' typed events --------------------------------------------------------------------------


def typed_events() -> dict[str, bool]:
    """Does the openai client refuse llama-server's Responses events (no sequence_number)? Does the anthropic client
    hand over the slot server's ping?"""
    import anthropic
    import openai

    question = PROMPT.format(lang="French", text=TEXT)
    refused = False
    try:
        oai = openai.OpenAI(base_url=f"{servers.llama().url}/v1", api_key="not-needed", max_retries=0)
        events = list(oai.responses.create(model="smollm2", input=question, max_output_tokens=16, temperature=0, stream=True))
        refused = not events
    except (openai.APIError, ValueError, KeyError, TypeError):
        refused = True
    claude = anthropic.Anthropic(base_url=servers.slots().url, api_key="not-needed", max_retries=0)
    stream = claude.messages.create(model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=16, stream=True,
                                    extra_body={"temperature": 0})  # fmt: skip
    return {"refused": refused, "ping": any(e.type == "ping" for e in stream)}


@CHAPTER.exercise(3, answers=("openai_refuses", "anthropic_gives_ping"), compares=(LIVE, LLAMA), writes="two predictions (True or False)")
def q3(openai_refuses, anthropic_gives_ping) -> str:
    expect.truth("openai_refuses", openai_refuses)
    expect.truth("anthropic_gives_ping", anthropic_gives_ping)
    measured = LAB.memo("ch3-typed", typed_events)
    expect.same("openai_refuses", openai_refuses, measured["refused"])
    expect.same("anthropic_gives_ping", anthropic_gives_ping, measured["ping"])
    return tr("both clients streamed from both servers just now, as you said")


# --- exercise 4: your own SSE reader --------------------------------------------------------------------------------


def reference_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(name, data) of each event, as the SSE specification reads a body: lines end at \\n, \\r\\n or \\r; a line
    starting with ':' is a comment; ``data`` lines join with \\n; a blank line dispatches an event that has data; an
    event left without its blank line at the end is dropped."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            name = value
    return events


def recorded_streams() -> dict[str, bytes]:
    """Streams recorded live: chat (French, Japanese), Responses and Messages, from the slot server and llama-server."""
    question = PROMPT.format(lang="French", text=TEXT)
    out = {}
    for name, server in servers.both().items():
        for lang in ("French", "Japanese"):
            out[f"{name} chat, {lang}"] = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(lang), timeout=120).content
        named = {"responses": ("/v1/responses", {"input": question, "max_output_tokens": 16}),
                 "messages": ("/v1/messages", {"messages": [{"role": "user", "content": question}], "max_tokens": 16})}  # fmt: skip
        for api, (path, body) in named.items():
            out[f"{name} {api}"] = httpx.post(server.url + path, json={**body, "temperature": 0, "stream": True}, timeout=120).content
    return out


def variants(raw: bytes) -> dict[str, bytes]:
    """The same body as other servers could send it: pings, CRLF line ends, a data split over two lines, extra fields."""
    return {
        "as sent": raw,
        "with pings": b": ping\n\n" + raw.replace(b"\n\n", b"\n\n: ping\n\n"),
        "with CRLF line ends": raw.replace(b"\n", b"\r\n"),
        "with id and retry fields, no space after colons": raw.replace(b"data: ", b"id: 7\nretry: 1000\ndata:"),
        "with a data split over two lines": raw.replace(b"data: ", b"data: first line\ndata: ", 1),
        "with an unfinished last event": raw + b"data: never finished",
    }


def cases() -> Iterator[tuple[str, bytes, int]]:
    for stream_name, raw in LAB.memo("ch3-streams", recorded_streams).items():
        for variant, body in variants(raw).items():
            for size in (1, 7, 4096):
                yield f"{stream_name}, {variant}, {size}-byte reads", body, size


@CHAPTER.exercise(4, answers=("read_events",), compares=(HIDDEN, LLAMA), writes="an SSE reader, read_events(reads) (a function)")
def q4(read_events) -> str:
    fn = expect.function("read_events", read_events, 1)
    n = 0
    for case, body, size in cases():
        reads = (body[i : i + size] for i in range(0, len(body), size))
        yours = call(fn, reads, case=case)
        expected = reference_events(body)
        if not isinstance(yours, list) or not all(isinstance(e, tuple) and len(e) == 2 for e in yours):
            raise Wrong(tr("{case}: expected a list of (name, data) pairs; got {got}", case=case, got=expect.shown(yours)))
        for k, (a, b) in enumerate(zip(yours, expected, strict=False), 1):
            if tuple(a) != b:
                raise Wrong(tr("{case}: event {k} differs: yours {yours}", case=case, k=k, yours=expect.shown(a)))
        if len(yours) != len(expected):
            side = tr("too many") if len(yours) > len(expected) else tr("too few")
            raise Wrong(tr("{case}: yours read {n} events, {side}", case=case, n=len(yours), side=side))
        n += 1
    return tr(
        "every event of {n} streams and variants, read 1, 7 and 4096 bytes at a time, from the slot server and llama-server", n=n // 3
    )
