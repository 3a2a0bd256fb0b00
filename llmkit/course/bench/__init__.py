"""``llmkit bench``: the servers side by side, through HTTP, at 1, 2, 4 and 8 concurrent streams.

    llmkit bench                                   # sequential vs slot server (both started here)
    llmkit bench --url llama-server=http://127.0.0.1:8081 --soak 1000

What one run measures (and writes to ``bench-results/``: results.md, results.json, bench.png):

- an "engine limit": a plain loop on ``llmkit.llama`` decoding 1..8 sequences in
  one batch per step, no server (``RawDecoder``);
- every server at every concurrency level (``levels.all_levels``): each client
  sends one streamed request; aggregate tokens/s = all generated tokens / (first
  request sent -> last stream done), time to first token (TTFT), tokens/s per
  stream, and from ``/metrics`` busy slots per decode and Python's share of each step;
- API streaming cost (``scenarios.api_streaming``), on the slot server and llama-server:
  the same greedy streams through chat, Responses and Messages at 1 and 8 streams,
  back to back in each of 5 rounds: aggregate tokens/s per API and its ratio to chat's;
- prefix reuse (``scenarios.prefix_reuse``): TTFT of a request with a new ~800-token
  system prompt (cold) vs the next ones that share it (warm);
- arrivals (``scenarios.arrivals``): a burst of long prompts while 1 or 4 streams run, on
  every server and on llama-server at ``-b 128 -ub 128`` too (its batch capped at the slot
  server's step budget);
- the KV cache beyond one slot (``scenarios.kv_cache``), on the slot server and
  llama-server started with 2 slots and ``--cache-reuse``: a long prefix back from
  the host-RAM prompt cache on another slot, and an edited chat;
- speculation (``scenarios.speculation``): draft-free speculative decoding, the slot server started
  once per ``--spec-type`` (``ngram-simple``, ``ngram-mod``) and asked without speculation per request
  (``"speculative.n_max": 0``), llama-server (speculation per server only) started without it and once
  per mode; greedy ``/completion`` answers to copy-heavy prompts (continue a copy of a file, rewrite a
  JSON document, quote a paragraph) and to free text, 1 and 4 clients, with and without back to back in
  each round: tok/s and the speedup, draft acceptance (``draft_n_accepted / draft_n`` from the
  timings), and how many speculative answers equal the same server's answer without;
- priority (``scenarios.priority``): a slot server of 2 slots streaming long low-priority answers when a
  high-priority request comes: its time to first token on a server that makes it wait for a slot (llama-server's
  policy: llama-server itself has no priorities) and on ones that preempt (``--scheduling-policy priority``), the
  preempted answer's KV cache kept in the host-RAM prompt cache or read again (``--cache-ram 0``), and whether the
  preempted answers came out as on the server that never preempts;
- fleet (``scenarios.fleet_runs``): vllm-router's policies (round_robin, power_of_two, consistent_hash, cache_aware,
  kv_aware) in front of 2 replicas (``-t 1``) of the slot server (with ``--kv-events``) and of llama-server (no events:
  no kv_aware), a fresh fleet per policy, the same seeded multi-tenant trace (``llmkit.course.trace``): the share of
  prompt tokens served from cache, TTFT p50 and p99, tokens/s, requests per replica;
- with ``--soak N``: N short requests with distinct prefixes to a slot server with
  4 slots of 2048 tokens and ``--cache-ram 64``, its resident memory sampled every
  100 requests (``scenarios.soak``);
- with ``--greedy-runs R``: chapter 6's 8 reviews, greedy, on an in-process ``Engine``
  with 4 slots of one KV stream each: answered alone, then R times all at once; how many
  batched answers differ from alone (``scenarios.greedy_drift``; information, no target);
- the targets, judged on ratios (``targets.judge``).

Every server gets the same prompts: the sequential server's translation prompt,
sent to OpenAI-compatible servers as the chat message it renders to, so every
server evaluates the same tokens. OpenAI-compatible requests use
``ignore_eos`` so that every stream generates exactly ``max_tokens`` tokens, and
``cache_prompt: false`` in the concurrency levels (no server reuses a previous
level's prompt; ``--cache-prompt`` turns that off); prefix reuse has its own scenario. The speculation
scenario is the exception: native ``/completion`` prompts of its own (``prompts.spec_prompts``), no chat
template, not streamed, so that each answer's ``timings`` (drafts, acceptances) come back.

Any scenario runs alone by skipping the others, e.g. speculation only:
``llmkit bench --skip levels apis prefix arrivals kv-cache``.

The package, one role per module:

    config     Config, the names shared by every part
    prompts    the texts, the translation prompt, long made-up texts of N tokens
    servers    SequentialServer, OpenAIServer: each kind's request and stream; starting them
    levels     the concurrency levels (all_levels, Row) and RawDecoder: the same work on llama.cpp alone
    scenarios/ what else is measured, one module per scenario: apis, prefix, arrivals, kv_cache, speculation,
               priority, fleet, soak, greedy, shared_prefix
    targets    Target, judge: each target computed on the run's ratios, with its threshold
    report     tables, plot, and the files written
    run() (here) runs them all and writes the results
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from llmkit.course import launch
from llmkit.course.bench import report
from llmkit.course.bench.config import (
    CACHE_REUSE,
    FLEET_FLAGS,
    NO_BUDGET,
    PRIORITY_SERVERS,
    PRIORITY_SLOTS,
    RAW,
    SMALL_BATCH,
    SOAK_CACHE_RAM_MIB,
    SPEC_MODES,
    SPEC_SLOW_START,
    BenchError,
    Config,
    spec_mode,
)
from llmkit.course.bench.levels import RawDecoder, Row, all_levels
from llmkit.course.bench.prompts import LANG, TEXTS, chat_prompt, edited_chat, long_system_prompt, long_text
from llmkit.course.bench.scenarios import Measured, shared_prefix
from llmkit.course.bench.scenarios.apis import api_streaming
from llmkit.course.bench.scenarios.arrivals import Arrivals, arrivals
from llmkit.course.bench.scenarios.fleet import FleetRun, fleet_runs
from llmkit.course.bench.scenarios.greedy import greedy_drift
from llmkit.course.bench.scenarios.kv_cache import KvCache, kv_cache
from llmkit.course.bench.scenarios.prefix import PrefixReuse, prefix_reuse
from llmkit.course.bench.scenarios.priority import Priority, priority
from llmkit.course.bench.scenarios.soak import Soak, soak
from llmkit.course.bench.scenarios.speculation import SpecServer, Speculation, speculation
from llmkit.course.bench.servers import OpenAIServer, SequentialServer, Server, server_flags, start_servers, start_small_batch
from llmkit.course.bench.targets import Target, judge

__all__ = [
    "LANG", "NO_BUDGET", "PRIORITY_SERVERS", "RAW", "SMALL_BATCH", "TEXTS", "BenchError", "Config", "Measured", "OpenAIServer",
    "RawDecoder", "Results", "Row", "SequentialServer", "Server", "Target", "chat_prompt", "long_system_prompt", "long_text", "run",
]  # fmt: skip


@dataclass(kw_only=True)
class Results(Measured):
    """What was measured, the targets judged on it, and what was written: results.md's text and where it and the plot are."""

    targets: list[Target]
    markdown: str
    table_path: Path
    plot_path: Path | None  # None: no concurrency levels measured, no plot


def run(cfg: Config) -> Results:
    """Every scenario on every server not skipped; the tables, plot and JSON written to ``cfg.out``."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    measured = measure(cfg)
    targets = judge(measured, cfg)
    plot_path, table_path = (cfg.out / "bench.png" if measured.rows else None), cfg.out / "results.md"
    if plot_path is not None:  # the plot is of the concurrency levels: none when they were skipped
        report.plot(measured.rows, plot_path)
    markdown = report.markdown(measured, targets, cfg)
    table_path.write_text(markdown)
    (cfg.out / "results.json").write_text(json.dumps(report.data(measured, targets, cfg), indent=2))
    return Results(**vars(measured), targets=targets, markdown=markdown, table_path=table_path, plot_path=plot_path)


def measure(cfg: Config) -> Measured:
    """The scenarios not skipped: first those on the servers started together (and the raw loop), then those that
    start servers of their own, then the in-process one, when no server is running and the engine has the cores."""
    m = Measured()
    with contextlib.ExitStack() as stack:
        raw = None
        if "raw" not in cfg.skip and "levels" not in cfg.skip:
            raw = RawDecoder(cfg)
            stack.callback(raw.close)
        shared = {"levels", "prefix", *(["apis"] if cfg.api_levels else []), *(["arrivals"] if cfg.arrivals else [])}
        servers = start_servers(cfg, stack) if shared - cfg.skip else []  # none when every scenario that uses them is skipped
        if "levels" not in cfg.skip:
            m.rows = asyncio.run(all_levels(servers, raw, cfg))
        if cfg.api_levels and "apis" not in cfg.skip:
            m.apis = asyncio.run(api_streaming(servers, cfg))
        if "prefix" not in cfg.skip:
            m.prefix = prefix_runs(servers, cfg)
        if cfg.arrivals and "arrivals" not in cfg.skip:
            m.arrivals = arrival_runs([*servers, *start_small_batch(cfg, stack)], cfg)
    if "kv-cache" not in cfg.skip:
        m.kv_cache = kv_cache_runs(cfg)
    if cfg.soak:
        m.soak = soak_run(cfg)
    if cfg.spec_streams and "speculation" not in cfg.skip:
        m.speculation = speculation_runs(cfg)
    if cfg.priority_rounds and "priority" not in cfg.skip and "slots" not in cfg.skip:
        m.priority = priority_runs(cfg)
    if cfg.fleet_policies and "fleet" not in cfg.skip:
        m.fleet = [run for server, flags in FLEET_FLAGS.items() if server not in cfg.skip for run in fleet_server_runs(server, flags, cfg)]
    if "shared-prefix" not in cfg.skip:
        m.shared_prefix, m.shared_trace = shared_prefix.runs(cfg)
    if cfg.greedy_runs:
        m.greedy = greedy_drift(cfg)
    return m


def fleet_server_runs(server: str, flags: tuple[str, ...], cfg: Config) -> list[FleetRun]:
    """The policies in front of ``server``: llama-server publishes no KV events, so kv_aware is the slot server's alone."""
    policies = [p for p in cfg.fleet_policies if p != "kv_aware" or server == "slots"]
    return fleet_runs(server, policies, cfg, flags)


def priority_runs(cfg: Config) -> list[Priority]:
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


def prefix_runs(servers: list[Server], cfg: Config) -> list[PrefixReuse]:
    system = long_system_prompt(cfg.model, cfg.prefix_tokens)
    return [asyncio.run(prefix_reuse(server, system, cfg)) for server in tqdm(servers, desc="prefix reuse", leave=False)]


def arrival_runs(servers: list[Server], cfg: Config) -> list[Arrivals]:
    """Every level of ``cfg.arrivals`` on every server, new prompts each time: nothing cached."""
    out = []
    for server, k in tqdm([(server, k) for k in cfg.arrivals for server in servers], desc="arrivals", leave=False):
        tag = uuid.uuid4().hex[:12]
        prompts = [long_text(cfg.model, cfg.arrival_tokens, f"Log {tag}-{j}") for j in range(cfg.arrival_prompts)]
        out.append(asyncio.run(arrivals(server, k, prompts, cfg)))
    return out


def kv_cache_runs(cfg: Config) -> list[KvCache]:
    """The slot server and llama-server (unless skipped), each started alone with 2 slots and ``--cache-reuse``."""
    system = long_system_prompt(cfg.model, cfg.prefix_tokens)
    history, shortened = edited_chat(cfg.model, cfg.chat_tokens)
    out = []
    for kind in ("slots", "llama-server"):
        if kind not in cfg.skip:
            with launch.serve(kind, "-np", "2", "-c", "4096", "--cache-reuse", str(CACHE_REUSE), *server_flags(cfg)) as p:
                out.append(asyncio.run(kv_cache(OpenAIServer(kind, p.url), system, history, shortened)))
    return out


def speculation_runs(cfg: Config) -> list[Speculation]:
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


def soak_run(cfg: Config) -> Soak:
    """A slot server of 4 slots and a small ``--cache-ram``: distinct prompts fill the prompt cache to its limit, then evict."""
    with launch.serve("slots", "-np", "4", "-c", "8192", "--cache-ram", str(SOAK_CACHE_RAM_MIB), *server_flags(cfg)) as p:
        return asyncio.run(soak(OpenAIServer("slots (4 x 2048)", p.url, pid=p.process.pid), cfg))
