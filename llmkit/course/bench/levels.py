"""The concurrency levels: n clients at once, one streamed request each, for n in 1, 2, 4, 8, on every server, and
the engine limit beside them: batched decode on ``llmkit.llama`` with no server (``RawDecoder``), the same prompts
and token counts as the servers get. Each level's numbers are a ``Row``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from tqdm import tqdm

from llmkit import models
from llmkit.course.bench.config import RAW, Config
from llmkit.course.bench.prompts import TEXTS, chat_prompt
from llmkit.course.bench.servers import Server, http_client
from llmkit.course.client import StreamResult

if TYPE_CHECKING:
    import httpx


T = TypeVar("T")


def ttft(s: StreamResult) -> float:
    """Seconds from sending to the first piece (to the end, if no piece came)."""
    return s.t_first - s.t_sent


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` starting at ``r`` (round ``r``'s order): rotated each round, nobody always goes first or last."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


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


# --- the engine limit -------------------------------------------------------------------------------------------------


class RawDecoder:
    """``raw(n)``: prefill n translation prompts, then decode max_tokens - 1 steps of n tokens.

    Same context shape as the slot server (``max(concurrency)`` sequences of
    ``ctx_per_slot`` tokens, one KV stream each), the same prompts and token counts,
    so its row reads like a server's: wall time from the start of the prefill to
    the last token, TTFT = the prefill of the n prompts (one batch), per-stream
    tok/s = the decode phase alone. That is the "engine limit" of the targets.
    ``texts`` (default: the bench's) are wrapped in the sequential server's prompt.
    """

    def __init__(self, cfg: Config, texts: list[str] = TEXTS):
        from llmkit.llama import Batch, Context, Model

        self.cfg, n_max = cfg, max(cfg.concurrency)
        self.model = Model(models.resolve_model(cfg.model))
        self.ctx = Context(self.model, n_ctx=n_max * cfg.ctx_per_slot, n_batch=2048, n_seq_max=n_max, n_threads=cfg.threads)
        chats = [[{"role": "user", "content": chat_prompt(texts[i % len(texts)])}] for i in range(n_max)]
        self.prompts = [self.model.tokenize_chat(chat) for chat in chats]
        self.batch = Batch(max(2048, sum(map(len, self.prompts))))

    def __call__(self, n: int) -> Row:
        from llmkit.sampling import Sampler, SamplingParams

        ctx, batch, steps = self.ctx, self.batch, self.cfg.max_tokens - 1  # the prefill gives the first token
        ctx.clear()
        samplers = [Sampler(self.model, SamplingParams(temperature=0, ignore_eos=True)) for _ in range(n)]
        try:
            tp = time.perf_counter()
            batch.clear()
            last = []
            for seq, prompt in enumerate(self.prompts[:n]):
                for pos, token in enumerate(prompt):
                    i = batch.add(token, pos, seq, logits=pos == len(prompt) - 1)
                last.append(i)
            ctx.decode(batch)
            prefill_ms = (time.perf_counter() - tp) * 1e3
            n_past = [len(p) for p in self.prompts[:n]]
            t0, decode_s = time.perf_counter(), 0.0
            for _ in range(steps):
                tokens = [s.sample(ctx, i) for s, i in zip(samplers, last, strict=True)]
                batch.clear()
                last = [batch.add(t, n_past[seq], seq, logits=True) for seq, t in enumerate(tokens)]
                n_past = [p + 1 for p in n_past]
                td = time.perf_counter()
                ctx.decode(batch)
                decode_s += time.perf_counter() - td
            step_s = time.perf_counter() - t0
        finally:
            for s in samplers:
                s.close()
        seconds = prefill_ms / 1e3 + step_s
        row = Row(
            RAW, n, n * (steps + 1), seconds, n * (steps + 1) / seconds, prefill_ms, prefill_ms, steps / step_s, busy_slots_per_decode=n
        )
        row.python_share = 1 - decode_s / step_s
        return row

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()
