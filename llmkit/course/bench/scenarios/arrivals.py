"""Arrivals: a burst of long prompts while streams run; the streams' worst gap, the arrivals' first token."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmkit.course.bench.config import Config
from llmkit.course.bench.levels import ttft
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.servers import Server, http_client
from llmkit.course.client import StreamResult

if TYPE_CHECKING:
    import httpx


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
