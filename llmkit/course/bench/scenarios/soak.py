"""Soak: many short requests, the server's resident memory sampled as they go."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmkit.course.bench.config import Config
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.servers import Server, http_client

if TYPE_CHECKING:
    import httpx


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
