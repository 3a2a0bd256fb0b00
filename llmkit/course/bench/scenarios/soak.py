"""Soak: many short requests, the server's resident memory sampled as they go."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmkit.course import launch
from llmkit.course.bench.config import SOAK_CACHE_RAM_MIB, Config
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.servers import OpenAIServer, Server, http_client, server_flags
from llmkit.course.bench.targets import Target, unmeasured

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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> Soak:
    """A slot server of 4 slots and a small ``--cache-ram``: distinct prompts fill the prompt cache to its limit, then evict."""
    with launch.serve("slots", "-np", "4", "-c", "8192", "--cache-ram", str(SOAK_CACHE_RAM_MIB), *server_flags(cfg)) as p:
        return asyncio.run(soak(OpenAIServer("slots (4 x 2048)", p.url, pid=p.process.pid), cfg))


def table(s: Soak) -> str:
    samples = ", ".join(f"{n}: {mb:.0f}" for n, mb in s.samples)
    return (
        f"{s.server}, {s.requests} requests. RSS MB at start {s.rss_start_mb:.0f}, after the first "
        f"{s.samples[1][0] if len(s.samples) > 1 else 0} {s.rss_first_mb:.0f}, last {s.rss_last_mb:.0f}, "
        f"peak (VmHWM) {s.rss_peak_mb:.0f}.\nSamples (requests: MB): {samples}"
    )


def section(s: Soak, cfg: Config) -> str:
    return f"## Soak (memory, --cache-ram {SOAK_CACHE_RAM_MIB})\n\n" + table(s)


# No leak: once the first requests' one-time allocations are done, resident memory levels off; the last sample may be
# at most 3 % above the first (allocator noise).
GROWTH_LIMIT = 1.03


# And all the soak's growth from the start stays within the prompt cache's limit (--cache-ram), plus 10 % for the
# allocator's own overhead: the prompt cache is what is allowed to grow, up to its limit.
OVER_CACHE_RAM = 1.1


def targets(s: Soak | None, cfg: Config) -> list[Target]:
    growth = f"slots RSS does not grow over the soak (last / first <= {GROWTH_LIMIT})"
    bounded = f"slots RSS growth over the soak <= --cache-ram ({SOAK_CACHE_RAM_MIB} MiB) + {100 * (OVER_CACHE_RAM - 1):.0f} %"
    if s is None:
        return [unmeasured(growth), unmeasured(bounded)]
    mb = f" ({s.rss_first_mb:.0f} -> {s.rss_last_mb:.0f} MB, peak {s.rss_peak_mb:.0f} MB)"
    of_cache = (s.rss_last_mb - s.rss_start_mb) / SOAK_CACHE_RAM_MIB
    return [
        Target(growth, f"{s.growth:.3f}{mb}", s.growth <= GROWTH_LIMIT),
        Target(bounded, f"{of_cache:.2f}x --cache-ram", of_cache <= OVER_CACHE_RAM),
    ]


SCENARIO = Scenario("soak", run, section, targets, wanted=lambda cfg: cfg.soak > 0)
