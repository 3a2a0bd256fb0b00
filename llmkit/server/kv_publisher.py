"""The engine's KV events on the wire, for a router's ``kv_aware`` policy, and the two routes that say where they are.

    GET /get_server_info     {"model_id", "model_path", "kv_block_size"}: the cache's identity and its block size
    GET /kv_event_sources    {"0": {"endpoint", "replay_endpoint", "topic", "publisher": "zmq", "encoding": "msgpack",
                                   "schema_version": 1}}, or {} when the server publishes none

``llmkit serve slots --kv-events`` turns them on (``--kv-block-size``: tokens per block, 16 by default). The engine
tells what its slots and prompt cache hold at each step's end (``llmkit.engine.kv_events``); a ``KVPublisher`` sends
each batch as vLLM's ``ZmqEventPublisher`` does and as vllm-router 0.1.17 reads it (its ``kv_index/subscriber.rs``):

- a ZMQ PUB socket, three frames per batch: ``[topic, seq, payload]``, ``seq`` 8 bytes big-endian signed, counting
  from 0; ``payload`` msgpack ``[ts, [event, ...]]``, each event a map with its ``"type"`` (at most 4,096 a batch);
- a ZMQ ROUTER socket for a subscriber that missed some (it joined late, or dropped a frame): asked
  ``[b"", start_seq]`` by a DEALER, it answers ``[b"", topic, seq, payload]`` for every seq from ``start_seq`` to the
  last one sent, then ``[b"", b"", -1, b""]``.

vLLM's replay resends the last batches it kept, and a subscriber further behind is lost. Here the replay is what the
batches add up to now (``Mirror``): at ``start_seq`` one batch that clears the subscriber's view of this worker and
stores every block held, then empty batches up to the last seq. A router that joins a worker long after it started
(or restarts) so learns everything that worker holds, not only what changes from then on. Re-reading a batch it had
already applied is harmless: a store or a removal says what a block's state is, not by how much it changed.

llama-server has no KV events (and vLLM names no such routes for llama.cpp): this is llmkit's own, in vLLM's format.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Protocol

import msgpack
import zmq
from fastapi import APIRouter, Depends, Request

from llmkit.engine.kv_events import Event, EventBatch, Mirror, Subscription
from llmkit.server.state import ServingEngine, State

log = logging.getLogger("llmkit.server")
router = APIRouter()

MAX_EVENTS = 4096  # per batch: vllm-router rejects a batch of more (kv_index/decode.rs)
END_SEQ = -1  # the replay's last reply
POLL_MS = 100  # how often the threads look whether the publisher is closing


def encode(ts: float, events: list[Event]) -> bytes:
    """One batch's payload: msgpack ``[ts, events]`` (vLLM's EventBatch as an array), block names as bin."""
    return msgpack.packb([ts, events], use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def endpoint_of(value: str, host: str) -> str:
    """``--kv-events``'s value as a ZMQ endpoint: "" (a free port on ``host``), a port, or ``tcp://HOST:PORT``."""
    if not value:
        return f"tcp://{host}:*"
    if value.isdigit():
        return f"tcp://{host}:{value}"
    if not value.startswith("tcp://") or ":" not in value.removeprefix("tcp://"):
        raise ValueError(f"--kv-events wants a port or tcp://HOST:PORT, not {value!r}")
    return value


class EventSource(Protocol):
    """Where the batches come from: a reader of the engine's ``KVEventTracker`` (``Subscription``)."""

    block_size: int

    def next_batch(self, timeout: float | None = None) -> EventBatch | None: ...

    def close(self) -> None: ...


class KVPublisher:
    """Sends ``source``'s batches on ``endpoint`` (PUB) and answers replays on a free port of the same host (ROUTER),
    each from a thread of its own, until ``close()``."""

    def __init__(self, source: EventSource, endpoint: str, topic: str = ""):
        self.source, self.topic = source, topic.encode()
        self.seq = -1  # the last seq sent
        self.mirror = Mirror()
        self.lock = threading.Lock()  # seq and mirror: a replay answers from one seq's state
        self.closing = threading.Event()
        self.zmq = zmq.Context()
        self.pub, self.replay = self.zmq.socket(zmq.PUB), self.zmq.socket(zmq.ROUTER)
        for sock in (self.pub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            self.pub.bind(endpoint)
            self.replay.bind(endpoint.rsplit(":", 1)[0] + ":*")
        except zmq.ZMQError as exc:
            self.zmq.destroy(linger=0)
            raise ValueError(f"cannot publish KV events on {endpoint}: {exc}") from None
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        runs = (self.publish, self.serve_replays)
        self.threads = [threading.Thread(target=run, name=f"llmkit-kv-{run.__name__}", daemon=True) for run in runs]
        for thread in self.threads:
            thread.start()
        log.info("KV events on %s (replay %s), blocks of %d tokens", self.endpoint, self.replay_endpoint, source.block_size)

    def publish(self) -> None:
        """(Its thread.) Each batch the engine made, in order, ``MAX_EVENTS`` events at most per seq."""
        while not self.closing.is_set():
            batch = self.source.next_batch(timeout=POLL_MS / 1e3)
            if batch is None:
                continue
            for i in range(0, len(batch.events), MAX_EVENTS):
                events = batch.events[i : i + MAX_EVENTS]
                with self.lock:
                    self.seq += 1
                    self.mirror.apply(events)
                    self.pub.send_multipart([self.topic, seq_bytes(self.seq), encode(batch.ts, events)])

    def serve_replays(self) -> None:
        """(Its thread.) Answer each replay request: the state now, from the seq asked to the last one sent."""
        while not self.closing.is_set():
            if not self.replay.poll(POLL_MS):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a replay request of %d frames ignored", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in self.replayed(max(start, 0)):
                self.replay.send_multipart([identity, b"", self.topic, seq_bytes(seq), payload])
            self.replay.send_multipart([identity, b"", b"", seq_bytes(END_SEQ), b""])

    def replayed(self, start: int) -> list[tuple[int, bytes]]:
        """(seq, payload) from ``start`` to the last seq sent: the mirror's snapshot first, then empty batches."""
        with self.lock:
            last, events = self.seq, self.mirror.snapshot(self.source.block_size)
        if start > last:
            return []
        pieces = [events[i : i + MAX_EVENTS] for i in range(0, len(events), MAX_EVENTS)]
        if len(pieces) > last - start + 1:
            log.warning("KV events: %d batches cannot replay %d seqs; the subscriber starts afresh", len(pieces), last - start + 1)
            return []
        empty = encode(0.0, [])
        return [(start + i, encode(0.0, pieces[i]) if i < len(pieces) else empty) for i in range(last - start + 1)]

    def source_entry(self) -> dict[str, Any]:
        """This publisher, as ``/kv_event_sources`` lists it (vLLM's KVEventsConfig fields that vllm-router reads)."""
        return {
            "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.topic.decode(),
            "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
        }  # fmt: skip

    def close(self) -> None:
        self.closing.set()
        for thread in self.threads:
            thread.join()
        self.source.close()
        self.zmq.destroy(linger=0)


def start(engine: ServingEngine, endpoint: str | None) -> KVPublisher | None:
    """A publisher of ``engine``'s KV events on ``endpoint`` (None: the server publishes none)."""
    if endpoint is None:
        return None
    tracker = engine.kv_events
    if tracker is None:
        raise ValueError("--kv-events: this engine makes no KV events (EngineConfig(kv_events=True))")
    source: Subscription = tracker.subscribe()
    try:
        return KVPublisher(source, endpoint)
    except BaseException:
        source.close()
        raise


def publisher(request: Request) -> KVPublisher | None:
    """The app's publisher (``app.py`` starts it once the engine is ready; None: it publishes none): a route's dependency."""
    return request.app.state.kv_publisher


PublisherDep = Annotated[KVPublisher | None, Depends(publisher)]


@router.get("/get_server_info")
def server_info(state: State, publisher: PublisherDep) -> dict:
    """The cache's identity (the model file: replicas of one model share block names) and its block size (vLLM's
    route; vllm-router reads ``model_id`` and ``kv_block_size``). No ``instance_id``: the router then names this
    worker by its URL, which is unique in a fleet."""
    engine = state.engine
    info: dict[str, Any] = {"model_id": engine.model.path.name, "model_path": str(engine.model.path)}
    if publisher is not None:
        info["kv_block_size"] = publisher.source.block_size
    return info


@router.get("/kv_event_sources")
def kv_event_sources(publisher: PublisherDep) -> dict:
    """Where this server's KV events are, by data-parallel rank (one rank: "0"); {} when it publishes none."""
    return {"0": publisher.source_entry()} if publisher is not None else {}
