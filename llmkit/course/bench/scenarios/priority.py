"""Priority: a request that must go first while every slot is busy, waiting for a slot or preempting one."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmkit.course.bench.config import Config
from llmkit.course.bench.levels import ttft
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.servers import OpenAIServer, http_client

if TYPE_CHECKING:
    import httpx


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
