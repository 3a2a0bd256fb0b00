"""Chapter 10 (beyond one machine): where consistent_hash sends chats without a session header, the bytes a
hand-off moves, a KV event the real router accepts."""

from __future__ import annotations

import random
import re
import time
from contextlib import contextmanager
from typing import Any

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import ENGINE, LIVE, SERVER, Chapter, Wrong, call
from llmkit.course.exercises.lab import LAB

CHAPTER = Chapter(10)
WORKER = ("-t", "1", "-np", "1", "-c", "2048")  # a small slot server: a fleet's worker
BLOCK = 16  # the router's --kv-event-block-size


def worker(index: int = 0) -> Any:
    """A slot server named ``ch10@index`` (each answer's ``model`` says which one served it)."""
    return LAB.server("slots", *WORKER, "--alias", f"ch10@{index}")


def chat(url: str, messages: list[dict], **fields: Any) -> dict:
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "any", "messages": messages, "max_tokens": 1, **fields}, timeout=120)
    answer.raise_for_status()
    return answer.json()


# --- exercise 1: consistent_hash without a session header -------------------------------------------------------------


def replicas_without_a_header() -> int:
    """Six users' chats, without a session header, through vllm-router's consistent_hash in front of two slot servers:
    how many of the two served them."""
    from llmkit.course import fleet

    urls = [worker(i).url for i in range(2)]
    router = fleet.start_router("consistent_hash", urls, (), None, 60)
    try:
        users = [f"I am user {k}. Which of your plans suits a family of {k + 2}?" for k in range(6)]
        return len({chat(router.url, [{"role": "user", "content": text}])["model"] for text in users})
    finally:
        router.stop()


@CHAPTER.exercise(1, answers=("replicas_used",), compares=(LIVE,), writes="a prediction (a number of replicas)")
def q1(replicas_used) -> str:
    expect.whole_number("replicas_used", replicas_used)
    measured = LAB.memo("ch10-no-header", replicas_without_a_header)
    expect.same("replicas_used", replicas_used, measured)
    return tr("six users' chats without a session header, through consistent_hash just now: {n} of the 2 replicas served them",
              n=measured)  # fmt: skip


# --- exercise 2: the bytes a hand-off moves ----------------------------------------------------------------------------


def handoff_bytes(n_tokens: int = 1000) -> int:
    """The KV cells a prefill worker hands over for a prompt of ``n_tokens`` (random tokens, read in an engine here)."""
    from llmkit.engine import Engine, EngineConfig, RequestParams

    prompt = [random.Random(10).randrange(1000, 30000) for _ in range(n_tokens)]
    with Engine(LAB.model(), EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1)) as engine:
        request = engine.submit(prompt, RequestParams.of(max_tokens=1, temperature=0, hand_off=True))
        request.result()
        assert request.outcome is not None and request.outcome.kv is not None
        return len(request.outcome.kv.cells)


@CHAPTER.exercise(2, answers=("bytes_for_1000",), compares=(LIVE, ENGINE), writes="a prediction (a number of bytes)")
def q2(bytes_for_1000) -> str:
    predicted = expect.number("bytes_for_1000", bytes_for_1000)
    measured = LAB.memo("ch10-handoff", handoff_bytes)
    expect.within("bytes_for_1000", predicted, measured, 0.02, tr("llama.cpp writes a small header before the cells"))
    return tr("an engine here handed over {n:,} bytes for a prompt of 1,000 tokens", n=measured)


# --- exercise 3: a KV event the router accepts -------------------------------------------------------------------------

PROMPTS = [  # (what the case is, the chat): no two share their first block
    ("a system prompt and a question", [{"role": "system", "content": "You are the help desk of Fjord Energy. " * 10},
                                        {"role": "user", "content": "Why is my bill so high?"}]),
    ("a long question of a user", [{"role": "user", "content": "Please summarise: " + "the meter reads high in winter; " * 20}]),
]  # fmt: skip
DECISION = re.compile(r"KV prefix decision .*?credited_prefix_tokens=(\d+)")
REFUSED = re.compile(r"WARN .*?kv_index (.*)")
COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # the router's log is coloured


@contextmanager
def router_fed_by_you(url: str) -> Any:
    """vllm-router's kv_aware in front of the slot server at ``url``, reading that worker's KV events from a ZMQ socket
    of ours (``--kv-event-source``): yields ``publish(events)``, which sends one batch as a worker does, and the router."""
    import msgpack
    import zmq

    from llmkit.course import fleet

    context = zmq.Context()
    pub = context.socket(zmq.XPUB)  # an XPUB hears the router's subscription: nothing is published before it listens
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    model_id = httpx.get(f"{url}/get_server_info", timeout=30).json()["model_id"]
    flags = ("--kv-event-source", f"{url}=tcp://127.0.0.1:{port}", "--kv-event-model", model_id, "--kv-event-block-size", str(BLOCK),
             "--log-level", "debug")  # fmt: skip
    router = fleet.start_router("kv_aware", [url], flags, None, 60)
    seq = iter(range(1 << 62))

    def publish(events: list[dict]) -> None:
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        pub.send_multipart([b"", next(seq).to_bytes(8, "big", signed=True), payload])
        time.sleep(0.3)  # the router's subscriber polls every 10 ms

    try:
        if not pub.poll(30_000):
            raise RuntimeError("the router did not subscribe to the KV events within 30 s")
        pub.recv()
        publish([])  # the first batch a subscriber sees is a gap for it: it counts what comes after
        yield publish, router
    finally:
        router.stop()
        context.destroy(linger=0)


def credited(router: Any, messages: list[dict]) -> tuple[int, str | None]:
    """Route a chat; the prompt tokens the router credited to the worker's cache, and its last warning about the events."""
    before = router.log().count("KV prefix decision")
    chat(router.url, messages)
    log = COLOURS.sub("", router.log())
    decisions = DECISION.findall(log)
    refused = REFUSED.findall(log)
    return (int(decisions[-1]) if len(decisions) > before else 0), (refused[-1] if refused else None)


@CHAPTER.exercise(3, answers=("stored",), compares=(SERVER,), writes="stored(tokens, block_size): a KV event (a function)")
def q3(stored) -> str:
    fn = expect.function("stored", stored, 2)
    server = worker()
    with router_fed_by_you(server.url) as (publish, router):
        for case, messages in PROMPTS:
            tokens = httpx.post(f"{server.url}/v1/chat/completions/render", json={"messages": messages}, timeout=60).json()["token_ids"]
            event = call(fn, list(tokens), BLOCK, case=case)
            if not isinstance(event, dict):
                raise Wrong(tr("{case}: stored() should return one event, a dict; got {got}", case=case, got=expect.shown(event)))
            try:
                publish([event])
            except (TypeError, ValueError) as exc:
                raise Wrong(tr("{case}: your event cannot be written in msgpack: {error}", case=case, error=exc)) from None
            got, refused = credited(router, messages)
            expected = (len(tokens) - 1) // BLOCK * BLOCK  # whole blocks, never the one that holds the prompt's last token
            if refused is not None and got < expected:
                raise Wrong(tr("{case}: the router refused your batch: {reason}", case=case, reason=refused))
            if got != expected:
                raise Wrong(tr("{case}: the router credited {got} of the {n} prompt tokens to the worker's cache; your event "
                               "should have given it {expected}", case=case, got=got, n=len(tokens), expected=expected))  # fmt: skip
    return tr("the real router read your events and credited the worker with every whole block of both prompts")
