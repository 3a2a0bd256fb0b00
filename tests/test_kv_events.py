"""KV events on hand-made slots and a prompt cache (no model: milliseconds), read back as vllm-router reads them.

After every operation the engine's slots and prompt cache can undergo (a prompt read in chunks, decoding, slot
reuse, cache reuse moving chunks, a context shift, a rejected draft, the prompt cache saving, restoring and evicting
under its limit, a preemption), the events go through the wire encoding into ``RouterView``, a reference index
written from the router's rules (``helpers.RouterView``), and what it holds per tier
must be exactly what the slots and the cache hold, block by block. The publisher's wire (ZMQ frames, seq, replay)
is checked on loopback sockets. The same engine and server run on the real model in test_kv_routing.py.
"""

from __future__ import annotations

import random
import time
from typing import Any, cast

import pytest
import zmq

from llmkit.engine import kv_events
from llmkit.engine.kv_events import HOST, EventBatch, KVEventTracker
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.slot import Slot
from llmkit.server.kv_publisher import END_SEQ, KVPublisher, encode

from helpers import RouterView, block_prefixes

BS = 4  # a small block size: every test crosses many block boundaries


class FakeContext:
    """What Slot and PromptCache ask of llmkit.llama.Context; a sequence's state is as long as its tokens."""

    def __init__(self, slots: list[Slot], bytes_per_token: int):
        self.slots, self.bytes_per_token = slots, bytes_per_token

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return True

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        pass

    def seq_state(self, seq_id: int) -> bytearray:
        return bytearray(len(self.slots[seq_id].cache_tokens) * self.bytes_per_token)

    def set_seq_state(self, seq_id: int, data: bytearray) -> bool:
        return True


class World:
    """Slots, a prompt cache, the tracker and a router's view of it: ``step()`` is the end of an engine step."""

    def __init__(self, n_slots: int = 3, cache_mib: int = 0, bytes_per_token: int = 1000, shares: bool = False):
        self.slots = [Slot(i, 4096) for i in range(n_slots)]
        self.ctx = FakeContext(self.slots, bytes_per_token)  # the prompt cache's limits count bytes
        self.cache = PromptCache(cache_mib, limit_tokens=0) if cache_mib else None
        self.tracker, self.view = KVEventTracker(BS, shares=shares), RouterView(BS)

    def step(self) -> int:
        """The events of this step, read by the view, which must hold what the slots and the cache hold. Returns how many."""
        events = self.tracker.update(self.slots, self.cache)
        before = self.view.n_events
        if events:
            self.view.read(encode(time.time(), events))
        cached = [e.tokens for e in self.cache.entries] if self.cache else []
        takeable = [s.cache_tokens for s in self.slots if s.is_idle or self.tracker.shares]  # cells another request could take
        assert self.view.prefixes(None) == block_prefixes(BS, takeable), "the slots"
        assert self.view.prefixes(HOST) == block_prefixes(BS, cached), "the prompt cache"
        return self.view.n_events - before

    def read(self, slot: Slot, prompt: list[int], *, chunk: int = 5, cache_reuse: int | None = None) -> None:
        """What Engine.launch then the prompt's steps do: keep what the slot holds of ``prompt``, read the rest in chunks."""
        n_keep, _ = slot.reuse(self.ctx, prompt, True, cache_reuse)  # type: ignore[arg-type]
        for start in range(n_keep, len(prompt), chunk):
            slot.append(prompt[start : start + chunk])
            self.step()

    def save(self, slot: Slot) -> None:
        assert self.cache is not None
        if slot.save_prompt(self.cache, self.ctx):  # type: ignore[arg-type]
            self.cache.update()


SYSTEM = list(range(1000, 1030))  # a tenant's system prompt: 30 tokens, 7 complete blocks of 4 and 2 more tokens


def test_a_prompt_read_in_chunks_then_decoded_is_told_block_by_block_and_only_complete_blocks():
    w = World()
    w.read(w.slots[0], [*SYSTEM, 1, 2, 3])
    assert len(w.view.held[None]) == 33 // BS
    told = []
    for token in range(7):  # decoding: one event when a token completes a block, none otherwise
        w.slots[0].append([token])
        told.append(w.step())
    assert told == [0, 0, 1, 0, 0, 0, 1]  # 33 tokens: the 3rd completes the 9th block (36), the 7th the 10th (40)


def test_a_prefix_two_slots_hold_is_stored_once_and_removed_with_its_last_holder():
    w = World()
    w.read(w.slots[0], SYSTEM + [1] * 8)
    w.read(w.slots[1], SYSTEM + [2] * 8)
    assert len(w.view.held[None]) == 7 + 2 + 2  # the shared blocks once, each slot's own after them
    w.slots[0].clear_prompt(w.ctx)  # type: ignore[arg-type]
    w.step()  # checks that slot 1 still has the shared blocks
    assert len(w.view.held[None]) == 7 + 2
    w.slots[1].clear_prompt(w.ctx)  # type: ignore[arg-type]
    w.step()
    assert not w.view.held[None]


@pytest.mark.parametrize("shares", [False, True])
def test_a_running_requests_blocks_are_on_the_device_tier_only_where_another_request_could_take_them(shares):
    # Without kv_share a slot's cells are its request's while it runs (llama-server's per-slot cache): removed from the
    # device tier when it starts, stored again when it ends. With kv_share any slot's cells can be taken: they stay.
    w = World(shares=shares)
    w.read(w.slots[0], SYSTEM)
    held = len(w.view.held[None])
    w.slots[0].job = cast(Any, "a running request")
    w.slots[0].append([1, 2])
    w.step()
    assert len(w.view.held[None]) == (held + 1 if shares else 0)
    w.slots[0].job = None
    w.step()
    assert len(w.view.held[None]) == held + 1


def test_slot_reuse_keeps_the_common_prefix_and_tells_only_the_blocks_that_changed():
    w = World()
    w.read(w.slots[0], SYSTEM + list(range(40)))
    w.read(w.slots[0], SYSTEM + list(range(100, 140)))  # the next conversation of the tenant: the system prompt stays
    assert w.view.prefixes(None) >= block_prefixes(BS, [SYSTEM])


def test_a_slot_that_moves_to_another_slot_is_told_nothing():
    w = World()
    w.read(w.slots[0], SYSTEM)
    w.slots[1].append(SYSTEM)
    w.slots[0].clear_prompt(w.ctx)  # type: ignore[arg-type]
    assert w.step() == 0  # the same blocks, held by another slot: the router's claims do not change


def test_cache_reuse_moves_chunks_their_blocks_change_names():
    w = World()
    old = SYSTEM + list(range(200, 232)) + list(range(300, 332))
    w.read(w.slots[0], old)
    edited = SYSTEM + list(range(200, 210)) + list(range(300, 332))  # a message cut short: the next one moves back
    n_keep, n_moved = w.slots[0].reuse(w.ctx, edited, True, 8)  # type: ignore[arg-type]
    assert n_moved == 32 and w.slots[0].cache_tokens == edited[:-1]  # the last token is read again (its logits are sampled)
    w.step()
    w.slots[0].append(edited[n_keep:])
    w.step()


def test_a_context_shift_drops_the_middle_and_renames_what_follows():
    w = World()
    slot = w.slots[0]
    slot.n_ctx = 64
    w.read(slot, SYSTEM + list(range(34)))
    slot.shift_context(w.ctx, n_keep=10)  # type: ignore[arg-type]
    w.step()
    assert slot.n_past < 64


def test_a_rejected_draft_leaves_the_blocks_it_had_completed():
    w = World()
    slot = w.slots[0]
    w.read(slot, SYSTEM)
    slot.append([7, 8, 9, 10, 11, 12])  # a token and its draft: two blocks complete
    w.step()
    slot.truncate(w.ctx, 31)  # type: ignore[arg-type]  # only the sampled token was kept
    w.step()
    slot.append([5])
    w.step()


def test_the_prompt_cache_is_the_host_tier_saved_restored_and_evicted_under_its_limit():
    w = World(cache_mib=1)  # 1 MiB: about a thousand tokens of this fake state
    w.read(w.slots[0], SYSTEM + list(range(500)), chunk=128)
    w.save(w.slots[0])
    w.step()
    assert len(w.view.held[HOST]) == 530 // BS and len(w.view.held[None]) == 530 // BS  # both tiers hold it
    w.slots[0].clear_prompt(w.ctx)  # type: ignore[arg-type]  # a unified KV cache frees an idle slot once it is saved
    w.step()
    w.slots[1].load_prompt(w.cache, w.ctx, SYSTEM + list(range(500)) + [9])  # type: ignore[arg-type]  # restored into another slot
    assert w.step() > 0 and w.cache is not None and not w.cache.entries  # the entry moved back to the device tier
    for tenant in range(3):  # three more prompts of 500 tokens: the limit keeps about two
        w.read(w.slots[2], [tenant] * 500, chunk=128)
        w.save(w.slots[2])
        w.step()
    assert w.cache.evictions >= 1


def test_a_preempted_job_goes_to_the_prompt_cache_and_comes_back_on_another_slot():
    w = World(cache_mib=8)
    w.read(w.slots[0], SYSTEM + list(range(60)))
    w.save(w.slots[0])  # Engine.preempt: the slot's KV to the prompt cache, the job waits
    w.read(w.slots[0], list(range(900, 960)))  # the request that preempted it takes the slot
    w.slots[1].load_prompt(w.cache, w.ctx, SYSTEM + list(range(60)))  # type: ignore[arg-type]  # the job goes on elsewhere
    w.step()
    assert w.slots[1].cache_tokens == SYSTEM + list(range(60))


@pytest.mark.parametrize("seed", range(4))
def test_any_sequence_of_operations_keeps_the_router_exactly_in_step(seed):
    """Random operations (several per step, as one engine step can reuse, save, restore and append), over prompts
    that share prefixes: after every step the view equals the slots and the cache, and no store is ever skipped."""
    rng, w = random.Random(seed), World(n_slots=3, cache_mib=1, bytes_per_token=10_000)  # the cache holds ~100 tokens
    assert w.cache is not None
    tenants = [list(range(t * 100, t * 100 + rng.randint(10, 40))) for t in range(3)]

    def prompt() -> list[int]:
        return rng.choice(tenants) + [rng.randint(0, 5) for _ in range(rng.randint(0, 30))]

    for _ in range(300):
        for _ in range(rng.randint(1, 3)):
            slot = rng.choice(w.slots)
            op = rng.randrange(7)
            if op == 0:
                tokens = prompt()
                n_keep, _ = slot.reuse(w.ctx, tokens, True, rng.choice([None, 3]))  # type: ignore[arg-type]
                slot.append(tokens[n_keep:])
            elif op == 1:
                slot.append([rng.randint(0, 5) for _ in range(rng.randint(1, 6))])
            elif op == 2 and slot.n_past:
                slot.truncate(w.ctx, rng.randint(0, slot.n_past))  # type: ignore[arg-type]
            elif op == 3 and slot.n_past > 8:
                slot.n_ctx = slot.n_past
                slot.shift_context(w.ctx, rng.randint(0, 8))  # type: ignore[arg-type]
                slot.n_ctx = 4096
            elif op == 4:
                w.save(slot)
            elif op == 5:
                slot.load_prompt(w.cache, w.ctx, prompt())  # type: ignore[arg-type]
                w.cache.update()
            else:
                slot.clear_prompt(w.ctx)  # type: ignore[arg-type]
        w.step()
    assert w.view.n_events > 100 and w.cache.evictions > 0 and w.cache.hits > 0


def test_a_decode_step_hashes_only_the_block_it_completes(monkeypatch):
    slot, tracker = Slot(0, 8192), KVEventTracker(BS)
    slot.append(list(range(8190)))  # a long context: 2,047 blocks and 2 tokens
    tracker.update([slot], None)
    hashed = []

    def counting(*args):
        names = block_names(*args)
        hashed.append(len(names))
        return names

    block_names = kv_events.block_names
    monkeypatch.setattr(kv_events, "block_names", counting)
    for token in range(4):
        slot.append([token])
        tracker.update([slot], None)
    assert hashed == [0, 1, 0, 0]  # the 8,192nd token completes block 2,047: one block hashed, never the context


# --- readers: each gets every batch, and one that falls behind gets the state, never unbounded memory ----------------


def test_every_reader_gets_every_batch_and_one_that_falls_behind_gets_what_is_held_instead():
    w = World(n_slots=2, cache_mib=8)
    publisher, analysis, idle = w.tracker.subscribe(), w.tracker.subscribe(), w.tracker.subscribe(max_batches=3)
    rng, views = random.Random(7), {"publisher": RouterView(BS), "analysis": RouterView(BS), "idle": RouterView(BS)}
    for turn in range(40):
        slot = w.slots[turn % 2]
        if turn % 9 == 8:
            w.save(slot)
        load(w, slot, [rng.randrange(50) for _ in range(rng.randrange(3, 30))])
        w.tracker.collect(w.slots, w.cache)
        for name, reader in (("publisher", publisher), ("analysis", analysis)):  # two readers that keep up ...
            while (batch := reader.next_batch(timeout=0)) is not None:
                views[name].read(encode(batch.ts, batch.events))
        assert len(idle.batches) <= 3  # ... and one that reads nothing, kept to its bound
    while (batch := idle.next_batch(timeout=0)) is not None:
        views["idle"].read(encode(batch.ts, batch.events))
    held = block_prefixes(BS, [s.cache_tokens for s in w.slots]), block_prefixes(BS, [e.tokens for e in w.cache.entries])
    for name, view in views.items():  # every reader, behind or not, ends knowing exactly what is held
        assert (view.prefixes(None), view.prefixes(HOST)) == held, name
    assert publisher.n_resyncs == analysis.n_resyncs == 0 and idle.n_resyncs > 0
    assert views["publisher"].n_events == views["analysis"].n_events > views["idle"].n_events  # neither took the other's


def test_a_reader_that_joins_late_starts_from_what_is_held_and_one_that_leaves_gets_nothing_more():
    w = World(n_slots=2)
    load(w, w.slots[0], list(range(21)))
    w.tracker.collect(w.slots, w.cache)
    late, view = w.tracker.subscribe(), RouterView(BS)
    batch = late.next_batch(timeout=0)
    assert batch is not None and batch.events[0] == {"type": "AllBlocksCleared"}
    view.read(encode(batch.ts, batch.events))
    assert view.prefixes(None) == block_prefixes(BS, [s.cache_tokens for s in w.slots])
    late.close()
    load(w, w.slots[1], list(range(30, 50)))
    w.tracker.collect(w.slots, w.cache)
    assert late.next_batch(timeout=0) is None and not w.tracker.readers


# --- the wire: ZMQ frames, seq, replay (loopback sockets) -----------------------------------------------------


class HandFed:
    """An event source the test feeds (the engine's tracker has the same two members)."""

    block_size = BS

    def __init__(self, tracker: KVEventTracker):
        self.tracker = tracker
        self.queue: list[EventBatch] = []

    def next_batch(self, timeout: float | None = None) -> EventBatch | None:
        if self.queue:
            return self.queue.pop(0)
        time.sleep(timeout or 0)
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def wire():
    w = World(n_slots=2, cache_mib=8)
    source = HandFed(w.tracker)
    publisher = KVPublisher(source, "tcp://127.0.0.1:*")
    sub = publisher.zmq.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(publisher.endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: a subscription needs a moment to reach the publisher
    yield w, source, publisher, sub
    sub.close(linger=0)
    publisher.close()


def feed(w: World, source: HandFed) -> None:
    events = w.tracker.update(w.slots, w.cache)
    if events:
        source.queue.append(EventBatch(time.time(), events))


def replay(publisher: KVPublisher, start: int) -> list[list[bytes]]:
    dealer = publisher.zmq.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
    replies = []
    while (frames := dealer.recv_multipart())[2] != END_SEQ.to_bytes(8, "big", signed=True):
        replies.append(frames)
    dealer.close(linger=0)
    assert frames == [b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""]
    return replies


def load(w: World, slot: Slot, tokens: list[int]) -> None:
    n_keep, _ = slot.reuse(w.ctx, tokens, True, None)  # type: ignore[arg-type]
    slot.append(tokens[n_keep:])


def test_batches_go_out_as_three_frames_with_seq_counting_from_zero(wire):
    w, source, publisher, sub = wire
    view = RouterView(BS)
    for i, tokens in enumerate((SYSTEM, SYSTEM + [1] * 9)):
        load(w, w.slots[0], tokens)
        feed(w, source)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and seq == i.to_bytes(8, "big", signed=True)
        view.read(payload)
    assert view.prefixes(None) == block_prefixes(BS, [w.slots[0].cache_tokens])
    feed(w, source)  # nothing changed: no batch
    assert publisher.seq == 1


def test_a_replay_from_any_seq_gives_what_is_held_now(wire):
    w, source, publisher, sub = wire
    for tokens in (SYSTEM + [1] * 9, SYSTEM + [2] * 9, list(range(50))):
        load(w, w.slots[0], tokens)
        w.save(w.slots[0])
        feed(w, source)
        sub.recv_multipart()
    assert publisher.seq == 2
    for start in (0, 2):  # a router that joined late (it asks from 0), one that missed the last batch
        replies = replay(publisher, start)
        assert [int.from_bytes(f[2], "big", signed=True) for f in replies] == list(range(start, 3))
        assert all(len(f) == 4 and f[0] == b"" and f[1] == b"" for f in replies)
        view = RouterView(BS)
        for frames in replies:
            view.read(frames[3])
        assert view.prefixes(None) == block_prefixes(BS, [w.slots[0].cache_tokens])
        assert w.cache is not None and view.prefixes(HOST) == block_prefixes(BS, [e.tokens for e in w.cache.entries])
    assert replay(publisher, 3) == []  # nothing missed: only the end
