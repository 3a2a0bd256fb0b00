"""Prefix reuse: the first token behind a new long prefix (cold) and behind the same prefix again (warm)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from llmkit.course.bench.config import Config
from llmkit.course.bench.prompts import long_system_prompt
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import ttft
from llmkit.course.bench.servers import Server, http_client
from llmkit.course.bench.targets import Target, fmt, result_of, unmeasured


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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[PrefixReuse]:
    system = long_system_prompt(cfg.model, cfg.prefix_tokens)
    return [asyncio.run(prefix_reuse(server, system, cfg)) for server in tqdm(stage.servers, desc="prefix reuse", leave=False)]


def table(results: list[PrefixReuse]) -> str:
    lines = ["| server | cold TTFT ms | warm TTFT ms | cold / warm | cached tokens (warm) |", "|---|---|---|---|---|"]
    for p in results:
        lines.append(f"| {p.server} | {p.cold_ms:.0f} | {p.warm_ms:.0f} | {p.speedup:.1f}x | {fmt(p.cached_tokens, 'd')} |")
    return "\n".join(lines)


def section(results: list[PrefixReuse], cfg: Config) -> str:
    return f"## Prefix reuse (~{cfg.prefix_tokens}-token shared prefix, first token only)\n\n" + table(results)


def targets(results: list[PrefixReuse] | None, cfg: Config) -> list[Target]:
    return [prefix_target(results or [])]


# A warm request reads ~1 new token behind a cached ~800-token prefix where a cold one reads them all: its first token
# must come at least 20 times sooner.
PREFIX_SPEEDUP = 20


def prefix_target(prefix: Sequence[PrefixReuse]) -> Target:
    name = f"slots prefix reuse: cold TTFT / warm TTFT >= {PREFIX_SPEEDUP}x"
    if not (p := result_of(prefix, "slots")):
        return unmeasured(name)
    return Target(name, f"{p.speedup:.1f}x", p.speedup >= PREFIX_SPEEDUP)


SCENARIO = Scenario("prefix", run, section, targets, shared=True)
