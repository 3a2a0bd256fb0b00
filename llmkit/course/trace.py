"""A multi-tenant chat trace (seeded), its replay against any OpenAI-compatible URL, and what the replay measured.

    trace = make_trace(seed=0)              # tenants x conversations x turns, conversations starting as a Poisson process
    records = replay(trace, url)            # every turn streamed (TTFT), each conversation re-sending itself plus the answer
    print(summarize(records).line())        # cache-hit fraction, TTFT p50/p99, tokens/s, requests per replica

Each tenant has its own long system prompt and few-shot examples: the prefix all its users share. A conversation
asks its questions one after the other; each turn sends the whole conversation so far, the answers the server gave
included, and waits a think time (exponential) after each answer. So a server, or a fleet's router, that keeps a
conversation where its prefix is cached reads only the new question; one that scatters it reads everything again.
Model-free and deterministic for a seed (the words come from ``WORDS``); only ``replay`` needs a server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from llmkit.course import tr
from llmkit.course.client import astream, chat_piece

WORDS = (
    "account",
    "address",
    "agent",
    "answer",
    "apply",
    "area",
    "balance",
    "bill",
    "board",
    "book",
    "branch",
    "budget",
    "call",
    "card",
    "case",
    "change",
    "charge",
    "check",
    "claim",
    "client",
    "code",
    "contract",
    "cost",
    "credit",
    "customer",
    "data",
    "date",
    "delivery",
    "desk",
    "detail",
    "device",
    "discount",
    "document",
    "due",
    "email",
    "entry",
    "error",
    "estimate",
    "fee",
    "file",
    "form",
    "fund",
    "goods",
    "group",
    "help",
    "hour",
    "invoice",
    "issue",
    "item",
    "key",
    "label",
    "level",
    "limit",
    "line",
    "list",
    "loan",
    "lock",
    "manager",
    "market",
    "member",
    "message",
    "method",
    "model",
    "month",
    "name",
    "note",
    "notice",
    "number",
    "offer",
    "office",
    "order",
    "owner",
    "package",
    "page",
    "part",
    "party",
    "password",
    "payment",
    "period",
    "plan",
    "policy",
    "price",
    "process",
    "product",
    "project",
    "purchase",
    "quote",
    "rate",
    "receipt",
    "record",
    "refund",
    "report",
    "request",
    "return",
    "review",
    "rule",
    "sale",
    "schedule",
    "service",
    "setting",
    "share",
    "shipment",
    "size",
    "statement",
    "status",
    "step",
    "stock",
    "store",
    "supplier",
    "support",
    "system",
    "tax",
    "team",
    "term",
    "ticket",
    "time",
    "total",
    "track",
    "transfer",
    "unit",
    "update",
    "user",
    "value",
    "vendor",
    "warranty",
    "week",
    "window",
    "work",
    "year",
)
TENANT_NAMES = ("Acme Bank", "Borealis Air", "Cobalt Telecom", "Dune Insurance", "Ember Retail", "Fjord Energy", "Garnet Health")


@dataclass(frozen=True)
class Tenant:
    name: str
    system: str  # the long system prompt
    shots: tuple[tuple[str, str], ...]  # few-shot examples: (question, answer)

    def prefix(self) -> list[dict]:
        """The messages every conversation of this tenant starts with."""
        shots = [m for q, a in self.shots for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        return [{"role": "system", "content": self.system}, *shots]


@dataclass(frozen=True)
class Conversation:
    id: int
    tenant: int
    start: float  # seconds after the trace begins
    questions: tuple[str, ...]
    thinks: tuple[float, ...]  # the pause after each answer before the next question (one fewer than questions)


@dataclass(frozen=True)
class Trace:
    tenants: tuple[Tenant, ...]
    conversations: tuple[Conversation, ...]

    def messages(self, conversation: Conversation, answers: Sequence[str]) -> list[dict]:
        """The request of turn ``len(answers)``: the tenant's prefix, the turns so far with their answers, the next question."""
        asked = zip(conversation.questions, answers, strict=False)  # the questions answered so far
        turns = [m for q, a in asked for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        question = {"role": "user", "content": conversation.questions[len(answers)]}
        return [*self.tenants[conversation.tenant].prefix(), *turns, question]

    def fresh(self, tag: str) -> Trace:
        """The same trace with ``tag`` at the start of every system prompt: replayed on replicas that served it before,
        none of its prompts is in their caches (a prefix shared with the earlier run ends within the first few tokens)."""
        tenants = tuple(dataclasses.replace(t, system=f"[{tag}] {t.system}") for t in self.tenants)
        return dataclasses.replace(self, tenants=tenants)

    @property
    def n_requests(self) -> int:
        return sum(len(c.questions) for c in self.conversations)


def sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize()


def make_tenant(rng: random.Random, name: str, system_words: int, shots: int) -> Tenant:
    rules = [f"Rule {k + 1}: {sentence(rng, 12)}." for k in range(max(1, system_words // 14))]
    system = f"You are the customer assistant of {name}. Answer in one or two short sentences. " + " ".join(rules)
    examples = tuple((f"{sentence(rng, 10)}?", f"{sentence(rng, 14)}.") for _ in range(shots))
    return Tenant(name, system, examples)


def make_trace(
    seed: int = 0,
    tenants: int = 4,
    conversations: int = 10,
    turns: int = 4,
    rate: float = 0.25,
    think: float = 2.0,
    system_words: int = 150,
    shots: int = 3,
    question_words: int = 12,
) -> Trace:
    """``conversations`` spread over ``tenants`` (at random), starting as a Poisson process of ``rate`` per second,
    each ``turns`` questions long with exponential pauses of mean ``think`` seconds after each answer."""
    rng = random.Random(seed)
    names = [TENANT_NAMES[i % len(TENANT_NAMES)] + ("" if i < len(TENANT_NAMES) else f" {i}") for i in range(tenants)]
    tenant_list = tuple(make_tenant(rng, name, system_words, shots) for name in names)
    start, convs = 0.0, []
    for i in range(conversations):
        start += rng.expovariate(rate)
        questions = tuple(f"{sentence(rng, question_words)}?" for _ in range(turns))
        thinks = tuple(rng.expovariate(1 / think) for _ in range(turns - 1))
        convs.append(Conversation(i, rng.randrange(tenants), start, questions, thinks))
    return Trace(tenant_list, tuple(convs))


# --- replay ------------------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One request of a replay, as the client saw it."""

    conversation: int
    tenant: int
    turn: int
    sent: float  # seconds after the replay began
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server read from its cache (usage's cached_tokens, else timings' cache_n)
    output_tokens: int = 0
    ttft: float = math.nan
    seconds: float = math.nan
    replica: str | None = None  # the answer's "model": a fleet names each replica (``Fleet.replica_of``)
    error: str | None = None


def usage_of(final: dict | None, usage: dict | None) -> tuple[int, int]:
    """Prompt tokens and cached prompt tokens from a stream's usage (OpenAI) or its timings (llama-server's own)."""
    usage, timings = usage or {}, (final or {}).get("timings") or {}
    prompt = usage.get("prompt_tokens", timings.get("prompt_n", 0) + timings.get("cache_n", 0))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n", 0))
    return int(prompt), int(cached or 0)


async def ask(client: httpx.AsyncClient, url: str, messages: list[dict], record: Record, params: dict) -> str:
    """Stream one turn into ``record``; return the answer's text ("" on an error, recorded).

    The conversation's id goes in an ``x-session-id`` header, as a chat front end sends its user's session: a router's
    session-keyed policies (vllm-router's ``consistent_hash``, ``sticky_least_loaded``) read it; the others ignore it.
    """
    body = {"model": "default", "messages": messages, "stream": True, "stream_options": {"include_usage": True}, **params}
    headers = {"x-session-id": f"conversation-{record.conversation}"}
    try:
        result = await astream(client, f"{url}/v1/chat/completions", body, chat_piece, headers=headers)
    except httpx.HTTPError as exc:  # the connection broke mid-stream, or never opened
        record.error = f"{type(exc).__name__}: {exc}"
        return ""
    record.ttft, record.seconds = result.ttft, result.seconds
    record.prompt_tokens, record.cached_tokens = usage_of(result.final, result.usage)
    record.output_tokens = result.n_tokens
    record.replica = (result.final or {}).get("model")
    if result.status != 200 or result.error is not None:
        record.error = f"HTTP {result.status}: {result.error}"
    return result.text


async def converse(client: httpx.AsyncClient, url: str, trace: Trace, conversation: Conversation, t0: float, params: dict) -> list[Record]:
    """One user: wait for the conversation's start, then each question after the last answer and a think time."""
    await asyncio.sleep(max(0.0, conversation.start - (time.perf_counter() - t0)))
    answers: list[str] = []
    records = []
    for turn in range(len(conversation.questions)):
        record = Record(conversation.id, conversation.tenant, turn, time.perf_counter() - t0)
        records.append(record)
        answers.append(await ask(client, url, trace.messages(conversation, answers), record, params))
        if record.error is not None:
            break  # the user gives up on this conversation
        if turn < len(conversation.thinks):
            await asyncio.sleep(conversation.thinks[turn])
    return records


async def areplay(trace: Trace, url: str, *, max_tokens: int = 24, temperature: float = 0.0, read_timeout: float = 120) -> list[Record]:
    """``replay`` in a running event loop (a notebook's); ``read_timeout``: the longest wait for the next piece."""
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": 0}
    limits = httpx.Limits(max_connections=len(trace.conversations) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(read_timeout, connect=10), limits=limits) as client:
        t0 = time.perf_counter()
        runs = [converse(client, url, trace, c, t0, params) for c in trace.conversations]
        return [r for records in await asyncio.gather(*runs) for r in records]


def replay(trace: Trace, url: str, **params) -> list[Record]:
    """Send ``trace`` to ``url`` (an OpenAI-compatible server or a router) as its users would; one ``Record`` per request."""
    return asyncio.run(areplay(trace, url, **params))


# --- what a replay measured --------------------------------------------------------------------------------------


@dataclass
class Summary:
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    wall: float  # seconds from the first request sent to the last answer
    ttft_p50: float  # seconds
    ttft_p99: float
    per_replica: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica -> (requests, prompt tokens)

    @property
    def cache_hit(self) -> float:
        """The fraction of prompt tokens read from a cache, not computed."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall if self.wall > 0 else math.nan

    def line(self) -> str:
        replicas = " ".join(f"{name}:{n}req/{p}tok" for name, (n, p) in sorted(self.per_replica.items()))
        return tr(
            "cache hit {hit:6.1%}  TTFT p50 {p50:6.0f} ms  p99 {p99:6.0f} ms  {rate:5.1f} tok/s  {n} req ({failed} failed)  {replicas}",
            hit=self.cache_hit, p50=self.ttft_p50 * 1000, p99=self.ttft_p99 * 1000, rate=self.tokens_per_s, n=self.requests,
            failed=self.errors, replicas=replicas,
        )  # fmt: skip


def summarize(records: Sequence[Record]) -> Summary:
    """Totals over the answered requests; TTFT percentiles (numpy's linear interpolation); requests and prompt tokens per replica."""
    ok = [r for r in records if r.error is None]
    ttfts = np.array([r.ttft for r in ok if not math.isnan(r.ttft)]) if ok else np.array([math.nan])
    wall = max((r.sent + r.seconds for r in ok), default=0.0) - min((r.sent for r in records), default=0.0)
    per: dict[str, tuple[int, int]] = {}
    for r in ok:
        n, p = per.get(r.replica or "?", (0, 0))
        per[r.replica or "?"] = (n + 1, p + r.prompt_tokens)
    return Summary(
        requests=len(records), errors=len(records) - len(ok), prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok), output_tokens=sum(r.output_tokens for r in ok), wall=wall,
        ttft_p50=float(np.percentile(ttfts, 50)), ttft_p99=float(np.percentile(ttfts, 99)), per_replica=per,
    )  # fmt: skip


def as_dict(summary: Summary) -> dict:
    return dataclasses.asdict(summary) | {"cache_hit": summary.cache_hit, "tokens_per_s": summary.tokens_per_s}
