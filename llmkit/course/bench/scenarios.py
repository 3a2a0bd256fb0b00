"""What the bench measures, one scenario per function, every server treated alike.

    all_levels    n clients at once, one streamed request each, for n in 1, 2, 4, 8 (the raw loop too)
    api_streaming the same streams through chat, Responses and Messages, at 1 and 8 streams: tok/s per API vs chat
    prefix_reuse  first token behind a new long prefix (cold) vs behind the same prefix again (warm)
    arrivals      a burst of long prompts while streams run: the streams' worst gap, the arrivals' first token
    kv_cache      a long prefix back from the host-RAM prompt cache on another slot; an edited chat with cache reuse
    soak          many short requests, the server's resident memory sampled as they go
    greedy_drift  in-process, no server: do greedy answers alone and batched (one KV stream per slot) agree?
    speculation   draft-free speculative decoding on and off, on prompts whose answers repeat them and on free text

Each scenario returns its numbers in a dataclass named after it (``prefix_reuse``
-> ``PrefixReuse``, ``all_levels`` -> ``Row``), one per server (and level), and
``Measured`` holds them all for one run. A new scenario is an async function here
that takes a ``Server`` (and the ``Config``) and returns its dataclass;
``llmkit.course.bench.run`` calls it for every server, ``report`` turns its results into
a table and, if it has a target, a function of its targets. (``greedy_drift`` is
about llama.cpp's numbers, not a server's: it runs once, on an ``Engine`` of its own.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from tqdm import tqdm

from llmkit.course.bench.config import GREEDY_SLOTS, RAW, BenchError, Config
from llmkit.course.bench.prompts import QUESTION, REVIEWS, TEXTS, spec_prompts
from llmkit.course.bench.servers import APIS, OpenAIServer, Server, http_client, through
from llmkit.course.bench.shared_prefix import SharedPrefix
from llmkit.course.client import StreamResult

if TYPE_CHECKING:
    import httpx

    from llmkit.course.bench.raw import RawDecoder


T = TypeVar("T")


def ttft(s: StreamResult) -> float:
    """Seconds from sending to the first piece (to the end, if no piece came)."""
    return s.t_first - s.t_sent


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` starting at ``r`` (round ``r``'s order): rotated each round, nobody always goes first or last."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


# --- concurrency levels ---------------------------------------------------------------


@dataclass
class Row:
    server: str
    concurrency: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ttft_median_ms: float | None = None
    ttft_p90_ms: float | None = None
    stream_tokens_per_s: float | None = None
    busy_slots_per_decode: float | None = None
    python_share: float | None = None


def median_run(rows: Sequence[Row]) -> Row:
    """The round with the median aggregate tok/s (the upper one of an even count)."""
    return sorted(rows, key=lambda row: row.tokens_per_s)[len(rows) // 2]


async def one_level(http: httpx.AsyncClient, server: Server, n: int, cfg: Config, bar: tqdm, texts: Sequence[str] = TEXTS) -> Row:
    """``n`` clients, one streamed request each, all sent at once (the i-th translates ``texts[i % len(texts)]``)."""
    before = await server.scrape(http)
    t0 = time.perf_counter()

    async def go(text: str) -> StreamResult:
        stream = await server.translate(http, text, cfg.max_tokens, cache_prompt=cfg.cache_prompt)
        bar.update()
        return stream

    streams = await asyncio.gather(*(go(texts[i % len(texts)]) for i in range(n)))
    seconds = max(s.t_done for s in streams) - t0
    tokens = sum(s.n_tokens for s in streams)
    ttfts = [ttft(s) * 1e3 for s in streams]
    rates = [(s.n_tokens - 1) / (s.t_done - s.t_first) for s in streams if s.times and s.n_tokens > 1 and s.t_done > s.t_first]
    row = Row(
        server.name,
        n,
        tokens,
        seconds,
        tokens / seconds,
        float(np.median(ttfts)),
        float(np.percentile(ttfts, 90)),
        float(np.median(rates)) if rates else None,
    )
    after = await server.scrape(http)
    if before is not None and after is not None:
        add_step_metrics(row, before, after)
    return row


def add_step_metrics(row: Row, before: dict, after: dict) -> None:
    """Busy slots per decode and Python's share of step time, from two /metrics scrapes."""
    P = "llamacpp:"
    n0, n1 = before.get(P + "n_decode_total", 0), after.get(P + "n_decode_total", 0)
    busy0, busy1 = before.get(P + "n_busy_slots_per_decode"), after.get(P + "n_busy_slots_per_decode")
    if busy1 is not None and n1 > n0:
        # the gauge is an average since start (ours and llama-server's): difference the sums
        row.busy_slots_per_decode = (busy1 * n1 - (busy0 or 0) * n0) / (n1 - n0)
    row.python_share = python_share(before, after)


def python_share(before: dict, after: dict) -> float | None:
    """Python's share of the slot server's step time between two /metrics scrapes (None: not llmkit's metrics, no step)."""
    P = "llamacpp:"
    if P + "decode_seconds_total" not in after or P + "step_seconds_total" not in after:
        return None
    decode = after[P + "decode_seconds_total"] - before.get(P + "decode_seconds_total", 0)
    step = after[P + "step_seconds_total"] - before.get(P + "step_seconds_total", 0)
    return 1 - decode / step if step > 0 else None


async def all_levels(servers: list[Server], raw: RawDecoder | None, cfg: Config) -> list[Row]:
    """Level by level, every server in turn (the raw loop first), so that a machine whose load
    drifts during the run treats them alike; one warm-up request per server first. With several
    rounds, the servers' order rotates each round and each row is the round with the median tok/s."""
    runs: dict[tuple[str, int], list[Row]] = {}
    async with http_client(max(cfg.concurrency)) as http:
        for server in servers:  # first-request costs are not measured
            await server.translate(http, TEXTS[0], 4)
        total = cfg.rounds * (len(servers) + bool(raw)) * sum(cfg.concurrency)
        with tqdm(total=total, desc="streams", unit="stream") as bar:
            for n in cfg.concurrency:
                for r in range(cfg.rounds):
                    if raw is not None:
                        bar.set_postfix_str(f"{RAW} x{n}")
                        runs.setdefault((RAW, n), []).append(raw(n))
                        bar.update(n)
                    for server in rotated(servers, r):
                        bar.set_postfix_str(f"{server.name} x{n}")
                        runs.setdefault((server.name, n), []).append(await one_level(http, server, n, cfg, bar))
    order = {RAW: -1} | {s.name: i for i, s in enumerate(servers)}
    medians = [median_run(rows) for rows in runs.values()]
    return sorted(medians, key=lambda row: (order[row.server], row.concurrency))


# --- API streaming cost: the same streams through chat, Responses and Messages --------------------

API_SERVERS = ("slots", "llama-server")  # the servers started here that speak all three chat APIs
API_TEXT = TEXTS[0]  # its greedy translation repeats itself: runs past any budget, also where ignore_eos cannot be asked
ApiRuns = dict[tuple[str, int, str], list[tuple[Row, float | None]]]  # (server, level, API) -> each round's row and CPU ms/token


@dataclass(frozen=True)
class ApiStreaming:
    """One server, level and API of ``api_streaming``: the median round's numbers, and its tok/s against chat's."""

    server: str
    api: str  # "chat", "responses" or "messages"
    streams: int
    rounds: int
    budget: int  # the tokens asked for: streams x max_tokens
    tokens: int  # generated in the median round, counted from each API's usage
    min_tokens: int  # the fewest of any round: below ``budget``, a stream ended before it
    seconds: float
    tokens_per_s: float
    ttft_median_ms: float | None
    stream_tokens_per_s: float | None
    cpu_ms_per_token: float | None  # the server process's CPU time per generated token, median of the rounds (None: not started here)
    ratio: float  # the median of the rounds' tok/s over chat's in the same round (chat: 1.0)
    ratio_low: float  # the lowest and highest of those ratios; for chat, its rounds over their median: the machine's noise
    ratio_high: float
    ratios: list[float]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far, in seconds (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


async def api_streaming(servers: list[Server], cfg: Config) -> list[ApiStreaming]:
    """Does streaming through the Responses or Messages API cost more than through chat? For each level
    ``n`` in ``cfg.api_levels``, every server of ``API_SERVERS`` streams the same ``n`` requests through
    each API (``servers.through``): the same greedy prompt (the translation of ``API_TEXT``) and budget
    (``cfg.max_tokens``) in each API's own body. Chat and Responses ask for ``ignore_eos``; Messages has
    no such field, so the prompt is one whose answer runs past the budget, and every API's tokens are
    counted from the usage it sends (``tokens`` shows any stream that ended early). Prompts are cached
    (Messages has no ``cache_prompt`` either): every API reads the same ~1 new prompt token per stream.

    Noise: ``cfg.api_rounds`` rounds (``api_rounds``); each API's tok/s is divided by chat's of the same
    round (``api_summary``). One ``ApiStreaming`` per server, level and API.
    """
    servers = [s for s in servers if s.name in API_SERVERS]
    if not servers or not cfg.api_levels:
        return []
    runs = await api_rounds(servers, cfg)
    return [api_summary(runs, s.name, n, api, n * cfg.max_tokens) for s in servers for n in cfg.api_levels for api in APIS]


async def api_rounds(servers: list[Server], cfg: Config) -> ApiRuns:
    """Level by level and round by round, every server in turn streams through the three APIs back to back (both
    orders rotating each round): {(server, level, API): [(its row, the server's CPU ms per token) for each round]}."""
    cached = dataclasses.replace(cfg, cache_prompt=True)
    runs: ApiRuns = {}
    async with http_client(max(cfg.api_levels), keepalive=False) as http:  # back-to-back streams: no closing connection reused
        for server in servers:  # first-request costs are not measured; every slot holds the prompt
            await asyncio.gather(*(through(server, "chat").translate(http, API_TEXT, 4) for _ in range(max(cfg.api_levels))))
            for api in APIS:
                await through(server, api).translate(http, API_TEXT, 4)
        total = cfg.api_rounds * len(servers) * len(APIS) * sum(cfg.api_levels)
        with tqdm(total=total, desc="API streaming", unit="stream") as bar:
            for n in cfg.api_levels:
                for r in range(cfg.api_rounds):
                    for server in rotated(servers, r):
                        for api in rotated(list(APIS), r):  # no API always goes first
                            bar.set_postfix_str(f"{server.name} {api} x{n}")
                            run = await cpu_timed_level(http, through(server, api), n, cached, bar)
                            runs.setdefault((server.name, n, api), []).append(run)
    return runs


async def cpu_timed_level(http: httpx.AsyncClient, server: Server, n: int, cfg: Config, bar: tqdm) -> tuple[Row, float | None]:
    """``one_level`` on ``API_TEXT``, and the server's CPU milliseconds per generated token (None if it was not started here)."""
    pid = server.pid
    cpu0 = cpu_seconds(pid) if pid else 0.0
    row = await one_level(http, server, n, cfg, bar, texts=[API_TEXT])
    return row, 1e3 * (cpu_seconds(pid) - cpu0) / row.tokens if pid else None


def api_summary(runs: ApiRuns, server: str, n: int, api: str, budget: int) -> ApiStreaming:
    """One API's rounds: the median round's numbers (as ``all_levels``), the median CPU time per token, and the ratios
    to chat's tok/s round by round; for chat itself, its rounds against their median (how much the machine alone moves)."""
    mine = runs[(server, n, api)]
    chat = [row.tokens_per_s for row, _ in runs[(server, n, "chat")]]
    if api == "chat":
        ratios = [c / float(np.median(chat)) for c in chat]
    else:
        ratios = [row.tokens_per_s / c for (row, _), c in zip(mine, chat, strict=True)]
    median = median_run([row for row, _ in mine])
    cpu = [ms for _, ms in mine if ms is not None]
    return ApiStreaming(
        server=server,
        api=api,
        streams=n,
        rounds=len(mine),
        budget=budget,
        tokens=median.tokens,
        min_tokens=min(row.tokens for row, _ in mine),
        seconds=median.seconds,
        tokens_per_s=median.tokens_per_s,
        ttft_median_ms=median.ttft_median_ms,
        stream_tokens_per_s=median.stream_tokens_per_s,
        cpu_ms_per_token=float(np.median(cpu)) if cpu else None,
        ratio=1.0 if api == "chat" else float(np.median(ratios)),
        ratio_low=min(ratios),
        ratio_high=max(ratios),
        ratios=ratios,
    )


# --- prefix reuse -------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixReuse:
    """First-token times behind a new long prefix (cold) and behind the same prefix again (warm), medians."""

    server: str
    cold_ms: float
    warm_ms: float
    speedup: float  # cold / warm
    cached_tokens: int | None  # the most prompt tokens a warm request's usage said were cached (None: not reported)


async def prefix_reuse(server: Server, system: str, cfg: Config) -> PrefixReuse:
    """TTFT of the first request with a new long prefix (cold) vs the next ones sharing it (warm).

    OpenAI servers: the prefix is a system prompt, each request a new short question.
    The sequential server: the long text itself, translated twice (it clears its cache).
    """
    cold: list[float] = []
    warm: list[float] = []
    cached: list[int] = []
    async with http_client(2) as http:
        for k in range(2):  # two prefixes (a new tag each): two cold and four warm requests
            prefix = system.replace("Session ", f"Session {k}-", 1)
            for j in range(3):
                s = await server.prefixed(http, prefix, f"Which item is on shelf {j + 3}?")
                (cold if j == 0 else warm).append(ttft(s) * 1e3)
                if j and s.cached_tokens is not None:
                    cached.append(s.cached_tokens)
    c, w = float(np.median(cold)), float(np.median(warm))
    return PrefixReuse(server.name, c, w, c / w, max(cached) if cached else None)


# --- the KV cache beyond one slot: the host-RAM prompt cache, cache reuse -------------------------


@dataclass(frozen=True)
class KvCache:
    """First-token times of one long prefix read cold, again on its slot, and back from RAM on the other slot;
    and the share of an edited chat read again."""

    server: str
    cold_ms: float
    same_slot_ms: float
    ram_ms: float
    ram_cached_tokens: int | None  # the prompt tokens the request from RAM found cached
    chat_tokens: int  # the edited chat's prompt tokens
    edited_read_share: float | None  # of them, the share read again (None: the server did not say)


async def kv_cache(server: OpenAIServer, prefix: str, history: list[dict], shortened: list[dict]) -> KvCache:
    """On a server with 2 slots and ``--cache-reuse``: first-token times of a long ``prefix`` read cold,
    again on the same slot, and back from RAM on the other slot (two unrelated prompts took both slots
    in between); then ``history`` and the same chat with an early message ``shortened``: the share of
    the prompt read again."""
    async with http_client(1) as http:

        async def first_token(system: str, question: str) -> StreamResult:
            return await server.stream(http, server.request(question, 1, system=system))

        cold = await first_token(prefix, "Which item is on shelf 3?")
        same_slot = await first_token(prefix, "Which item is on shelf 4?")
        for other in ("A recipe for bread: flour, water and salt.", "The rules of chess, in one line."):
            await first_token(other, "Go on.")
        from_ram = await first_token(prefix, "Which item is on shelf 5?")
        await server.stream(http, server.chat_request(history, 1))
        edited = await server.stream(http, server.chat_request(shortened, 1))
    timings = (edited.final or {}).get("timings") or {}
    n_prompt = timings.get("cache_n", 0) + timings.get("prompt_n", 0)
    return KvCache(
        server=server.name,
        cold_ms=ttft(cold) * 1e3,
        same_slot_ms=ttft(same_slot) * 1e3,
        ram_ms=ttft(from_ram) * 1e3,
        ram_cached_tokens=from_ram.cached_tokens,
        chat_tokens=n_prompt,
        edited_read_share=timings.get("prompt_n", 0) / n_prompt if n_prompt else None,
    )


# --- arrivals: a burst of long prompts while streams run ---------------------------------------


@dataclass(frozen=True)
class Arrivals:
    """``running`` streams while ``arrivals`` long prompts came at once: the streams' gaps between two tokens while
    the burst was read (None: no gap then), the arrivals' first tokens, and the tokens per second of all of them."""

    server: str
    running: int
    arrivals: int
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    gap_max_ms: float | None
    arrival_ttft_median_ms: float
    arrival_ttft_max_ms: float
    tokens_per_s: float


async def arrivals(server: Server, running: int, prompts: list[str], cfg: Config) -> Arrivals:
    """``running`` streams generating, then ``len(prompts)`` long prompts at once.

    While the burst is being read, how long do the running streams wait between two tokens
    (p50, p99, max)? How long until the arrivals' first token? How many tokens per second in all?
    A server that reads the whole burst in one step stalls the running streams for that step;
    a per-step token budget (stall-free batching) bounds the stall.
    """
    async with http_client(running + len(prompts)) as http:
        t0 = time.perf_counter()
        streams, watched = await start_streams(http, server, running, cfg.max_tokens * 2)
        t_burst = time.perf_counter()
        burst = await asyncio.gather(*(server.translate(http, text, 16) for text in prompts))
        t_read = max(s.t_first for s in burst)  # the last arrival's first token: the burst is read
        done = await asyncio.gather(*streams)
    gaps = [b - a for times in watched for a, b in itertools.pairwise(times) if b > t_burst and a < t_read]
    tokens = sum(s.n_tokens for s in done + burst)

    def ms(q: float) -> float | None:
        return 1e3 * float(np.percentile(gaps, q)) if gaps else None

    return Arrivals(
        server=server.name,
        running=running,
        arrivals=len(prompts),
        gap_p50_ms=ms(50),
        gap_p99_ms=ms(99),
        gap_max_ms=ms(100),
        arrival_ttft_median_ms=1e3 * float(np.median([ttft(s) for s in burst])),
        arrival_ttft_max_ms=1e3 * max(ttft(s) for s in burst),
        tokens_per_s=tokens / (max(s.t_done for s in done + burst) - t0),
    )


async def start_streams(
    http: httpx.AsyncClient, server: Server, n: int, max_tokens: int
) -> tuple[list[asyncio.Task[StreamResult]], list[list[float]]]:
    """``n`` streams started, returned once each has sent 8 pieces (or one has ended), with the times their pieces arrive."""
    watched: list[list[float]] = [[] for _ in range(n)]  # when each piece of a running stream arrived

    def watch(times: list[float]):
        return lambda _piece: times.append(time.perf_counter())

    streams = [asyncio.create_task(server.translate(http, TEXTS[i % len(TEXTS)], max_tokens, on_piece=watch(watched[i]))) for i in range(n)]
    # every stream is generating (or one has ended): two conditions to poll, not one event to await
    while min(map(len, watched)) < 8 and not any(s.done() for s in streams):  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    return streams, watched


# --- soak: memory over many requests ---------------------------------------------------------


@dataclass(frozen=True)
class Soak:
    """The server's resident memory over many requests (MB), sampled every ``soak_every`` requests."""

    server: str
    requests: int
    samples: list[tuple[int, float]]  # (requests done, RSS MB); the first before any request (after one warm-up)
    rss_start_mb: float
    rss_first_mb: float  # after the first ``soak_every`` requests: one-time allocations done
    rss_last_mb: float
    rss_peak_mb: float  # VmHWM
    growth: float  # last / first


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB: current and peak resident memory."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


async def soak(server: Server, cfg: Config, workers: int = 4) -> Soak:
    """``cfg.soak`` short streamed requests from ``workers`` clients; RSS every ``soak_every`` requests."""
    assert server.pid is not None, "the soak samples the memory of a server started here"
    pid = server.pid
    async with http_client(1) as http:  # warm-up: the first request's one-time allocations are not growth
        await server.translate(http, "Warm-up.", 8)
    samples = [(0, rss_mb(pid)[0])]
    done, next_id = 0, 0
    bar = tqdm(total=cfg.soak, desc=f"soak {server.name}", unit="req", leave=False)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done, next_id
        while next_id < cfg.soak:
            i, next_id = next_id, next_id + 1
            await server.translate(http, f"Request {i}. {TEXTS[i % len(TEXTS)][: 20 + i % 60]}", 8)
            done += 1
            bar.update()
            if done % cfg.soak_every == 0:
                samples.append((done, rss_mb(pid)[0]))

    async with http_client(workers) as http:
        await asyncio.gather(*(worker(http) for _ in range(workers)))
    bar.close()
    first, last = samples[1 if len(samples) > 2 else 0][1], samples[-1][1]
    return Soak(
        server=server.name,
        requests=cfg.soak,
        samples=samples,
        rss_start_mb=samples[0][1],
        rss_first_mb=first,
        rss_last_mb=last,
        rss_peak_mb=max(rss_mb(pid)[1], *(s[1] for s in samples)),
        growth=last / first,
    )


# --- greedy drift: the same greedy answers alone and batched? ---------------------------------


@dataclass(frozen=True)
class ReviewDrift:
    """One review of ``greedy_drift``: its answer alone, and how the batched runs' answers differed from it."""

    review: str
    differed: int  # batched runs whose answer was not the one alone
    alone: str
    batched_differing: list[str]  # those answers, each once
    same_chars_before_difference: int | None  # the fewest characters any of them shared with the answer alone


@dataclass(frozen=True)
class GreedyDrift:
    """Chapter 6's reviews answered alone, alone again (the control) and ``runs`` times batched."""

    runs: int
    slots: int
    max_tokens: int
    reviews: list[ReviewDrift]
    runs_with_difference: int  # batched runs in which at least one answer differed from alone
    alone_twice_identical: bool
    alone_twice_differed: int  # answers that differed between the two runs alone
    batch_schedules: int  # distinct step sequences (prompt and generated tokens per step) among the batched runs
    seconds: float


def same_start(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share before they part."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def greedy_drift(cfg: Config) -> GreedyDrift:
    """Chapter 6's 8 reviews, unconstrained and greedy, on an in-process ``Engine`` with 4 slots of one
    KV stream each (explicit ``n_parallel``: ``kv_unified=False``), as chapter 6's ``-np 4 -c 4096`` server.

    Each review is answered alone (the reference), then alone again (the control: the same batch
    shapes, so the same answers expected); then ``cfg.greedy_runs`` times all 8 are submitted at once
    (8 requests on 4 slots: they share steps, and a request waits for a free slot) and every answer
    is compared with its reference. No prompt is reused from a slot or RAM (``cache_prompt=False``,
    no prompt cache): every run reads every prompt in full.
    ``batch_schedules`` counts the distinct step sequences (prompt and generated tokens per step)
    among the batched runs: how many different batch shapes the runs went through.
    """
    t0 = time.perf_counter()
    alone, again, batched, schedules = greedy_answers(cfg)
    return GreedyDrift(
        runs=cfg.greedy_runs,
        slots=GREEDY_SLOTS,
        max_tokens=cfg.greedy_tokens,
        reviews=[review_drift(review, alone[i], [run[i] for run in batched]) for i, review in enumerate(REVIEWS)],
        runs_with_difference=sum(any(run[i] != alone[i] for i in range(len(REVIEWS))) for run in batched),
        alone_twice_identical=again == alone,
        alone_twice_differed=sum(a != b for a, b in zip(alone, again, strict=True)),
        batch_schedules=schedules,
        seconds=time.perf_counter() - t0,
    )


def greedy_answers(cfg: Config) -> tuple[list[str], list[str], list[list[str]], int]:
    """The reviews' answers alone, alone again, and in each batched run; and the batched runs' distinct batch schedules."""
    from llmkit.engine import Engine, EngineConfig, RequestParams

    params = RequestParams.of(temperature=0, max_tokens=cfg.greedy_tokens, cache_prompt=False)
    config = EngineConfig(n_parallel=GREEDY_SLOTS, n_ctx=GREEDY_SLOTS * cfg.ctx_per_slot, n_threads=cfg.threads, cache_ram_mib=0)
    engine = Engine(cfg.model, config)
    starts: list[float] = []  # when each batched run was submitted: its steps are the ones recorded from then until the next
    with engine:
        prompts = [engine.model.tokenize_chat([{"role": "user", "content": QUESTION + review}]) for review in REVIEWS]

        def answer(batch: list[list[int]]) -> list[str]:
            requests = [engine.submit(p, params) for p in batch]  # tokenized already: submitted together
            return [r.result() for r in requests]

        alone = [answer([p])[0] for p in prompts]
        again = [answer([p])[0] for p in prompts]
        batched: list[list[str]] = []
        for _ in tqdm(range(cfg.greedy_runs), desc="greedy drift", unit="run", leave=False):
            starts.append(time.perf_counter())
            batched.append(answer(prompts))
    steps = list(engine.steps)  # closed: the engine thread has recorded its last step (it keeps the last 10,000)
    ends = [*starts[1:], float("inf")]
    schedules = {tuple((s.n_prompt, s.n_generated) for s in steps if a <= s.t < b) for a, b in zip(starts, ends, strict=True)}
    return alone, again, batched, len(schedules)


def review_drift(review: str, alone: str, batched: list[str]) -> ReviewDrift:
    """One review's answer alone against its answers in the batched runs."""
    differing = [answer for answer in batched if answer != alone]
    return ReviewDrift(
        review=review,
        differed=len(differing),
        alone=alone,
        batched_differing=sorted(set(differing)),
        same_chars_before_difference=min((same_start(answer, alone) for answer in differing), default=None),
    )


# --- speculation: draft-free speculative decoding, with and without, on the same server ---------------------------


@dataclass(frozen=True)
class SpecServer:
    """One speculative mode of one server, and where the same server answers without speculation."""

    server: str  # "slots" or "llama-server"
    mode: str  # its --spec-type
    url: str
    plain_url: str  # the slot server: the same (speculation off per request); llama-server: one started without it
    plain_fields: dict = field(default_factory=dict)  # added to a request without speculation ({"speculative.n_max": 0} here)


@dataclass(frozen=True)
class Speculation:
    """One server and mode, one kind of prompt, one level: tok/s with and without speculation (the median rounds),
    the speedup (the median of the rounds' ratios, each with and without measured back to back), the drafts, and
    how many speculative answers were the same server's answer without speculation (all rounds)."""

    server: str
    mode: str
    prompts: str  # "copy" or "free"
    streams: int
    rounds: int
    tokens: int  # generated in one round, with speculation
    plain_tokens_per_s: float
    tokens_per_s: float
    speedup: float
    speedup_low: float
    speedup_high: float
    draft_n: int  # tokens drafted in all rounds
    draft_n_accepted: int  # of them, accepted
    same_answers: int  # speculative answers equal to the answer without speculation, same prompt, level and round
    answers: int
    python_share: float | None  # the slot server: Python's share of its step time with speculation (from /metrics)

    @property
    def acceptance(self) -> float | None:
        return self.draft_n_accepted / self.draft_n if self.draft_n else None


@dataclass
class Completions:
    """One run of ``completions``: each answer by (client, prompt), and what its timings said."""

    seconds: float
    answers: dict[tuple[int, int], str]
    tokens: int
    draft_n: int
    draft_n_accepted: int
    python_share: float | None


async def completions(
    http: httpx.AsyncClient, server: Server, url: str, prompts: Sequence[str], n: int, extra: dict, cfg: Config
) -> Completions:
    """``n`` clients at once, each sending every prompt in turn (client ``i`` from prompt ``i``) to ``url``'s native
    ``/completion``: greedy, ``max_tokens`` each (``ignore_eos``), no cached prompt, not streamed (so the timings come back)."""
    before = await server.scrape(http)
    answers: dict[tuple[int, int], str] = {}
    timings: list[dict] = []

    async def client(i: int) -> None:
        for k in rotated(range(len(prompts)), i):
            body = {"prompt": prompts[k], "n_predict": cfg.max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            r = await http.post(f"{url}/completion", json=body | extra)
            if r.status_code != 200:
                raise BenchError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
            answers[(i, k)] = r.json()["content"]
            timings.append(r.json()["timings"])

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(n)))
    seconds = time.perf_counter() - t0
    after = await server.scrape(http)
    share = python_share(before, after) if before is not None and after is not None else None
    return Completions(
        seconds,
        answers,
        sum(t["predicted_n"] for t in timings),
        sum(t.get("draft_n", 0) for t in timings),
        sum(t.get("draft_n_accepted", 0) for t in timings),
        share,
    )


async def speculation(servers: list[SpecServer], cfg: Config) -> list[Speculation]:
    """Does speculation pay where answers repeat their prompt, and cost nothing where they do not? For each
    level of ``cfg.spec_streams``, kind of prompt (``prompts.spec_prompts``) and round, every server and mode in
    turn runs ``completions`` without speculation and with it, back to back (which first alternates each round).
    One ``Speculation`` per server, mode, kind and level."""
    kinds = spec_prompts()
    runs: dict[tuple[int, int, str, int], tuple[Completions, Completions]] = {}  # (server i, level, kind, round) -> (without, with)
    async with http_client(max(cfg.spec_streams), keepalive=False) as http:
        for s in servers:  # first-request costs are not measured
            for url in (s.url, s.plain_url):
                await http.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 4, "cache_prompt": False})
        total = len(servers) * cfg.rounds * 2 * sum(cfg.spec_streams) * sum(map(len, kinds.values()))
        with tqdm(total=total, desc="speculation", unit="answer") as bar:
            for n in cfg.spec_streams:
                for kind, prompts in kinds.items():
                    for r in range(cfg.rounds):
                        for i, s in rotated(list(enumerate(servers)), r):
                            bar.set_postfix_str(f"{s.server} {s.mode} {kind} x{n}")
                            server = OpenAIServer(s.server, s.url)  # its /metrics
                            pair = []
                            for on in (r % 2 == 0, r % 2 != 0):
                                url, extra = (s.url, {}) if on else (s.plain_url, s.plain_fields)
                                pair.append((on, await completions(http, server, url, prompts, n, extra, cfg)))
                                bar.update(n * len(prompts))
                            runs[(i, n, kind, r)] = (next(c for on, c in pair if not on), next(c for on, c in pair if on))
    return [speculation_summary(s, [runs[(i, n, kind, r)] for r in range(cfg.rounds)], kind, n)
            for i, s in enumerate(servers) for kind in kinds for n in cfg.spec_streams]  # fmt: skip


def speculation_summary(s: SpecServer, pairs: list[tuple[Completions, Completions]], kind: str, n: int) -> Speculation:
    """One server, mode, kind and level over its rounds: medians of tok/s and of the speedups, sums of the rest."""
    plain = [a.tokens / a.seconds for a, _ in pairs]
    fast = [b.tokens / b.seconds for _, b in pairs]
    ratios = [f / p for p, f in zip(plain, fast, strict=True)]
    shares = [b.python_share for _, b in pairs if b.python_share is not None]
    return Speculation(
        server=s.server,
        mode=s.mode,
        prompts=kind,
        streams=n,
        rounds=len(pairs),
        tokens=pairs[0][1].tokens,
        plain_tokens_per_s=float(np.median(plain)),
        tokens_per_s=float(np.median(fast)),
        speedup=float(np.median(ratios)),
        speedup_low=min(ratios),
        speedup_high=max(ratios),
        draft_n=sum(b.draft_n for _, b in pairs),
        draft_n_accepted=sum(b.draft_n_accepted for _, b in pairs),
        same_answers=sum(b.answers[key] == a.answers[key] for a, b in pairs for key in b.answers),
        answers=sum(len(b.answers) for _, b in pairs),
        python_share=float(np.median(shares)) if shares else None,
    )


# --- priority: a request that must go first, while every slot is busy --------------------------------------


@dataclass(frozen=True)
class Priority:
    """A high-priority request sent while every slot streams a long low-priority answer: its time to first token
    (median and max over the rounds), how many jobs the server preempted, and how many low-priority answers came out
    as on a server that never preempts (greedy: the same text expected)."""

    server: str
    ttft_ms: float
    ttft_max_ms: float
    preempted: int
    low_same: int
    low_total: int


async def priority_round(http: httpx.AsyncClient, server: OpenAIServer, slots: int, cfg: Config) -> tuple[float, list[str]]:
    """``slots`` low-priority streams (priority 5) generating, then one high-priority request (priority 0): its TTFT (s),
    and the low answers' texts once they are done."""
    watched: list[list[float]] = [[] for _ in range(slots)]
    low = [
        asyncio.create_task(
            server.stream(http, server.request(TEXTS[i], 4 * cfg.max_tokens, cache_prompt=False) | {"priority": 5},
                          on_piece=lambda _p, times=watched[i]: times.append(time.perf_counter()))
        )
        for i in range(slots)
    ]  # fmt: skip
    while min(map(len, watched)) < 8 and not any(s.done() for s in low):  # noqa: ASYNC110 -- two conditions to poll
        await asyncio.sleep(0.005)
    high = await server.stream(http, server.request(TEXTS[slots], 16, cache_prompt=False) | {"priority": 0})
    return ttft(high), [s.text for s in await asyncio.gather(*low)]


async def priority(server: OpenAIServer, slots: int, rounds: int, cfg: Config) -> tuple[Priority, list[list[str]]]:
    """``rounds`` rounds of ``priority_round``; the low answers of each round, to compare across servers."""
    async with http_client(slots + 1) as http:
        before = await server.scrape(http) or {}
        runs = [await priority_round(http, server, slots, cfg) for _ in range(rounds)]
        after = await server.scrape(http) or {}
    preempted = int(after.get("llamacpp:requests_preempted_total", 0) - before.get("llamacpp:requests_preempted_total", 0))
    times = [t for t, _ in runs]
    summary = Priority(server.name, 1e3 * float(np.median(times)), 1e3 * max(times), preempted, 0, 0)
    return summary, [texts for _, texts in runs]


# --- fleet: the router's policies in front of replicas ---------------------------------------------------


@dataclass(frozen=True)
class FleetRun:
    """One policy in front of ``replicas`` replicas of ``server``, on the seeded multi-tenant trace: the share of prompt
    tokens served from a cache (the servers' own counts), time to first token, tokens/s, requests per replica."""

    server: str
    policy: str
    requests: int
    errors: int
    cache_hit: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    per_replica: dict[str, int]


def fleet_runs(server: str, policies: Sequence[str], cfg: Config, flags: Sequence[str]) -> list[FleetRun]:
    """Each policy through a fresh fleet (cold caches) of 2 replicas at ``-t 1``, on the same trace (``llmkit.course.fleet.compare``)."""
    from llmkit.course import fleet, trace

    scenario = trace.make_trace(seed=0, conversations=cfg.fleet_conversations, turns=cfg.fleet_turns)
    out = []
    for policy, records in fleet.compare(server, policies, scenario, 2, flags, max_tokens=cfg.fleet_tokens).items():
        s = trace.summarize(records)
        per = {replica: n for replica, (n, _) in sorted(s.per_replica.items())}
        out.append(FleetRun(server, policy, s.requests, s.errors, s.cache_hit, 1e3 * s.ttft_p50, 1e3 * s.ttft_p99, s.tokens_per_s, per))
    return out


# --- one run's results -----------------------------------------------------------------------


@dataclass
class Measured:
    """Every scenario's results of one bench run (empty, or None, where it was skipped)."""

    rows: list[Row] = field(default_factory=list)
    apis: list[ApiStreaming] = field(default_factory=list)
    prefix: list[PrefixReuse] = field(default_factory=list)
    arrivals: list[Arrivals] = field(default_factory=list)
    kv_cache: list[KvCache] = field(default_factory=list)
    soak: Soak | None = None
    greedy: GreedyDrift | None = None
    speculation: list[Speculation] = field(default_factory=list)
    priority: list[Priority] = field(default_factory=list)
    fleet: list[FleetRun] = field(default_factory=list)
    shared_prefix: list[SharedPrefix] = field(default_factory=list)
