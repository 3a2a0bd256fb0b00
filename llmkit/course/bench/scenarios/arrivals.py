"""Arrivals: a burst of long prompts while streams run; the streams' worst gap, the arrivals' first token."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmkit.course.bench.config import NO_BUDGET, SMALL_BATCH, SMALL_BATCH_FLAGS, Config
from llmkit.course.bench.prompts import TEXTS, long_text
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import ttft
from llmkit.course.bench.servers import Server, http_client, start_small_batch
from llmkit.course.bench.targets import Target, fmt, info, unmeasured
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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[Arrivals]:
    """Every level of ``cfg.arrivals`` on every server started together and on llama-server at the step budget's -b, new
    prompts each time: nothing cached."""
    servers = [*stage.servers, *start_small_batch(cfg, stage.stack)]
    out = []
    for server, k in tqdm([(server, k) for k in cfg.arrivals for server in servers], desc="arrivals", leave=False):
        tag = uuid.uuid4().hex[:12]
        prompts = [long_text(cfg.model, cfg.arrival_tokens, f"Log {tag}-{j}") for j in range(cfg.arrival_prompts)]
        out.append(asyncio.run(arrivals(server, k, prompts, cfg)))
    return out


def table(results: list[Arrivals]) -> str:
    head = ["server", "running", "arrivals", "gap p50 ms", "gap p99 ms", "gap max ms", "arrival TTFT median ms", "arrival TTFT max ms",
            "tok/s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r.server} | {r.running} | {r.arrivals} | {fmt(r.gap_p50_ms)} | {fmt(r.gap_p99_ms)} | {fmt(r.gap_max_ms)} | "
                     f"{fmt(r.arrival_ttft_median_ms)} | {fmt(r.arrival_ttft_max_ms)} | {fmt(r.tokens_per_s, '.1f')} |")  # fmt: skip
    return "\n".join(lines)


def section(results: list[Arrivals], cfg: Config) -> str:
    return (f"## Arrivals ({cfg.arrival_prompts} prompts of ~{cfg.arrival_tokens} tokens at once while streams run)\n\n"
            f"llama-server at its default -b 2048, and at {SMALL_BATCH_FLAGS} (the slot server's step budget).\n\n"
            + table(results))  # fmt: skip


def targets(results: list[Arrivals] | None, cfg: Config) -> list[Target]:
    return [t for k in cfg.arrivals for t in burst_targets(results or [], k)]


# A burst of long prompts while streams run: with the step budget, the running streams' worst wait between two tokens
# must be at most a quarter of what it is without the budget, and of llama-server's at its default -b 2048 (both fill a
# step with prompt tokens up to -b, and the running streams wait for that step) ...
WORST_GAP = 0.25


# ... and level with llama-server's at -b 128 -ub 128, whose every step holds at most as many tokens as the budget
# allows beside a stream: at most 1.5 times its worst gap (the Python around each step, one run on a shared machine) ...
SAME_CAP_GAP = 1.5


# ... while the arrivals' median first token comes at most 1.5 times later than without the budget (their prompts are
# read over more steps).
ARRIVAL_TTFT = 1.5


def burst_targets(burst: Sequence[Arrivals], k: int) -> list[Target]:
    """With ``k`` streams running: the worst gap against no budget and against llama-server at -b 2048 and at the
    budget's -b; the arrivals' first token against no budget, and against llama-server's for information."""
    scene = {b.server: b for b in burst if b.running == k}
    ours, plain = scene.get("slots"), scene.get(NO_BUDGET)
    out = [
        gap_target(ours, plain, k, WORST_GAP, "without it"),
        gap_target(ours, scene.get("llama-server"), k, WORST_GAP, "llama-server's (-b 2048)"),
        gap_target(ours, scene.get(SMALL_BATCH), k, SAME_CAP_GAP, f"llama-server's at {SMALL_BATCH_FLAGS}"),
    ]
    name = f"burst with {k} running: arrivals' median first token with the budget <= {ARRIVAL_TTFT}x without it"
    out.append(unmeasured(name) if not ours or not plain else ttft_target(name, ours, plain))
    big, small = scene.get("llama-server"), scene.get(SMALL_BATCH)
    if ours and big and small:
        name = f"burst with {k} running: arrivals' median first token with the budget / llama-server's at -b 2048, at {SMALL_BATCH_FLAGS}"
        ratios = [ours.arrival_ttft_median_ms / other.arrival_ttft_median_ms for other in (big, small)]
        out.append(info(name, ", ".join(f"{r:.2f}x" for r in ratios)))
    return out


def ttft_target(name: str, ours: Arrivals, plain: Arrivals) -> Target:
    r = ours.arrival_ttft_median_ms / plain.arrival_ttft_median_ms
    return Target(name, f"{r:.2f}x", r <= ARRIVAL_TTFT)


def gap_target(ours: Arrivals | None, base: Arrivals | None, k: int, limit: float, label: str) -> Target:
    name = f"burst with {k} running: worst gap between two tokens with the budget <= {limit}x {label}"
    if not ours or not base or ours.gap_max_ms is None or not base.gap_max_ms:
        return unmeasured(name)
    r = ours.gap_max_ms / base.gap_max_ms
    return Target(name, f"{r:.2f}x", r <= limit)


SCENARIO = Scenario("arrivals", run, section, targets, wanted=lambda cfg: bool(cfg.arrivals), shared=True)
