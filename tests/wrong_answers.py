"""Plausible wrong answers to the exercises: an off-by-one, llama-server's rule where llmkit differs, a parser that
drops the last event, a route that blocks the server ... Each check must fail them, saying what differs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from llmkit.course.exercises import ch04, ch09
from llmkit.engine.tokens import common_prefix
from llmkit.sequential.translator import Translator
from llmkit.text import StopMatcher


class FailsLate(Translator):
    """Fails after its first token: a token reaches the client before the error."""

    def stream(self, text, target_lang="ja"):
        pieces = super().stream(text, target_lang)
        try:
            yield next(pieces)
            raise RuntimeError("late")
        finally:
            pieces.close()


def only_the_status(api, answer, budget):
    """was_cut that trusts the Responses status, as llama-server's answer never says incomplete."""
    if api == "chat":
        return answer["choices"][0]["finish_reason"] == "length"
    if api == "messages":
        return answer["stop_reason"] == "max_tokens"
    return answer["status"] == "incomplete"


def split_each_read(reads):
    """An SSE reader that parses each network read on its own: what a cut read breaks."""
    events = []
    for read in reads:
        for block in read.decode("utf-8", errors="replace").split("\n\n"):
            data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
            name = next((line[7:] for line in block.split("\n") if line.startswith("event: ")), None)
            if data:
                events.append((name, "\n".join(data)))
    return events


def drops_the_last_event(reads):
    """Whole lines and blank lines done right, but an event is kept only when the next one starts: the last is lost."""
    events, name, data = [], None, []
    for line in b"".join(reads).decode().replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            data += [value.removeprefix(" ")] if field == "data" else []
            name = value.removeprefix(" ") if field == "event" else name
    return events[:-1]


@dataclass(frozen=True)
class ArrivalOrder(ch04.ReferenceFewTokensFirst):
    """The queue in arrival order (llama-server's), the prompts by tokens asked."""

    name: ClassVar[str] = "arrival"

    def order(self, waiting, slots):
        return list(waiting)


def prompt_cache_without_the_quarter(entries, held, prompt):
    lcp = common_prefix(held, prompt)
    keep_best, sim_best, best = (lcp / len(held) if held else -1.0), lcp / len(prompt), None
    for i, tokens in enumerate(entries):
        lcp = common_prefix(tokens, prompt)
        if lcp / len(tokens) > keep_best and lcp / len(prompt) > sim_best:
            best, keep_best, sim_best = i, lcp / len(tokens), lcp / len(prompt)
    return best


def blocking_batch_route(app, translator):
    """The translations in the event loop's own thread: the server cannot answer anything else meanwhile."""
    from fastapi import Request

    @app.post("/translate/batch")
    async def translate_batch(request: Request) -> dict:
        body = await request.json()
        return {"translations": [translator.translate(text, body.get("target_lang", "French")) for text in body["texts"]]}


def threaded_batch_route_with_a_typo(app, translator):
    from fastapi import Request

    @app.post("/translate/batch")
    async def translate_batch(request: Request) -> dict:
        body = await request.json()
        return {"translation": [await asyncio.to_thread(translator.translate, t, body.get("target_lang", "French")) for t in body["texts"]]}


class ReleasesAtOnce(StopMatcher):
    """Looks for a stop string within each piece alone, and releases everything else at once."""

    def push(self, text):
        if self.stopped:
            return ""
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.word = min(hits)
            self.stopped = True
            return text[:at]
        return text


class NeverStreams(StopMatcher):
    """Right text in the end, but holds every piece back until the stop string or the flush: a stream that stalls."""

    def __init__(self, stops):
        super().__init__(stops)
        self.kept = ""

    def push(self, text):
        if self.stopped:
            return ""
        out = super().push(text)
        if self.stopped:
            out, self.kept = self.kept + out, ""
            return out
        self.kept += out
        return ""

    def flush(self):
        out, self.kept = self.kept + super().flush(), ""
        return out


class LookupInEverything(ch09.ReferenceLookup):
    """Looks the pattern up anywhere but returns the earliest match: not prompt lookup's latest."""

    def draft(self, seq, tokens, last, n_max):
        prompt, pattern = self.prompts.get(seq, []), [*tokens, last][-self.n :]
        for start in range(len(prompt) - len(pattern)):
            if prompt[start : start + len(pattern)] == pattern:
                return prompt[start + len(pattern) : start + len(pattern) + n_max]
        return []


@dataclass(frozen=True)
class NoLimitFirst(ch04.ReferenceFewTokensFirst):
    name: ClassVar[str] = "no-limit-first"

    def order(self, waiting, slots):
        return sorted(waiting, key=lambda r: (r.params.max_tokens, r.id))


def event_with(stored: Callable[[list[int], int], dict], **changed: Any) -> Callable[[list[int], int], dict]:
    """Chapter 10's KV event with fields changed: an unknown key (the router refuses the batch), or no token ids."""
    return lambda tokens, block_size: {**stored(tokens, block_size), **changed}


def cells_with_the_last_token(prompt_lengths, n_common, max_tokens):
    """Every generated token counted, the last one too (it is sampled, never decoded)."""
    per_request = [n + max_tokens for n in prompt_lengths]
    return sum(per_request), n_common + sum(n - n_common for n in per_request)


def cells_shared_per_request(prompt_lengths, n_common, max_tokens):
    """The prefix counted once per request even when shared: what a per-slot cache holds."""
    per_request = sum(n + max_tokens - 1 for n in prompt_lengths)
    return per_request, per_request


def key_from_the_user_field(headers, body):
    """Chapter 10's routing key with the OpenAI ``user`` field read, as the router does for other requests, not a chat."""
    given = {name.lower(): value for name, value in headers.items()}
    for name in ("x-session-id", "x-user-id", "x-tenant-id", "x-correlation-id", "x-request-id", "x-trace-id"):
        if given.get(name):
            return f"header:{name}:{given[name]}"
    return f"user:{body['user']}" if body.get("user") else "request:"


def key_by_the_order_given(headers, body):
    """The first session header in the order the request sends them, not in the router's order."""
    for name, value in headers.items():
        if value and name.lower().startswith("x-"):
            return f"header:{name.lower()}:{value}"
    return "request:"


def pair_tokens() -> list[list[int]]:
    from llmkit.course.exercises.ch10 import PAIR
    from llmkit.course.exercises.lab import LAB

    return [LAB.model().tokenize_chat(messages) for messages in PAIR]


def blocks_per_slot() -> int:
    """Every whole block of both prompts, the shared ones twice: what two per-slot caches hold."""
    return sum(len(t) // 16 for t in pair_tokens())


def blocks_by_their_own_tokens() -> int:
    """Blocks told apart by their own tokens alone (the router's keys), not by the chain of names."""
    a, b = pair_tokens()
    return len({tuple(t[k : k + 16]) for t in (a, b) for k in range(0, len(t) // 16 * 16, 16)})


def names_of_each_block_alone(tokens, block_size):
    """Chapter 10's event with each block named by its own tokens: no chain."""
    whole = len(tokens) // block_size * block_size
    names = [hashlib.sha256(struct.pack(f"<{block_size}I", *tokens[k : k + block_size])).digest() for k in range(0, whole, block_size)]
    return {"type": "BlockStored", "block_hashes": names, "parent_block_hash": None, "token_ids": list(tokens[:whole]),
            "block_size": block_size, "lora_id": None, "medium": None, "lora_name": None}  # fmt: skip


def names_at_random(tokens, block_size):
    """Unique names, but new ones each time: a worker could never tell the same block again."""
    event = names_of_each_block_alone(tokens, block_size)
    return {**event, "block_hashes": [os.urandom(32) for _ in event["block_hashes"]]}
