"""Chapter 10 (beyond one machine): the key consistent_hash hashes for a chat, the blocks a worker tells for two
prompts of one tenant, KV events the real router accepts (names, a chain, a removal)."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from typing import Any

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import LIVE, SERVER, Chapter, Wrong, call
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


# --- exercise 1: the key consistent_hash hashes -------------------------------------------------------------------------

KEY = re.compile(r"Extracted hash key: (.*)")  # the router's own log line (consistent_hash.rs), one a request
CASES: list[tuple[dict[str, str], dict[str, Any]]] = [  # (headers, body fields) of a chat: none of them the chapter's own
    ({"x-request-id": "req-41", "x-user-id": "dana"}, {}),
    ({"X-Trace-Id": "t-9"}, {}),
    ({"x-session-id": "", "x-tenant-id": "acme"}, {}),
    ({}, {"user": "erin"}),
    ({}, {"session_params": {"session_id": "chat-77"}}),
    ({}, {}),
]  # fmt: skip


def chat_body(fields: dict) -> dict:
    return {"model": "any", "messages": [{"role": "user", "content": "Which plan suits me?"}], "max_tokens": 1, **fields}


def routing_keys() -> list[str]:
    """Each of ``CASES`` through vllm-router's consistent_hash in front of a slot server: the key its log says it hashed."""
    from llmkit.course import fleet

    router = fleet.start_router("consistent_hash", [worker().url], (), None, 60)
    try:
        keys = []
        for headers, fields in CASES:
            before = len(KEY.findall(COLOURS.sub("", router.log())))
            # routed, whatever the worker answers (it may refuse a body field the router reads)
            httpx.post(f"{router.url}/v1/chat/completions", json=chat_body(fields), headers=headers, timeout=120)
            found = KEY.findall(COLOURS.sub("", router.log()))
            keys.append(found[-1].strip() if len(found) > before else "")
        return keys
    finally:
        router.stop()


@CHAPTER.exercise(1, answers=("hash_key",), compares=(SERVER,), writes="hash_key(headers, body): a routing key (a function)")
def q1(hash_key) -> str:
    fn = expect.function("hash_key", hash_key, 2)
    measured = LAB.memo("ch10-hash-keys", routing_keys)
    for (headers, fields), key in zip(CASES, measured, strict=True):
        case = tr("a chat with the headers {headers} and the body fields {fields}", headers=headers, fields=fields)
        got = call(fn, dict(headers), chat_body(fields), case=case)
        if got != key:
            raise Wrong(tr("{case}: your key is {got}; the router hashed another one", case=case, got=expect.shown(got)))
    return tr("the real router hashed the key your function gives for each of the {n} chats", n=len(CASES))


# --- exercise 2: the blocks a worker tells -----------------------------------------------------------------------------

STEM = (
    "My {} bill: explain how the meter reading is estimated when nobody was at home on the day it was due, and what "
    "I can do about it when the estimate is far too high for a small flat like mine."
)
PAIR = (  # two users of one tenant: the same system prompt; their questions differ in one word, then go on alike
    [{"role": "system", "content": "You are the help desk of Fjord Energy. Answer briefly. " * 4},
     {"role": "user", "content": STEM.format("electricity")}],
    [{"role": "system", "content": "You are the help desk of Fjord Energy. Answer briefly. " * 4},
     {"role": "user", "content": STEM.format("gas")}],
)  # fmt: skip


def blocks_told(pair: tuple[list[dict], ...] = PAIR) -> int:
    """The distinct blocks a slot server (``--kv-events --kv-share``, 2 slots) tells its slots hold (the device tier) while it
    reads ``pair``'s chats one after the other: every ``BlockStored`` name, counted once."""
    import msgpack
    import zmq

    server = LAB.server("slots", *WORKER[:2], "-np", "2", "-kvu", "-c", "2048", "--kv-events", "--kv-share")
    (source,) = httpx.get(f"{server.url}/kv_event_sources", timeout=30).json().values()
    names: set[bytes] = set()
    with zmq.Context() as context, context.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, source["topic"].encode())
        sub.connect(source["endpoint"])
        time.sleep(0.5)  # a new subscription takes a moment to reach the publisher
        for messages in pair:
            chat(server.url, messages)
        while sub.poll(1000):
            for event in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                if event["type"] == "BlockStored" and event["medium"] is None:
                    names.update(event["block_hashes"])
    return len(names)


@CHAPTER.exercise(2, answers=("blocks",), compares=(LIVE, SERVER), writes="a prediction (a number of blocks)")
def q2(blocks) -> str:
    expect.whole_number("blocks", blocks)
    measured = LAB.memo("ch10-blocks-told", blocks_told)
    expect.same("blocks", blocks, measured)
    return tr("a slot server here told {n} distinct blocks for the two chats", n=measured)


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


def render(url: str, messages: list[dict]) -> list[int]:
    return httpx.post(f"{url}/v1/chat/completions/render", json={"messages": messages}, timeout=60).json()["token_ids"]


def chained(fn: Any, tokens: list[int]) -> tuple[dict, dict]:
    """The learner's events for ``tokens`` cut after 2 blocks (and a few tokens) and whole: a longer prompt's first blocks
    must keep their names, and a block must be named after everything before it, not its own tokens alone."""
    short = call(fn, list(tokens[: 2 * BLOCK + 3]), BLOCK, case=tr("the first 2 blocks of a prompt"))
    whole = call(fn, list(tokens), BLOCK, case=tr("the same prompt, whole"))
    for event in (short, whole):
        if not isinstance(event, dict) or not isinstance(event.get("block_hashes"), list):
            raise Wrong(tr("stored() should return one event, a dict with its block_hashes; got {got}", got=expect.shown(event)))
    names = whole["block_hashes"]
    if names[:2] != short["block_hashes"] or len(set(map(bytes, names))) != len(names):
        raise Wrong(tr("a block's name should stand for the whole prefix up to its end: the same for the same prefix, "
                       "another for another (yours repeat, or change when the prompt goes on)"))  # fmt: skip
    swapped = [*tokens[BLOCK : 2 * BLOCK], *tokens[:BLOCK], *tokens[2 * BLOCK :]]  # the first two blocks swapped, the rest alike
    if call(fn, swapped, BLOCK, case=tr("the prompt with its first two blocks swapped"))["block_hashes"][2:] == names[2:]:
        raise Wrong(tr("a block after another prefix kept its name: a name should depend on every block before it (a chain), "
                       "or a worker's later block could be taken for another prompt's"))  # fmt: skip
    return short, whole


def extend_and_remove(fn: Any, url: str, publish: Any, router: Any) -> None:
    """Publish the first 2 blocks of a prompt, then the rest as an extension (its parent: the last of those), then remove
    the extension: the router must credit the whole prompt, then only the first 2 blocks."""
    messages = [{"role": "user", "content": "A long letter about the meter: " + "it reads high every winter, " * 12}]
    tokens = render(url, messages)
    short, whole = chained(fn, tokens)
    rest = {**whole, "block_hashes": whole["block_hashes"][2:], "token_ids": whole["token_ids"][2 * BLOCK :],
            "parent_block_hash": short["block_hashes"][-1]}  # fmt: skip
    publish([short])
    publish([rest])
    got, refused = credited(router, messages)
    if got != (len(tokens) - 1) // BLOCK * BLOCK:
        why = f" ({refused})" if refused else ""
        raise Wrong(tr("the router did not take your blocks as one chain (the rest after the first two, named as their parent): "
                       "it credited {got} of {n} prompt tokens{why}", got=got, n=len(tokens), why=why))  # fmt: skip
    publish([{"type": "BlockRemoved", "block_hashes": rest["block_hashes"], "medium": None}])
    got, _ = credited(router, messages)
    if got != 2 * BLOCK:
        raise Wrong(tr("after a BlockRemoved of the rest, by your names, the router credited {got} tokens; it should have kept only "
                       "the first 2 blocks ({n})", got=got, n=2 * BLOCK))  # fmt: skip


@CHAPTER.exercise(3, answers=("stored",), compares=(SERVER,), writes="stored(tokens, block_size): a KV event (a function)")
def q3(stored) -> str:
    fn = expect.function("stored", stored, 2)
    server = worker()
    with router_fed_by_you(server.url) as (publish, router):
        for case, messages in PROMPTS:
            tokens = render(server.url, messages)
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
        extend_and_remove(fn, server.url, publish, router)
    return tr("the real router read your events, chained a prompt's blocks by your names and removed them by name")
