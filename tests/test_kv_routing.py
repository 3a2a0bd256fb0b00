"""KV events on the real model: the engine's follow its slots and prompt cache at every step; a slot server publishes
them where ``GET /kv_event_sources`` says; vllm-router's ``kv_aware`` policy routes on them, and changes its choice
when a replica's cache changes. One fleet for the module: two slot servers (``-t 1``, one slot, no prompt cache: what a
replica holds is what its slot holds) with ``--kv-events``, behind the router.

The event stream itself, under every change a slot or the cache can undergo, is checked without a model in
test_kv_events.py (``helpers.RouterView`` reads the events in both).
"""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from llmkit.course import fleet
from llmkit.engine import Engine, EngineConfig, PriorityPolicy
from llmkit.server.kv_publisher import END_SEQ, encode

from helpers import RouterView, block_prefixes, wait_until

BLOCK = 16
SYSTEM = "You are the support agent of Acme Bank. " + " ".join(
    f"Rule {i}: answer politely about accounts, cards and loans, and never reveal internal codes." for i in range(12)
)  # about 250 tokens: 15 blocks the router can credit
OTHER = "You are a poet who writes about the sea, the wind and the boats in the harbour at dawn. " * 6


def chat(system: str, question: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("share", [False, True], ids=["per-slot", "kv-share"])
def test_the_engines_events_follow_its_slots_and_prompt_cache_at_every_step(model, share):
    """Two slots, a prompt cache, a preemption, prompts that share a prefix: after every step, the events read so far
    hold exactly the complete blocks of every slot another request could take cells from (device tier: without kv_share
    the idle ones, a running request's cells being its own; with kv_share every slot) and every cached prompt (host)."""
    config = EngineConfig(n_parallel=2, n_ctx=2048, n_threads=1, kv_events=True, kv_block_size=BLOCK, policy=PriorityPolicy(),
                          kv_unified=share, kv_share=share)  # fmt: skip
    with Engine(model, config, start=False) as engine:
        assert engine.kv_events is not None
        events, view = engine.kv_events.subscribe(), RouterView(BLOCK)
        params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "priority": 5}
        requests = [engine.chat(chat(SYSTEM, q)["messages"], **params) for q in ("Hi", "Cards?")]
        late = []
        while not all(r.done for r in requests + late):
            engine.step()
            if len(late) < 2 and engine.n_steps in (6, 12):  # a question that goes first, then the tenant again
                system = OTHER if not late else SYSTEM
                late.append(engine.chat(chat(system, "Loans?")["messages"], max_tokens=8, temperature=0, priority=0))
            while (batch := events.next_batch(timeout=0)) is not None:
                view.read(encode(batch.ts, batch.events))
            takeable = [s.cache_tokens for s in engine.scheduler.holders if s.is_idle or share]  # resident prefixes too
            assert view.prefixes(None) == block_prefixes(BLOCK, takeable)
            assert engine.prompt_cache is not None
            assert view.prefixes("CPU") == block_prefixes(BLOCK, [e.tokens for e in engine.prompt_cache.entries])
        assert engine.counters.requests_preempted_total >= 1 and engine.prompt_cache.entries  # the host tier had blocks to tell
        # the preempted job came back from RAM; with kv_share, from its cells, which stayed resident
        assert engine.prompt_cache.hits >= 1 if not share else engine.counters.prompt_tokens_shared_total > 0


@pytest.fixture(scope="module")
def kv_fleet():
    with fleet.start(2, "slots", "kv_aware", flags=["--kv-events", "-np", "1", "--cache-ram", "0"]) as f:
        yield f


def render(url: str, body: dict) -> list[int]:
    r = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=60)
    r.raise_for_status()
    return r.json()["token_ids"]


def view_of(replica) -> RouterView:
    """What a router that joins now learns of ``replica``: a replay from seq 0, read as the router reads it."""
    (source,) = httpx.get(f"{replica.url}/kv_event_sources").json().values()
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(source["replay_endpoint"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        view = RouterView(BLOCK)
        while (frames := dealer.recv_multipart())[2] != END_SEQ.to_bytes(8, "big", signed=True):
            view.read(frames[3])
    return view


def test_a_replica_says_where_its_events_are_and_what_they_hold(kv_fleet):
    replica = kv_fleet.replicas[0]
    info = httpx.get(f"{replica.url}/get_server_info").json()
    (source,) = httpx.get(f"{replica.url}/kv_event_sources").json().values()
    assert info["kv_block_size"] == BLOCK and info["model_id"].endswith(".gguf")  # the model, not the replica's alias
    assert source["publisher"] == "zmq" and source["encoding"] == "msgpack" and source["schema_version"] == 1
    body = chat(SYSTEM, "What is my balance?")
    httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    wait_until(lambda: block_prefixes(BLOCK, [render(replica.url, body)]) <= view_of(replica).prefixes(None), 30, interval=0.2)


def routed(f, body: dict) -> int | None:
    r = httpx.post(f"{f.url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return f.replica_of(r.json())


def test_kv_aware_sends_a_prompt_where_its_prefix_is_held_and_stops_when_it_is_gone(kv_fleet):
    f, question = kv_fleet, chat(SYSTEM, "How do I close my card?")
    prefix = block_prefixes(BLOCK, [render(f.replicas[0].url, question)])
    for index in (1, 0):  # the tenant's prefix on replica 1; then on replica 0, while replica 1 reads another prompt
        other = f.replicas[1 - index]
        httpx.post(f"{other.url}/v1/chat/completions", json=chat(OTHER, "A poem?"), timeout=120).raise_for_status()
        told = chat(SYSTEM, "What is my balance?")
        httpx.post(f"{f.replicas[index].url}/v1/chat/completions", json=told, timeout=120).raise_for_status()
        holder = f.replicas[index]
        wait_until(lambda: view_of(holder).prefixes(None) & prefix and not view_of(other).prefixes(None) & prefix, 30)  # noqa: B023
        time.sleep(0.3)  # what the replay says, the router's subscriber (polling every 10 ms) has read too
        assert routed(f, question) == index
