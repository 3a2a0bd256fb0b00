"""vllm-router's policies, as the model routes: each keeps the rule of the router's own code (vllm-router 0.1.17,
``src/policies/``), and only that.

- ``round_robin`` (``round_robin.rs``): a counter modulo the replicas.
- ``power_of_two`` (``power_of_two.rs``): two distinct replicas at random, the one with fewer requests in flight
  (the router's own counters: llmkit serves no ``/get_load``); a tie goes to the first drawn.
- ``consistent_hash`` (``consistent_hash.rs``, ``hash_key.rs``): the ``x-session-id`` header (the trace sends one per
  conversation) on a ring of 160 virtual nodes per replica. Simplified: blake2b for the router's MurmurHash64A/furc
  hash (another hash, the same stickiness and spread).
- ``cache_aware`` (``cache_aware.rs``, ``tree.rs``): one radix tree of the token ids the router *sent* to each replica
  (the worker renders them: llmkit's ``/v1/chat/completions/render``). Match rate = the longest prefix sent to a
  replica / the prompt's tokens. If the loads are balanced and the best rate > 0.3, the least loaded of the replicas
  with the best rate; else the least loaded of all (ties: the first). Imbalanced = max - min > 64 and max > 1.5 min.
  The prompt then enters the tree under the chosen replica. Simplified: no eviction (the router trims each replica's
  share to 2^25 characters, ~4 M tokens, every 120 s: more than these traces send). With the default thresholds a
  tenant's users stay on the replicas that hold its prefix until one has 64 more requests in flight than another: a
  4-slot replica drowns long before (a subclass with ``BALANCE_ABS = 4`` is ``--balance-abs-threshold 4``).
- ``kv_aware`` (``kv_aware.rs``): what each replica's KV events say it holds (``HeldBlocks``: its slots, the device
  tier, and its prompt cache, the host tier, in blocks of 16 tokens). Credit = the device prefix in whole blocks, never
  the prompt's last block, plus the host blocks beyond it at 0.8; cost = (prompt - credit + prompt tokens in flight
  there, until their first token) x (requests in flight there + 1); the lowest cost wins (ties: the first).
  Simplified: events arrive at once (the real ones at the end of a step, over ZMQ).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from llmkit.engine.prompt_cache import CachedPrompt, PromptCache
from llmkit.engine.slot import Slot
from llmkit.engine.tokens import common_prefix

BLOCK = 16  # --kv-event-block-size (the router's and vLLM's default)


@dataclass
class Routed:
    """What the router knows of a request: its session header, its token ids (rendered by the workers), its blocks."""

    session: str
    tokens: list[int]
    keys: list[int] = field(default_factory=list)  # chained block keys (``block_keys``), for kv_aware


@dataclass
class Policy:
    """A router's choice over ``n`` replicas, and the in-flight counters it keeps (``Worker::load``)."""

    n: int
    seed: int = 0
    loads: list[int] = field(init=False)  # requests in flight, by replica
    sent: int = field(init=False, default=0)  # requests routed so far
    name: ClassVar[str] = ""
    renders: ClassVar[bool] = False  # asks every worker for the prompt's tokens first (vLLM's render route)

    def __post_init__(self) -> None:
        self.loads = [0] * self.n
        self.rng = random.Random(self.seed)

    def route(self, request: Routed) -> int:
        index = self.pick(request)
        self.loads[index] += 1
        self.sent += 1
        return index

    def pick(self, request: Routed) -> int:
        raise NotImplementedError

    def first_token(self, index: int, request: Routed) -> None:
        """The request's first streamed chunk went through (kv_aware stops counting its prompt as in flight)."""

    def finished(self, index: int, request: Routed) -> None:
        self.loads[index] -= 1

    def least_loaded(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda i: self.loads[i])


class RoundRobin(Policy):
    name = "round_robin"

    def pick(self, request: Routed) -> int:
        return self.sent % self.n


class PowerOfTwo(Policy):
    name = "power_of_two"

    def pick(self, request: Routed) -> int:
        if self.n == 1:
            return 0
        a, b = self.rng.sample(range(self.n), 2)
        return a if self.loads[a] <= self.loads[b] else b


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class ConsistentHash(Policy):
    name = "consistent_hash"
    VIRTUAL_NODES = 160

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ring = sorted((hash64(f"replica-{i}-{v}"), i) for i in range(self.n) for v in range(self.VIRTUAL_NODES))

    def pick(self, request: Routed) -> int:
        at = bisect.bisect_left(self.ring, (hash64(f"header:x-session-id:{request.session}"), -1))
        return self.ring[at % len(self.ring)][1]


class Node:
    """A radix tree's node: the tokens on the edge into it, its children by first token, the replicas sent through it."""

    __slots__ = ("children", "edge", "replicas")

    def __init__(self, edge: list[int], replicas: set[int]):
        self.edge, self.replicas = edge, replicas
        self.children: dict[int, Node] = {}


class RadixTree:
    """The prompts sent to each replica (the router's approximate tree, ``tree.rs``): one tree, each node tagged with
    the replicas whose prompts went through it."""

    def __init__(self) -> None:
        self.root = Node([], set())

    def insert(self, tokens: list[int], replica: int) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = Node(tokens[i:], {replica})
                return
            n = common_prefix(child.edge, tokens[i : i + len(child.edge)])
            if n < len(child.edge):  # split the edge where the prompt leaves it
                middle = Node(child.edge[:n], set(child.replicas))
                middle.children[child.edge[n]] = child
                child.edge = child.edge[n:]
                node.children[tokens[i]] = child = middle
            child.replicas.add(replica)
            node, i = child, i + n

    def match(self, tokens: list[int]) -> dict[int, int]:
        """For each replica, the longest prefix of ``tokens`` that a prompt sent to it shared."""
        found: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = common_prefix(child.edge, tokens[i : i + len(child.edge)])
            found |= dict.fromkeys(child.replicas, i + n)
            if n < len(child.edge):
                break
            node, i = child, i + n
        return found


class CacheAware(Policy):
    name = "cache_aware"
    renders = True
    THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5  # --cache-threshold, --balance-abs-threshold, --balance-rel-threshold

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tree = RadixTree()

    def pick(self, request: Routed) -> int:
        matched = self.tree.match(request.tokens)
        rates = [matched.get(i, 0) / len(request.tokens) for i in range(self.n)]
        low, high = min(self.loads), max(self.loads)
        balanced = not (high - low > self.BALANCE_ABS and high > low * self.BALANCE_REL)
        best = max(rates)
        use_prefix = balanced and best > self.THRESHOLD
        index = self.least_loaded([i for i in range(self.n) if not use_prefix or rates[i] == best])
        self.tree.insert(request.tokens, index)
        return index


def block_keys(tokens: Sequence[int], first: int = 0, parent: int = 0) -> list[int]:
    """Keys of the complete blocks of ``tokens`` from block ``first`` on, chained from ``parent`` (block ``first - 1``'s):
    a key stands for the whole prefix up to its block's end, as the router's tree path does."""
    keys = []
    for start in range(first * BLOCK, len(tokens) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(tokens[start : start + BLOCK])))
        keys.append(parent)
    return keys


class HeldBlocks:
    """What one replica's KV events tell the router: the blocks its slots hold (device tier) and its prompt cache holds
    (host tier), counted, as ``llmkit.engine.kv_events`` publishes them. ``sync`` after every change of the slots."""

    def __init__(self) -> None:
        self.device: Counter[int] = Counter()
        self.host: Counter[int] = Counter()
        self.slots: dict[int, tuple[list[int], list[int]]] = {}  # slot id -> (the token list last seen, its keys)
        self.entries: dict[int, tuple[CachedPrompt, list[int]]] = {}  # id(entry) -> (entry, its keys)

    def sync(self, slots: Sequence[Slot], cache: PromptCache | None, *, shares: bool = False) -> None:
        """(As the engine's: without ``shares``, kv_share, a busy slot's cells are its request's own, not on the device
        tier; with it, every sequence's, the resident prefixes' too, can be taken.)"""
        for slot in slots:
            seen, keys = self.slots.get(slot.id, (None, []))
            tokens = slot.cache_tokens if slot.is_idle or shares else []
            kept = min(len(keys), len(tokens) // BLOCK) if tokens is seen else 0
            self.device.subtract(keys[kept:])
            new = block_keys(tokens, kept, keys[kept - 1] if kept else 0)
            self.device.update(new)
            self.slots[slot.id] = (tokens, keys[:kept] + new)
        entries = {id(e): e for e in cache.entries} if cache is not None else {}
        for gone in self.entries.keys() - entries.keys():
            self.host.subtract(self.entries.pop(gone)[1])
        for new_id in entries.keys() - self.entries.keys():
            self.entries[new_id] = (entries[new_id], block_keys(entries[new_id].tokens))
            self.host.update(self.entries[new_id][1])

    def match(self, keys: list[int]) -> tuple[int, int]:
        """Blocks of the prompt held from its start: on the device tier, and on the host tier."""
        device = next((k for k, key in enumerate(keys) if self.device[key] <= 0), len(keys))
        host = next((k for k, key in enumerate(keys) if self.host[key] <= 0), len(keys))
        return device, host


class KvAware(Policy):
    name = "kv_aware"
    renders = True
    HOST_CREDIT = 0.8  # --kv-penalty-host
    held: list[HeldBlocks]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.held = [HeldBlocks() for _ in range(self.n)]
        self.prefill = [0] * self.n  # prompt tokens in flight, by replica, until their first token
        self.charged: dict[int, int] = {}  # id(request) -> the prompt tokens charged to its replica

    def credit(self, index: int, request: Routed) -> float:
        """Prompt tokens the replica need not read (``credited_tokens``)."""
        device, host = self.held[index].match(request.keys)
        device = min(device, (len(request.tokens) - 1) // BLOCK)
        return min((device + max(0, host - device) * self.HOST_CREDIT) * BLOCK, len(request.tokens) - 1)

    def pick(self, request: Routed) -> int:
        request.keys = request.keys or block_keys(request.tokens)
        work = [math.ceil(len(request.tokens) - self.credit(i, request)) for i in range(self.n)]
        costs = [(work[i] + self.prefill[i]) * (self.loads[i] + 1) for i in range(self.n)]
        index = min(range(self.n), key=costs.__getitem__)
        self.prefill[index] += work[index]
        self.charged[id(request)] = work[index]
        return index

    def first_token(self, index: int, request: Routed) -> None:
        self.prefill[index] -= self.charged.pop(id(request), 0)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, PowerOfTwo, ConsistentHash, CacheAware, KvAware)}
