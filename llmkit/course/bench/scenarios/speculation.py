"""Speculation: draft-free speculative decoding, with and without, on the same server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmkit.course.bench.config import BenchError, Config
from llmkit.course.bench.levels import python_share, rotated
from llmkit.course.bench.prompts import spec_prompts
from llmkit.course.bench.servers import OpenAIServer, Server, http_client

if TYPE_CHECKING:
    import httpx


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
