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
from llmkit.course.bench.config import NO_BUDGET, RAW, Config
from llmkit.course.bench.prompts import TEXTS, chat_prompt
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.servers import Server, http_client
from llmkit.course.bench.targets import Target, fmt, info, percent, unmeasured
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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[Row]:
    """Every server started together, and the raw loop (unless skipped), at every level."""
    raw = RawDecoder(cfg) if "raw" not in cfg.skip else None
    try:
        return asyncio.run(all_levels(stage.servers, raw, cfg))
    finally:
        if raw is not None:
            raw.close()


Levels = dict[tuple[str, int], Row]  # (server, concurrent streams) -> its row


def table(rows: list[Row]) -> str:
    columns = ["server", "streams", "tokens", "wall s", "aggregate tok/s", "TTFT median ms", "TTFT p90 ms",
               "per-stream tok/s", "busy slots/decode", "Python share of step"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        share = percent(r.python_share, ".1f")
        lines.append(
            f"| {r.server} | {r.concurrency} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_s:.1f} | {fmt(r.ttft_median_ms)} | "
            f"{fmt(r.ttft_p90_ms)} | {fmt(r.stream_tokens_per_s, '.1f')} | {fmt(r.busy_slots_per_decode, '.2f')} | {share} |"
        )
    return "\n".join(lines)


def section(rows: list[Row], cfg: Config) -> str:
    return "## Throughput and latency\n\n" + table(rows)


def targets(rows: list[Row] | None, cfg: Config) -> list[Target]:
    """Batching against the sequential server, the engine limit, Python's share and llama-server at every level, the
    step budget's cost; the slot server against the production server(s) for information."""
    at: Levels = {(r.server, r.concurrency): r for r in rows or []}
    n = max(cfg.concurrency)
    return [
        batching_target(at, n),
        raw_decode_target(at, n),
        *(t for level in cfg.concurrency for t in (python_share_target(at, level), llama_server_target(at, level))),
        budget_target(at, n),
        *production_info(at, n),
    ]


# Continuous batching: n streams share each decode step, so the slot server must give at least twice the aggregate
# tok/s of the sequential server (one stream at a time) at the top level; the raw loop shows what batching can give here.
OVER_SEQUENTIAL = 2.0


def batching_target(at: Levels, n: int) -> Target:
    name = f"slots aggregate tok/s >= {OVER_SEQUENTIAL}x sequential ({n} streams)"
    slots, seq = at.get(("slots", n)), at.get(("sequential", n))
    if not slots or not seq:
        return unmeasured(name)
    r = slots.tokens_per_s / seq.tokens_per_s
    note = ""
    if (raw := at.get((RAW, n))) and (raw1 := at.get((RAW, 1))):  # the most batching can give on this machine, these prompts
        note = f" (headroom here: raw loop {n} sequences / 1 = {raw.tokens_per_s / raw1.tokens_per_s:.2f}x)"
    return Target(name, f"{r:.2f}x{note}", r >= OVER_SEQUENTIAL)


# The server around llama.cpp (HTTP, streaming, scheduling in Python) may cost at most 3 % of the throughput of a plain
# loop decoding the same prompts and tokens in one batch per step (``RawDecoder``): the engine limit.
OF_RAW_DECODE = 0.97


def raw_decode_target(at: Levels, n: int) -> Target:
    name = f"slots aggregate tok/s >= {100 * OF_RAW_DECODE:.0f} % of raw batched decode, same prompts and tokens ({n} sequences)"
    slots, raw = at.get(("slots", n)), at.get((RAW, n))
    if not slots or not raw:
        return unmeasured(name)
    r = slots.tokens_per_s / raw.tokens_per_s
    note = ""
    if slots.stream_tokens_per_s and raw.stream_tokens_per_s:  # the decode phase alone, prompts read
        note = f" (decode phase alone, per stream: {100 * slots.stream_tokens_per_s / raw.stream_tokens_per_s:.0f} %)"
    return Target(name, f"{100 * r:.0f} %{note}", r >= OF_RAW_DECODE)


# Everything in a step but llama_decode (building the batch, sampling, handing out tokens: Python's part) must stay under
# 3 % of the step time (from the slot server's /metrics): a step's time should be llama.cpp's.
PYTHON_SHARE = 0.03


def python_share_target(at: Levels, level: int) -> Target:
    name = f"Python share of slot-server step time < {100 * PYTHON_SHARE:.0f} % ({level} streams)"
    slots = at.get(("slots", level))
    if not slots or slots.python_share is None:
        return unmeasured(name)
    return Target(name, f"{100 * slots.python_share:.1f} %", slots.python_share < PYTHON_SHARE)


# Level with llama-server (the C++ server, built from the same llama.cpp, same flags): at most 5 % behind at every level.
OF_LLAMA_SERVER = 0.95


def llama_server_target(at: Levels, level: int) -> Target:
    name = f"slots aggregate tok/s level with llama-server, >= {OF_LLAMA_SERVER}x ({level} streams)"
    slots, real = at.get(("slots", level)), at.get(("llama-server", level))
    if not slots or not real:
        return unmeasured(name)
    r = slots.tokens_per_s / real.tokens_per_s
    return Target(name, f"{r:.2f}x", r >= OF_LLAMA_SERVER)


# The step budget (prompts read in chunks beside running streams) may cost at most 5 % of the throughput at the top level.
BUDGET_COST = 0.95


def budget_target(at: Levels, n: int) -> Target:
    name = f"slots aggregate tok/s with the step budget >= {BUDGET_COST}x without it ({n} streams)"
    slots, plain = at.get(("slots", n)), at.get((NO_BUDGET, n))
    if not slots or not plain:
        return unmeasured(name)
    r = slots.tokens_per_s / plain.tokens_per_s
    return Target(name, f"{r:.2f}x", r >= BUDGET_COST)


def production_info(at: Levels, n: int) -> list[Target]:
    """For information: the slot server against the production server(s) on the same prompts, at the top level."""
    slots = at.get(("slots", n))
    others = [s for s in dict.fromkeys(server for server, _ in at) if s not in ("sequential", "slots", NO_BUDGET, RAW)]
    out = []
    for other in others:
        if slots and (o := at.get((other, n))):
            ttft = f"{slots.ttft_median_ms / o.ttft_median_ms:.2f}x" if slots.ttft_median_ms and o.ttft_median_ms else "n/a"
            ratios = f"{slots.tokens_per_s / o.tokens_per_s:.2f}x, {ttft}"
            out.append(info(f"slots / {other}: aggregate tok/s, median TTFT ({n} streams)", ratios))
    return out


SCENARIO = Scenario("levels", run, section, targets, shared=True)
