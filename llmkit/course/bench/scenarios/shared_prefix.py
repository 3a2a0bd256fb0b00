"""The shared-prefix scenario: a burst of clients, one long system prompt, each its own short question.

One tenant's system prompt (or an agent's tool list) in front of every request is the traffic production servers get.
Three servers are started side by side, each with ``-np N -kvu`` for the largest burst: llama-server, the slot server
as llama-server keeps its cache (a prefix lives in one slot's sequence), and the slot server with ``--kv-share`` (a
prefix's KV cells held once and taken by every request: ``EngineConfig.kv_share``). In each round, for each burst size,
a new system prompt (nothing cached) goes to each server in turn (the order rotated from round to round), from every
client at once. Per server and burst: the prompt tokens it computed (what it read, not what it took from cells), the
median first-token time and the aggregate tokens/s, each the median of the rounds.

Then the same three servers each replay a multi-tenant, multi-turn trace (``course.trace``: tenants' system prompts,
conversations that grow, arrivals at random; fresh text each run), in turn: prompt tokens computed, TTFT p50 and p99,
tokens/s, and the KV cells the slot server's slots hold at the end (``llamacpp:kv_cells_used``).

    llmkit bench --skip levels apis prefix arrivals kv-cache speculation priority fleet    # this scenario alone

Targets (``targets``): with ``--kv-share`` the slot server computes at most 1.1 x the least a burst can (the prefix
once and every question) where llama-server computes the prefix once per client; its median first token comes in at
most half llama-server's time, and its aggregate tokens/s is at least 1.5 x llama-server's.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from llmkit import models
from llmkit.course import launch
from llmkit.course.bench.config import Config
from llmkit.course.bench.prompts import long_system_prompt
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.servers import OpenAIServer, http_client, server_flags
from llmkit.course.bench.targets import Target
from llmkit.course.client import StreamResult
from llmkit.course.trace import make_trace, replay, summarize
from llmkit.engine.tokens import common_prefix
from llmkit.llama import Model

PREFIX_TOKENS = 700  # the system prompt every client sends
ANSWER_TOKENS = 16  # short answers: the prompt is most of the work
CTX_PER_CLIENT = 1024  # -c is this times the largest burst: room for every client's own copy (llama-server needs it)
SERVERS = {  # name -> (kind, flags beyond -np N -kvu)
    "llama-server": ("llama-server", ()),
    "slots": ("slots", ()),
    "slots --kv-share": ("slots", ("--kv-share",)),
}
QUESTIONS = [f"Which item is on shelf {k}? Answer in one short sentence." for k in range(3, 40)]
TRACE_TENANTS, TRACE_TURNS = 4, 3  # the trace's shape: tenants, turns a conversation (its conversations: Config.shared_trace)


@dataclass(frozen=True)
class SharedPrefix:
    """One server at one burst size, medians of the rounds."""

    server: str
    clients: int
    prompt_tokens: int  # prompt tokens computed, summed over the burst (read by the model, not taken from cells)
    once: int  # the least that can be computed: the prompts' common prefix once, and each prompt's rest
    ttft_ms: float  # the burst's median first-token time
    tokens_per_s: float  # generated tokens / the burst's wall time


@dataclass(frozen=True)
class TraceRun:
    """One server replaying the trace, medians of the rounds."""

    server: str
    prompt_tokens: int  # prompt tokens computed over the trace (its prompts' tokens less those read from a cache)
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    cells: int | None  # the KV cells its slots hold at the end (llama-server: not told)


def computed(s: StreamResult) -> int:
    """The prompt tokens one request computed: its timings' prompt_n (both servers write it in the last chunk)."""
    for event in (s.final, s.usage):
        if isinstance(event, dict) and isinstance(timings := event.get("timings"), dict):
            return int(timings["prompt_n"])
    usage = s.usage or {}
    return int(usage.get("prompt_tokens", 0)) - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def burst(server: OpenAIServer, bodies: list[dict]) -> tuple[int, list[float], float, int]:
    """Every body at once: (prompt tokens computed, first-token times, wall seconds, tokens generated)."""
    async with http_client(len(bodies), keepalive=False) as http:
        streams = await asyncio.gather(*(server.stream(http, body) for body in bodies))
    t0, t1 = min(s.t_sent for s in streams), max(s.t_done for s in streams)
    generated = sum(int((s.usage or {}).get("completion_tokens", len(s.pieces))) for s in streams)
    return sum(map(computed, streams)), [s.ttft for s in streams], t1 - t0, generated


def least(model: Model, bodies: list[dict]) -> int:
    """The prompts' common prefix once and each one's rest, in tokens: the least a burst of ``bodies`` can compute."""
    prompts = [model.tokenize_chat(body["messages"]) for body in bodies]
    common = min(common_prefix(p, prompts[0]) for p in prompts)
    return common + sum(len(p) - common for p in prompts)


@dataclass(frozen=True)
class SharedPrefixRuns:
    """The scenario's results: every server at every burst size, and every server's replay of the trace."""

    bursts: list[SharedPrefix]
    trace: list[TraceRun]


def run(cfg: Config, stage: Stage) -> SharedPrefixRuns:
    """The three servers started together: every burst size in every round, then the trace in every round, the servers
    in turn (rotated from round to round)."""
    n_max = max(cfg.shared_bursts, default=2)
    flags = [*server_flags(cfg), "-np", str(n_max), "-kvu", "-c", str(n_max * CTX_PER_CLIENT), "--metrics"]
    chosen = {name: spec for name, spec in SERVERS.items() if spec[0] not in cfg.skip}
    if not chosen or not (cfg.shared_bursts or cfg.shared_trace):
        return SharedPrefixRuns([], [])
    servers = {name: stage.stack.enter_context(launch.serve(kind, *flags, *extra)) for name, (kind, extra) in chosen.items()}
    clients = {name: OpenAIServer(name, p.url) for name, p in servers.items()}
    return SharedPrefixRuns(burst_runs(cfg, clients), trace_runs(cfg, clients))


def in_turn(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: each round starts with the next server."""
    return names[r % len(names) :] + names[: r % len(names)]


def burst_runs(cfg: Config, clients: dict[str, OpenAIServer]) -> list[SharedPrefix]:
    results: dict[tuple[str, int], list[tuple[int, int, float, float]]] = {}
    with Model(models.resolve_model(cfg.model)) as model:
        for r in tqdm(range(cfg.rounds if cfg.shared_bursts else 0), desc="shared prefix", leave=False):
            for n in cfg.shared_bursts:
                for name in in_turn(list(clients), r):
                    system = long_system_prompt(cfg.model, PREFIX_TOKENS)  # new to every burst: nothing cached
                    bodies = [clients[name].request(QUESTIONS[k], ANSWER_TOKENS, system=system) for k in range(n)]
                    tokens, ttfts, seconds, generated = asyncio.run(burst(clients[name], bodies))
                    once = least(model, bodies)
                    results.setdefault((name, n), []).append((tokens, once, statistics.median(ttfts) * 1e3, generated / seconds))
    return [median_of(name, n, rs) for (name, n), rs in results.items()]


def trace_runs(cfg: Config, clients: dict[str, OpenAIServer]) -> list[TraceRun]:
    """The trace on each server, fresh text each time (nothing of an earlier run cached): medians of the rounds."""
    rows: dict[str, list[tuple[float, ...]]] = {}
    for r in tqdm(range(cfg.rounds if cfg.shared_trace else 0), desc="shared prefix, trace", leave=False):
        trace = make_trace(seed=r, tenants=TRACE_TENANTS, conversations=cfg.shared_trace, turns=TRACE_TURNS, rate=0.5, think=1.0)
        for name in in_turn(list(clients), r):
            s = summarize(replay(trace.fresh(f"{name} {r}"), clients[name].url, max_tokens=ANSWER_TOKENS))
            cells = asyncio.run(cells_held(clients[name]))
            rows.setdefault(name, []).append((s.prompt_tokens - s.cached_tokens, s.ttft_p50 * 1e3, s.ttft_p99 * 1e3, s.tokens_per_s, cells))
    return [trace_median(name, runs) for name, runs in rows.items()]


def trace_median(name: str, rounds: list[tuple[float, ...]]) -> TraceRun:
    tokens, p50, p99, rate, cells = (statistics.median(column) for column in zip(*rounds, strict=True))
    return TraceRun(name, int(tokens), p50, p99, rate, None if math.isnan(cells) else int(cells))


async def cells_held(server: OpenAIServer) -> float:
    """The KV cells its slots hold now (``llamacpp:kv_cells_used``, llmkit's own; nan: a server that does not tell)."""
    async with http_client(1) as http:
        scraped = await server.scrape(http) or {}
    return scraped.get("llamacpp:kv_cells_used", math.nan)


def median_of(name: str, clients: int, rounds: list[tuple[int, int, float, float]]) -> SharedPrefix:
    tokens, once, ttft, rate = (statistics.median(column) for column in zip(*rounds, strict=True))
    return SharedPrefix(name, clients, int(tokens), int(once), ttft, rate)


def trace_table(results: Sequence[TraceRun]) -> str:
    lines = [
        "| server | prompt tokens computed | TTFT p50 ms | TTFT p99 ms | tok/s | KV cells held at the end |",
        "|---|---|---|---|---|---|",
    ]
    for t in sorted(results, key=lambda t: t.server):
        cells = "" if t.cells is None else str(t.cells)
        lines.append(f"| {t.server} | {t.prompt_tokens} | {t.ttft_p50_ms:.0f} | {t.ttft_p99_ms:.0f} | {t.tokens_per_s:.1f} | {cells} |")
    return "\n".join(lines)


def table(results: Sequence[SharedPrefix]) -> str:
    lines = ["| server | clients | prompt tokens computed | / the least | TTFT median ms | tok/s |", "|---|---|---|---|---|---|"]
    for s in sorted(results, key=lambda s: (s.clients, s.server)):
        lines.append(f"| {s.server} | {s.clients} | {s.prompt_tokens} | {s.prompt_tokens / s.once:.2f}x | {s.ttft_ms:.0f} | "
                     f"{s.tokens_per_s:.1f} |")  # fmt: skip
    return "\n".join(lines)


SHARE_COMPUTED = 1.1  # --kv-share: prompt tokens computed / the least, at most
SHARE_TTFT = 0.5  # --kv-share / llama-server: median first-token time, at most
SHARE_TOKENS_PER_S = 1.5  # --kv-share / llama-server: aggregate tokens/s, at least


def targets(runs: SharedPrefixRuns | None, cfg: Config) -> list[Target]:
    """For each burst size: the three ratios above (a server not measured: its lines left out)."""
    results = runs.bursts if runs is not None else []
    out = []
    for n in sorted({s.clients for s in results}):
        share = next((s for s in results if s.server == "slots --kv-share" and s.clients == n), None)
        llama = next((s for s in results if s.server == "llama-server" and s.clients == n), None)
        if share is None:
            continue
        computed = share.prompt_tokens / share.once
        out.append(Target(f"slots --kv-share, {n} clients: prompt tokens computed <= {SHARE_COMPUTED}x the least", f"{computed:.2f}x",
                          computed <= SHARE_COMPUTED))  # fmt: skip
        if llama is None:
            continue
        ttft, rate = share.ttft_ms / llama.ttft_ms, share.tokens_per_s / llama.tokens_per_s
        name = f"slots --kv-share / llama-server, {n} clients: median TTFT <= {SHARE_TTFT}x"
        out.append(Target(name, f"{ttft:.2f}x", ttft <= SHARE_TTFT))
        out.append(Target(f"slots --kv-share / llama-server, {n} clients: tok/s >= {SHARE_TOKENS_PER_S}x", f"{rate:.2f}x",
                          rate >= SHARE_TOKENS_PER_S))  # fmt: skip
    return out


def section(runs: SharedPrefixRuns, cfg: Config) -> str:
    """The bursts' table and the trace's, each if it ran."""
    parts = []
    if runs.bursts:
        parts.append(f"## Shared prefix (a burst of clients, one ~{PREFIX_TOKENS}-token system prompt, {ANSWER_TOKENS}-token answers; "
                     f"-np {max(cfg.shared_bursts)} -kvu on each server)\n\n" + table(runs.bursts))  # fmt: skip
    if runs.trace:
        parts.append(f"## Shared prefix, a trace on one server ({cfg.shared_trace} conversations of {TRACE_TURNS} turns over "
                     f"{TRACE_TENANTS} tenants, {ANSWER_TOKENS}-token answers; medians of {cfg.rounds} rounds)\n\n"
                     + trace_table(runs.trace))  # fmt: skip
    return "\n\n".join(parts)


SCENARIO = Scenario("shared-prefix", run, section, targets)
