"""API streaming cost: the same streams through chat, Responses and Messages, at 1 and 8 streams."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmkit.course.bench.config import Config
from llmkit.course.bench.prompts import TEXTS
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import Row, median_run, one_level, rotated
from llmkit.course.bench.servers import APIS, Server, http_client, through
from llmkit.course.bench.targets import Target, fmt, info, unmeasured

if TYPE_CHECKING:
    import httpx


API_SERVERS = ("slots", "llama-server")  # the servers started here that speak all three chat APIs
API_TEXT = TEXTS[0]  # its greedy translation repeats itself: runs past any budget, also where ignore_eos cannot be asked
ApiRuns = dict[tuple[str, int, str], list[tuple[Row, float | None]]]  # (server, level, API) -> each round's row and CPU ms/token


@dataclass(frozen=True)
class ApiStreaming:
    """One server, level and API of ``api_streaming``: the median round's numbers, and its tok/s against chat's."""

    server: str
    api: str  # "chat", "responses" or "messages"
    streams: int
    rounds: int
    budget: int  # the tokens asked for: streams x max_tokens
    tokens: int  # generated in the median round, counted from each API's usage
    min_tokens: int  # the fewest of any round: below ``budget``, a stream ended before it
    seconds: float
    tokens_per_s: float
    ttft_median_ms: float | None
    stream_tokens_per_s: float | None
    cpu_ms_per_token: float | None  # the server process's CPU time per generated token, median of the rounds (None: not started here)
    ratio: float  # the median of the rounds' tok/s over chat's in the same round (chat: 1.0)
    ratio_low: float  # the lowest and highest of those ratios; for chat, its rounds over their median: the machine's noise
    ratio_high: float
    ratios: list[float]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far, in seconds (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


async def api_streaming(servers: list[Server], cfg: Config) -> list[ApiStreaming]:
    """Does streaming through the Responses or Messages API cost more than through chat? For each level
    ``n`` in ``cfg.api_levels``, every server of ``API_SERVERS`` streams the same ``n`` requests through
    each API (``servers.through``): the same greedy prompt (the translation of ``API_TEXT``) and budget
    (``cfg.max_tokens``) in each API's own body. Chat and Responses ask for ``ignore_eos``; Messages has
    no such field, so the prompt is one whose answer runs past the budget, and every API's tokens are
    counted from the usage it sends (``tokens`` shows any stream that ended early). Prompts are cached
    (Messages has no ``cache_prompt`` either): every API reads the same ~1 new prompt token per stream.

    Noise: ``cfg.api_rounds`` rounds (``api_rounds``); each API's tok/s is divided by chat's of the same
    round (``api_summary``). One ``ApiStreaming`` per server, level and API.
    """
    servers = [s for s in servers if s.name in API_SERVERS]
    if not servers or not cfg.api_levels:
        return []
    runs = await api_rounds(servers, cfg)
    return [api_summary(runs, s.name, n, api, n * cfg.max_tokens) for s in servers for n in cfg.api_levels for api in APIS]


async def api_rounds(servers: list[Server], cfg: Config) -> ApiRuns:
    """Level by level and round by round, every server in turn streams through the three APIs back to back (both
    orders rotating each round): {(server, level, API): [(its row, the server's CPU ms per token) for each round]}."""
    cached = dataclasses.replace(cfg, cache_prompt=True)
    runs: ApiRuns = {}
    async with http_client(max(cfg.api_levels), keepalive=False) as http:  # back-to-back streams: no closing connection reused
        for server in servers:  # first-request costs are not measured; every slot holds the prompt
            await asyncio.gather(*(through(server, "chat").translate(http, API_TEXT, 4) for _ in range(max(cfg.api_levels))))
            for api in APIS:
                await through(server, api).translate(http, API_TEXT, 4)
        total = cfg.api_rounds * len(servers) * len(APIS) * sum(cfg.api_levels)
        with tqdm(total=total, desc="API streaming", unit="stream") as bar:
            for n in cfg.api_levels:
                for r in range(cfg.api_rounds):
                    for server in rotated(servers, r):
                        for api in rotated(list(APIS), r):  # no API always goes first
                            bar.set_postfix_str(f"{server.name} {api} x{n}")
                            run = await cpu_timed_level(http, through(server, api), n, cached, bar)
                            runs.setdefault((server.name, n, api), []).append(run)
    return runs


async def cpu_timed_level(http: httpx.AsyncClient, server: Server, n: int, cfg: Config, bar: tqdm) -> tuple[Row, float | None]:
    """``one_level`` on ``API_TEXT``, and the server's CPU milliseconds per generated token (None if it was not started here)."""
    pid = server.pid
    cpu0 = cpu_seconds(pid) if pid else 0.0
    row = await one_level(http, server, n, cfg, bar, texts=[API_TEXT])
    return row, 1e3 * (cpu_seconds(pid) - cpu0) / row.tokens if pid else None


def api_summary(runs: ApiRuns, server: str, n: int, api: str, budget: int) -> ApiStreaming:
    """One API's rounds: the median round's numbers (as ``all_levels``), the median CPU time per token, and the ratios
    to chat's tok/s round by round; for chat itself, its rounds against their median (how much the machine alone moves)."""
    mine = runs[(server, n, api)]
    chat = [row.tokens_per_s for row, _ in runs[(server, n, "chat")]]
    if api == "chat":
        ratios = [c / float(np.median(chat)) for c in chat]
    else:
        ratios = [row.tokens_per_s / c for (row, _), c in zip(mine, chat, strict=True)]
    median = median_run([row for row, _ in mine])
    cpu = [ms for _, ms in mine if ms is not None]
    return ApiStreaming(
        server=server,
        api=api,
        streams=n,
        rounds=len(mine),
        budget=budget,
        tokens=median.tokens,
        min_tokens=min(row.tokens for row, _ in mine),
        seconds=median.seconds,
        tokens_per_s=median.tokens_per_s,
        ttft_median_ms=median.ttft_median_ms,
        stream_tokens_per_s=median.stream_tokens_per_s,
        cpu_ms_per_token=float(np.median(cpu)) if cpu else None,
        ratio=1.0 if api == "chat" else float(np.median(ratios)),
        ratio_low=min(ratios),
        ratio_high=max(ratios),
        ratios=ratios,
    )


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[ApiStreaming]:
    return asyncio.run(api_streaming(stage.servers, cfg))


def table(results: list[ApiStreaming]) -> str:
    """One row per server, level and API: the median round's numbers, the median ratio to chat and the rounds' range."""
    columns = ["server", "streams", "API", "tokens", "wall s", "aggregate tok/s", "/ chat", "range over rounds", "TTFT median ms",
               "per-stream tok/s", "server CPU ms/token"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        tokens = f"{r.tokens}" + ("" if r.min_tokens == r.budget else f" (fewest {r.min_tokens} of {r.budget})")
        lines.append(f"| {r.server} | {r.streams} | {r.api} | {tokens} | {r.seconds:.2f} | {r.tokens_per_s:.1f} | {r.ratio:.3f} | "
                     f"{r.ratio_low:.2f}-{r.ratio_high:.2f} | {fmt(r.ttft_median_ms)} | {fmt(r.stream_tokens_per_s, '.1f')} | "
                     f"{fmt(r.cpu_ms_per_token, '.2f')} |")  # fmt: skip
    return "\n".join(lines)


def section(apis: list[ApiStreaming], cfg: Config) -> str:
    return (
        f"## Streaming through each chat API ({cfg.max_tokens} tokens per stream, median of {cfg.api_rounds} rounds)\n\n"
        "The same greedy prompt through chat, Responses and Messages, back to back in every round (chat and Responses with "
        "ignore_eos; Messages has none, and the prompt's answer runs past the budget); tokens from each API's usage. "
        "/ chat: the median of the ratios to chat's tok/s in the same round; range: their lowest and highest (for chat, its "
        "rounds against their median: what the machine alone moves). Server CPU: the server process's CPU time per generated "
        f"token. Target: on the slot server, >= {API_RATIO}x chat; a ratio below that fails only if it is also below chat's "
        "own lowest round (else this run cannot tell, and says so).\n\n" + table(apis)
    )


def targets(apis: list[ApiStreaming] | None, cfg: Config) -> list[Target]:
    return api_targets(apis or [], cfg.api_levels)


# Streaming through the Responses or Messages API (other events around the same tokens) may cost at most 3 % of chat's
# tok/s on the slot server. The machine alone moves chat's tok/s from round to round: a ratio below this fails only if
# it is also below chat's own lowest round, else this run cannot tell.
API_RATIO = 0.97


def api_targets(apis: Sequence[ApiStreaming], levels: Sequence[int]) -> list[Target]:
    """Per level: Responses and Messages against chat on the slot server; llama-server's ratios for information."""
    at = {(a.server, a.api, a.streams): a for a in apis}
    out = []
    for level in levels:
        chat = at.get(("slots", "chat", level))
        out += [api_target(at.get(("slots", name, level)), chat, name, level) for name in ("responses", "messages")]
        responses, messages = (at.get(("llama-server", name, level)) for name in ("responses", "messages"))
        if responses and messages:
            out.append(info(f"llama-server streaming through responses, messages: aggregate tok/s / chat's ({level} streams)",
                            f"{responses.ratio:.3f}x, {messages.ratio:.3f}x"))  # fmt: skip
    return out


def api_target(a: ApiStreaming | None, chat: ApiStreaming | None, api: str, level: int) -> Target:
    name = f"slots streaming through {api}: aggregate tok/s >= {API_RATIO}x chat's ({level} streams)"
    if not a or not chat:
        return unmeasured(name)
    shown = f"{a.ratio:.3f}x (rounds {a.ratio_low:.2f}-{a.ratio_high:.2f}; chat's own rounds {chat.ratio_low:.2f}-{chat.ratio_high:.2f})"
    if a.min_tokens < a.budget:
        shown += f", fewest tokens {a.min_tokens} of {a.budget}"
    if a.ratio >= API_RATIO:
        return Target(name, shown, True)
    if a.ratio < chat.ratio_low:  # slower than chat ever was against itself: beyond this run's noise
        return Target(name, shown, False)
    return Target(name, shown + ": within chat's own spread, not judged", None)  # the machine moved chat alone further than that


SCENARIO = Scenario("apis", run, section, targets, wanted=lambda cfg: bool(cfg.api_levels), shared=True)
