"""KV events: what the slots' KV cache and the host-RAM prompt cache hold, told as blocks to a router.

A router that sends a request to the replica already holding its prompt's prefix saves that replica the prompt's
reading. vLLM's engines tell the router what they hold with KV events (vLLM's ``kv_events.py``: ``BlockStored``,
``BlockRemoved``); vllm-router's ``kv_aware`` policy reads them (``llmkit.server.kv_publisher`` publishes them over
ZMQ). llama-server has no KV events: this is llmkit's own, in vLLM's format.

    tracker = KVEventTracker(block_size=16)
    tracker.update(engine.slots, engine.prompt_cache)   # the events since the last call: dicts, vLLM's wire schema
    events = tracker.subscribe()                        # a reader: the publisher, or your own analysis
    tracker.collect(engine.slots, engine.prompt_cache)  # update, handed as one batch to every reader (each step's end)
    events.next_batch(timeout=1.0)                      # each reader takes every batch, in order

Every reader gets every batch (the publisher does not take them from your analysis, nor yours from it), and a reader
never costs unbounded memory: one that falls ``max_batches`` behind (a notebook that subscribed and stopped reading)
loses them and gets, instead, one batch that clears its view and stores every block held now (what the publisher's
replay sends a router that joins late).

What a block is: ``block_size`` tokens of a sequence, at a multiple of ``block_size``; only complete blocks are told
(the router matches a prompt block by block). Block ``i`` is named ``sha256(name(i - 1) + its tokens as uint32 LE)``:
a name stands for the whole prefix up to the end of its block, so two slots, two replicas, or a slot and a cached
prompt that hold the same prefix hold the same names (the router keys its tree by its own hash of each block's tokens;
our names tie a block to its parent, ``parent_block_hash``, and find it again on removal).

What the device tier tells is what another request could take now, not every cell in memory: without ``kv_share`` a
running request's cells are its own (llama-server's per-slot cache), so a slot's blocks leave the device tier when a
request starts on it and come back when it ends; with ``kv_share`` any slot's cells can be taken, busy or idle.

Two tiers, each told apart by its ``medium``: the slots' KV cache (the device tier: ``None``, vLLM writes "GPU") and the
prompt cache (the host tier: "CPU", credited by the router at a discount). The router's claim on a block is one per
(worker, tier, block): so a block held by several slots, or several cached prompts, is counted here, stored when its
count goes 0 -> 1 and removed at 1 -> 0. In one update every new holding is counted before any old one is dropped, so
a block that only moves (to another slot, or within one) is told nothing, and every store comes before the removals.

What it costs per step: a slot tells where its tokens first changed since the last look (``Slot.take_changes``), so a
step that decodes one token per slot hashes at most one block per slot (when the token completes it); a cached prompt
is hashed once, when it enters the cache.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from llmkit.engine.prompt_cache import CachedPrompt, PromptCache
    from llmkit.engine.slot import Slot

DEVICE: str | None = None  # the slots' KV cache (the router's device tier)
HOST = "CPU"  # the host-RAM prompt cache (the router's host tier)
DEFAULT_BLOCK_SIZE = 16  # vLLM's and vllm-router's default
MAX_RUN = 4096  # blocks in one BlockStored of a snapshot (vllm-router takes at most 4,096 events a batch, as many blocks)

Event = dict[str, Any]  # one event, as vLLM's msgpack encoder writes it: a map with its "type"


class EventBatch(NamedTuple):
    ts: float  # Unix time of the step that made it
    events: list[Event]


def block_names(tokens: Sequence[int], block_size: int, first: int, parent: bytes | None) -> list[bytes]:
    """The names of the complete blocks of ``tokens`` from block ``first`` on, chained from ``parent`` (block ``first - 1``'s)."""
    names, name = [], parent or b""
    pack = struct.Struct(f"<{block_size}I").pack
    for start in range(first * block_size, len(tokens) - block_size + 1, block_size):
        name = hashlib.sha256(name + pack(*tokens[start : start + block_size])).digest()
        names.append(name)
    return names


class Tier:
    """One tier's blocks, counted by holder; the events of the counts that cross zero."""

    def __init__(self, medium: str | None, block_size: int):
        self.medium, self.block_size = medium, block_size
        self.counts: dict[bytes, int] = {}

    def hold(self, names: list[bytes], tokens: Sequence[int], first: int, parent: bytes | None, events: list[Event]) -> None:
        """A holder now holds ``names``, blocks ``first``... of ``tokens`` (``parent``: block ``first - 1``'s name): each
        run of blocks new to the tier is one ``BlockStored`` (vLLM: one event per chain)."""
        run: list[int] = []  # indices into names of the current run of new blocks
        for i, name in enumerate(names):
            count = self.counts.get(name, 0)
            self.counts[name] = count + 1
            if count == 0:
                if run and run[-1] != i - 1:
                    events.append(self.stored(names, tokens, first, parent, run))
                    run = []
                run.append(i)
        if run:
            events.append(self.stored(names, tokens, first, parent, run))

    def stored(self, names: list[bytes], tokens: Sequence[int], first: int, parent: bytes | None, run: list[int]) -> Event:
        size, i, j = self.block_size, run[0], run[-1] + 1
        return {
            "type": "BlockStored", "block_hashes": names[i:j], "parent_block_hash": names[i - 1] if i else parent,
            "token_ids": list(tokens[(first + i) * size : (first + j) * size]), "block_size": size,
            "lora_id": None, "medium": self.medium, "lora_name": None,
        }  # fmt: skip

    def release(self, names: list[bytes], removed: list[bytes]) -> None:
        """A holder no longer holds ``names``: those it was the last to hold join ``removed``."""
        for name in names:
            count = self.counts[name] - 1
            if count:
                self.counts[name] = count
            else:
                del self.counts[name]
                removed.append(name)

    def removed(self, names: list[bytes]) -> list[Event]:
        return [{"type": "BlockRemoved", "block_hashes": names, "medium": self.medium}] if names else []


class Change(NamedTuple):
    """One holder's change: it now holds ``new`` from block ``first`` on, instead of ``old``."""

    tier: Tier
    tokens: Sequence[int]
    first: int
    parent: bytes | None
    old: list[bytes]
    new: list[bytes]


class KVEventTracker:
    """What the slots and the prompt cache held when it last looked, as block names; ``update`` tells what changed."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, *, shares: bool = False):
        if block_size < 1:
            raise ValueError(f"the KV event block size must be at least 1, not {block_size}")
        self.block_size = block_size
        self.shares = shares  # kv_share: a running request's cells can be taken by another (else only an idle slot's)
        self.shown: dict[int, bool] = {}  # by slot id: whether its blocks were on the device tier when it last looked
        self.device, self.host = Tier(DEVICE, block_size), Tier(HOST, block_size)
        self.slot_names: dict[int, list[bytes]] = {}  # by slot id: the names of its complete blocks
        self.entry_names: dict[int, tuple[CachedPrompt, list[bytes]]] = {}  # by id(entry); the entry kept so its id stays its own
        self.told = Mirror()  # what every batch so far adds up to: what a reader that fell behind is sent instead
        self.readers: list[Subscription] = []
        self._lock = threading.Lock()  # readers and told: subscribing happens on other threads than collecting

    def update(self, slots: Sequence[Slot], cache: PromptCache | None) -> list[Event]:
        """The events that bring a reader from what was told to what the slots and ``cache`` hold now: every store,
        then every removal (each holder's new blocks are counted before any holder's old ones are dropped)."""
        changes = [change for slot in slots if (change := self.slot_change(slot)) is not None] + self.cache_changes(cache)
        events: list[Event] = []
        for c in changes:
            c.tier.hold(c.new, c.tokens, c.first, c.parent, events)
        removed: dict[Tier, list[bytes]] = {self.device: [], self.host: []}
        for c in changes:
            c.tier.release(c.old, removed[c.tier])
        return events + self.device.removed(removed[self.device]) + self.host.removed(removed[self.host])

    def slot_change(self, slot: Slot) -> Change | None:
        """What changed in ``slot`` since the last look: its blocks from the first one whose tokens changed. The device
        tier holds exactly the cells another request could take now: an idle slot's, and with ``shares`` a busy one's
        too (without, a running request's cells are its own: told removed when it starts, stored again when it ends)."""
        changed, shown = slot.take_changes(), self.shares or slot.is_idle
        if shown != self.shown.setdefault(slot.id, True):
            changed, self.shown[slot.id] = 0, shown
        if changed is None:
            return None
        tokens = slot.cache_tokens if shown else []
        names = self.slot_names.setdefault(slot.id, [])
        first = min(changed // self.block_size, len(names))
        parent = names[first - 1] if first else None
        old, new = names[first:], block_names(tokens, self.block_size, first, parent)
        names[first:] = new
        same = 0  # blocks rewritten with the same tokens (a draft cut back into a block, then the same tokens again)
        while same < min(len(old), len(new)) and old[same] == new[same]:
            same += 1
        if same == len(old) == len(new):
            return None
        parent = new[same - 1] if same else parent
        return Change(self.device, tokens, first + same, parent, old[same:], new[same:])

    def cache_changes(self, cache: PromptCache | None) -> list[Change]:
        """The prompts that entered ``cache`` since the last look (all their blocks) and those that left it."""
        entries = {id(entry): entry for entry in (cache.entries if cache is not None else [])}
        changes = [Change(self.host, [], 0, None, names, []) for key, (_, names) in self.entry_names.items() if key not in entries]
        for key in [key for key in self.entry_names if key not in entries]:
            del self.entry_names[key]
        for key, entry in entries.items():
            if key not in self.entry_names:
                names = block_names(entry.tokens, self.block_size, 0, None)
                self.entry_names[key] = (entry, names)
                changes.append(Change(self.host, entry.tokens, 0, None, [], names))
        return changes

    def collect(self, slots: Sequence[Slot], cache: PromptCache | None) -> None:
        """``update``, handed to every reader as one batch if anything changed (the engine, at the end of each step)."""
        events = self.update(slots, cache)
        if not events:
            return
        batch = EventBatch(time.time(), events)
        with self._lock:
            self.told.apply(events)
            for reader in self.readers:
                reader.put(batch, self.told)

    def subscribe(self, max_batches: int = 1024) -> Subscription:
        """A new reader of every batch from now on (``close()`` it when done). From a state already told, it starts
        with a batch that stores every block held now."""
        with self._lock:
            reader = Subscription(self, max_batches)
            if self.told.tiers:
                reader.put(EventBatch(time.time(), self.told.snapshot(self.block_size)), self.told)
            self.readers.append(reader)
            return reader

    def unsubscribe(self, reader: Subscription) -> None:
        with self._lock:
            if reader in self.readers:
                self.readers.remove(reader)


class Subscription:
    """One reader's batches, in order, at most ``max_batches`` of them: a reader that falls further behind gets, in
    place of what it missed, one batch that clears its view and stores every block held (``Mirror.snapshot``)."""

    def __init__(self, tracker: KVEventTracker, max_batches: int):
        if max_batches < 1:
            raise ValueError(f"a reader keeps at least one batch, not {max_batches}")
        self.tracker, self.block_size, self.max_batches = tracker, tracker.block_size, max_batches
        self.batches: deque[EventBatch] = deque()
        self.n_resyncs = 0  # how often it fell behind and was sent the whole state instead
        self._ready = threading.Condition()

    def put(self, batch: EventBatch, told: Mirror) -> None:
        """(The tracker, under its lock.) ``batch``; or, if this reader is full, everything ``told`` holds."""
        with self._ready:
            if len(self.batches) >= self.max_batches:
                self.batches.clear()
                self.batches.append(EventBatch(batch.ts, told.snapshot(self.block_size)))
                self.n_resyncs += 1
            else:
                self.batches.append(batch)
            self._ready.notify()

    def next_batch(self, timeout: float | None = None) -> EventBatch | None:
        """The oldest batch not yet read, waiting up to ``timeout`` seconds for one (None: none came)."""
        with self._ready:
            if not self._ready.wait_for(lambda: self.batches, timeout):
                return None
            return self.batches.popleft()

    def close(self) -> None:
        self.tracker.unsubscribe(self)


class Mirror:
    """What a reader that read every batch holds: by tier (``medium``), block name -> (parent, tokens), in the order
    they were stored (a parent always before its children: a holder of a block holds its whole prefix)."""

    def __init__(self) -> None:
        self.tiers: dict[str | None, dict[bytes, tuple[bytes | None, list[int]]]] = {}

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if event["type"] == "AllBlocksCleared":
                self.tiers.clear()
                continue
            blocks = self.tiers.setdefault(event["medium"], {})
            if event["type"] == "BlockRemoved":
                for name in event["block_hashes"]:
                    blocks.pop(name, None)
                continue
            parent, size, tokens = event["parent_block_hash"], event["block_size"], event["token_ids"]
            for i, name in enumerate(event["block_hashes"]):
                blocks[name] = (parent, tokens[i * size : (i + 1) * size])
                parent = name

    def snapshot(self, block_size: int, max_run: int = MAX_RUN) -> list[Event]:
        """Every block held, as the events that store it after clearing the rest: one ``BlockStored`` per chain run
        (of at most ``max_run`` blocks)."""
        events: list[Event] = [{"type": "AllBlocksCleared"}]
        for medium, blocks in self.tiers.items():
            last: Event | None = None
            for name, (parent, tokens) in blocks.items():
                if last is not None and last["block_hashes"][-1] == parent and len(last["block_hashes"]) < max_run:
                    last["block_hashes"].append(name)
                    last["token_ids"].extend(tokens)
                    continue
                last = {
                    "type": "BlockStored", "block_hashes": [name], "parent_block_hash": parent, "token_ids": list(tokens),
                    "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
                }  # fmt: skip
                events.append(last)
        return events
