"""Priority: a request that must go first while every slot is busy, waiting for a slot or preempting one."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmkit.course import launch
from llmkit.course.bench.config import PRIORITY_SERVERS, PRIORITY_SLOTS, Config
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import ttft
from llmkit.course.bench.servers import OpenAIServer, http_client, server_flags
from llmkit.course.bench.targets import Target, result_of, unmeasured

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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[Priority]:
    """Each of ``PRIORITY_SERVERS`` started alone with ``PRIORITY_SLOTS`` slots; the low answers compared with those of the
    first (a server that never preempts)."""
    flags = [*server_flags(cfg), "-np", str(PRIORITY_SLOTS), "-c", str(PRIORITY_SLOTS * cfg.ctx_per_slot), "--metrics"]
    results, lows = [], []
    for name, extra in tqdm(PRIORITY_SERVERS.items(), desc="priority", leave=False):
        with launch.serve("slots", *flags, *extra) as p:
            result, low = asyncio.run(priority(OpenAIServer(name, p.url), PRIORITY_SLOTS, cfg.priority_rounds, cfg))
        results.append(result)
        lows.append(low)
    same = [sum(a == b for run, first in zip(low, lows[0], strict=True) for a, b in zip(run, first, strict=True)) for low in lows]
    total = PRIORITY_SLOTS * cfg.priority_rounds
    return [dataclasses.replace(r, low_same=n, low_total=total) for r, n in zip(results, same, strict=True)]


def table(results: list[Priority]) -> str:
    lines = ["| server | high-priority TTFT, median | max | preempted | low answers as without preemption |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.server} | {r.ttft_ms:.0f} ms | {r.ttft_max_ms:.0f} ms | {r.preempted} | {r.low_same} of {r.low_total} |")
    return "\n".join(lines)


def section(results: list[Priority], cfg: Config) -> str:
    return (f"## Priority ({PRIORITY_SLOTS} slots busy with low-priority streams, a high-priority request comes; "
            f"{cfg.priority_rounds} rounds)\n\n" + table(results))  # fmt: skip


def targets(results: list[Priority] | None, cfg: Config) -> list[Target]:
    return priority_targets(results or [])


# A high-priority request that preempts gets its first token after its own prompt, where one that waits gets it after a
# low-priority answer of 4 x max_tokens tokens has ended: at least 5 times sooner (both with the RAM copy of the preempted
# KV and without it). And the preempted answers come out as without preemption (greedy).
PREEMPTION_SPEEDUP = 5


def priority_targets(results: Sequence[Priority]) -> list[Target]:
    waits, *preempting = list(PRIORITY_SERVERS)
    out = []
    for name in preempting:
        target = f"{name}: high-priority TTFT, waiting / preempting >= {PREEMPTION_SPEEDUP}x, preempted answers unchanged"
        slow, fast = result_of(results, waits), result_of(results, name)
        if slow is None or fast is None:
            out.append(unmeasured(target))
            continue
        r = slow.ttft_ms / fast.ttft_ms
        measured = f"{r:.1f}x, {fast.low_same} of {fast.low_total} unchanged, {fast.preempted} preempted"
        out.append(Target(target, measured, r >= PREEMPTION_SPEEDUP and fast.low_same == fast.low_total and fast.preempted > 0))
    return out


SCENARIO = Scenario("priority", run, section, targets, wanted=lambda cfg: cfg.priority_rounds > 0 and "slots" not in cfg.skip)
