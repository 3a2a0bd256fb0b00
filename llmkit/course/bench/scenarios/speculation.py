"""Speculation: draft-free speculative decoding, with and without, on the same server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from llmkit.course import launch
from llmkit.course.bench.config import SPEC_MODES, SPEC_SLOW_START, BenchError, Config, spec_mode
from llmkit.course.bench.prompts import spec_prompts
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.scenarios.levels import python_share, rotated
from llmkit.course.bench.servers import OpenAIServer, Server, http_client, server_flags
from llmkit.course.bench.targets import Target, info, percent, unmeasured

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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[Speculation]:
    """The slot server with each --spec-type, without and with a slow start (speculation off per request for the
    answers without), and llama-server without speculation and with each (unless skipped): all started here, side by
    side, for the whole scenario."""
    flags = [*server_flags(cfg), "-np", str(max(cfg.spec_streams)), "-c", str(max(cfg.spec_streams) * cfg.ctx_per_slot)]
    servers: list[SpecServer] = []
    with contextlib.ExitStack() as stack:
        if "slots" not in cfg.skip:
            for mode in SPEC_MODES:
                for slow_start in (0, SPEC_SLOW_START):
                    settings = ("--spec-type", mode, "--spec-slow-start", str(slow_start))
                    url = stack.enter_context(launch.serve("slots", *flags, "--metrics", *settings)).url
                    servers.append(SpecServer("slots", spec_mode(mode, slow_start), url, url, {"speculative.n_max": 0}))
        if "llama-server" not in cfg.skip:
            plain = stack.enter_context(launch.serve("llama-server", *flags)).url
            for mode in SPEC_MODES:
                url = stack.enter_context(launch.serve("llama-server", *flags, "--spec-type", mode)).url
                servers.append(SpecServer("llama-server", mode, url, plain))
        return asyncio.run(speculation(servers, cfg)) if servers else []


def table(results: list[Speculation]) -> str:
    head = ["server", "--spec-type", "prompts", "streams", "tok/s without", "tok/s with", "speedup", "range over rounds", "drafted",
            "accepted", "acceptance", "same answer as without", "Python share of step"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        acceptance, share = percent(r.acceptance), percent(r.python_share, ".1f")
        lines.append(f"| {r.server} | {r.mode} | {r.prompts} | {r.streams} | {r.plain_tokens_per_s:.1f} | {r.tokens_per_s:.1f} | "
                     f"{r.speedup:.2f}x | {r.speedup_low:.2f}-{r.speedup_high:.2f} | {r.draft_n} | {r.draft_n_accepted} | {acceptance} | "
                     f"{r.same_answers} of {r.answers} | {share} |")  # fmt: skip
    return "\n".join(lines)


def section(results: list[Speculation], cfg: Config) -> str:
    return (
        f"## Speculative decoding without a draft model ({cfg.max_tokens} tokens per answer, median of {cfg.rounds} "
        f"round{'s' * (cfg.rounds > 1)})\n\n"
        "Native /completion, greedy, ignore_eos, no cached prompt; at n streams, n clients each send every prompt of the kind "
        "in turn. Copy: a source file's copy begun after it, a JSON document to rewrite, a paragraph to quote; free: a story, "
        "an essay. The slot server is started once per --spec-type and answers without speculation when a request says "
        '"speculative.n_max": 0; llama-server (speculation per server only) is started without it and once per mode. '
        "Speedup: tok/s with / without, measured back to back in each round, the median of the rounds. Same answer: the "
        "speculative answers equal to the same server's without speculation (same prompt, level and round; batch numerics "
        "can tip a greedy choice).\n\n" + table(results)
    )


# Speculation where answers repeat their prompt: the slot server's speedup (its best --spec-type) at least llama-server's
# (its best ngram mode) at 1 stream, each against the same server without speculation, on the same prompts ...
SPEC_OVER_LLAMA_SERVER = 1.0


# ... and a gain at more streams, where a step's batch holds every stream's drafts (the step costs more, and fewer
# steps are saved) ...
SPEC_GAIN = 1.0


# ... while on free text (few drafts, mostly cut) every mode with the slow start costs at most 3 % of the tok/s without
# speculation (without it, as llama-server, a long draft cut at once costs ~20 one-token steps: shown, not judged).
SPEC_FREE_TEXT = 0.97


def targets(results: list[Speculation] | None, cfg: Config) -> list[Target]:
    """Copy-heavy prompts: the slot server's best speedup against llama-server's best at the first level, above 1 at the
    others; free text: each mode of the slot server with its slow start against no speculation; same answers and
    acceptance for information."""
    if results is None:  # not run: no line
        return []
    at = {(r.server, r.mode, r.prompts, r.streams): r for r in results}

    def best(server: str, kind: str, n: int) -> Speculation | None:
        mine = [r for r in results if (r.server, r.prompts, r.streams) == (server, kind, n)]
        return max(mine, key=lambda r: r.speedup, default=None)

    def streams(n: int) -> str:
        return f"{n} stream{'s' * (n > 1)}"

    first, *others = cfg.spec_streams
    name = (
        f"slots speculation speedup on copy-heavy prompts >= {SPEC_OVER_LLAMA_SERVER}x llama-server's, best mode of each ({streams(first)})"
    )
    ours, real = best("slots", "copy", first), best("llama-server", "copy", first)
    if ours and real:
        ratio = ours.speedup / real.speedup
        shown = f"{ratio:.2f}x ({ours.mode} {ours.speedup:.2f}x, llama-server {real.mode} {real.speedup:.2f}x)"
        out = [Target(name, shown, ratio >= SPEC_OVER_LLAMA_SERVER)]
    else:
        out = [unmeasured(name)]
    for n in others:
        name = f"slots speculation speedup on copy-heavy prompts > {SPEC_GAIN}x, best mode ({streams(n)})"
        ours = best("slots", "copy", n)
        out.append(Target(name, f"{ours.speedup:.2f}x ({ours.mode})", ours.speedup > SPEC_GAIN) if ours else unmeasured(name))
    for n in cfg.spec_streams:
        for mode in (spec_mode(m, SPEC_SLOW_START) for m in SPEC_MODES):
            name = f"slots {mode} on free text: tok/s >= {SPEC_FREE_TEXT}x without speculation ({streams(n)})"
            if (free := at.get(("slots", mode, "free", n))) is None:
                out.append(unmeasured(name))
                continue
            shown = f"{free.speedup:.3f}x (rounds {free.speedup_low:.2f}-{free.speedup_high:.2f})"
            out.append(Target(name, shown, free.speedup >= SPEC_FREE_TEXT))
    for server, mode in dict.fromkeys((r.server, r.mode) for r in results):
        mine = [r for r in results if (r.server, r.mode) == (server, mode)]
        shown = "; ".join(f"{r.prompts} x{r.streams}: {r.same_answers}/{r.answers}, {percent(r.acceptance)}" for r in mine)
        out.append(info(f"{server} {mode}: answers same as without speculation, draft acceptance", shown))
    return out


SCENARIO = Scenario("speculation", run, section, targets, wanted=lambda cfg: bool(cfg.spec_streams))
