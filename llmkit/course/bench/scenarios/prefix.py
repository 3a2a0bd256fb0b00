"""Prefix reuse: the first token behind a new long prefix (cold) and behind the same prefix again (warm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmkit.course.bench.config import Config
from llmkit.course.bench.levels import ttft
from llmkit.course.bench.servers import Server, http_client

if TYPE_CHECKING:
    pass


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
