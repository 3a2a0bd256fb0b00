"""``llmkit bench``: the servers side by side, through HTTP, at 1, 2, 4 and 8 concurrent streams.

    llmkit bench                                   # sequential vs slot server (both started here)
    llmkit bench --url llama-server=http://127.0.0.1:8081 --soak 1000

What one run measures (and writes to ``bench-results/``: results.md, results.json, bench.png):

- an "engine limit": a plain loop on ``llmkit.llama`` decoding 1..8 sequences in
  one batch per step, no server (``RawDecoder``);
- every server at every concurrency level (``scenarios.all_levels``): each client
  sends one streamed request; aggregate tokens/s = all generated tokens / (first
  request sent -> last stream done), time to first token (TTFT), tokens/s per
  stream, and from ``/metrics`` busy slots per decode and Python's share of each step;
- API streaming cost (``scenarios.api_streaming``), on the slot server and llama-server:
  the same greedy streams through chat, Responses and Messages at 1 and 8 streams,
  back to back in each of 5 rounds: aggregate tokens/s per API and its ratio to chat's;
- prefix reuse (``scenarios.prefix_reuse``): TTFT of a request with a new ~800-token
  system prompt (cold) vs the next ones that share it (warm);
- arrivals (``scenarios.arrivals``): a burst of long prompts while 1 or 4 streams run;
- the KV cache beyond one slot (``scenarios.kv_cache``), on the slot server and
  llama-server started with 2 slots and ``--cache-reuse``: a long prefix back from
  the host-RAM prompt cache on another slot, and an edited chat;
- with ``--soak N``: N short requests with distinct prefixes to a slot server with
  4 slots of 2048 tokens and ``--cache-ram 64``, its resident memory sampled every
  100 requests (``scenarios.soak``);
- with ``--greedy-runs R``: chapter 6's 8 reviews, greedy, on an in-process ``Engine``
  with 4 slots of one KV stream each: answered alone, then R times all at once; how many
  batched answers differ from alone (``scenarios.greedy_drift``; information, no target);
- the targets, judged on ratios (``report.judge``).

Every server gets the same prompts: the sequential server's translation prompt,
sent to OpenAI-compatible servers as the chat message it renders to, so every
server evaluates the same tokens. OpenAI-compatible requests use
``ignore_eos`` so that every stream generates exactly ``max_tokens`` tokens, and
``cache_prompt: false`` in the concurrency levels (no server reuses a previous
level's prompt; ``--cache-prompt`` turns that off); prefix reuse has its own scenario.

The package, one role per module:

    config     Config, the names shared by every part
    prompts    the texts, the translation prompt, long made-up texts of N tokens
    servers    SequentialServer, OpenAIServer: each kind's request and stream; starting them
    raw        RawDecoder: the same work on llama.cpp alone
    scenarios  what is measured: all_levels, api_streaming, prefix_reuse, arrivals, kv_cache, soak, greedy_drift
    report     tables, plot, targets
    run() (here) runs them all and writes the results
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from llmkit.course import launch
from llmkit.course.bench import report
from llmkit.course.bench.config import API_RATIO, CACHE_REUSE, NO_BUDGET, RAW, SOAK_CACHE_RAM_MIB, BenchError, Config
from llmkit.course.bench.prompts import LANG, TEXTS, chat_prompt, edited_chat, long_system_prompt, long_text
from llmkit.course.bench.raw import RawDecoder
from llmkit.course.bench.scenarios import Row, all_levels, api_streaming, arrivals, greedy_drift, kv_cache, prefix_reuse, soak
from llmkit.course.bench.servers import OpenAIServer, SequentialServer, Server, server_flags, start_servers

__all__ = [
    "LANG", "NO_BUDGET", "RAW", "TEXTS", "BenchError", "Config", "OpenAIServer", "RawDecoder", "Results", "Row",
    "SequentialServer", "Server", "chat_prompt", "long_system_prompt", "long_text", "run",
]  # fmt: skip


@dataclass
class Results:
    rows: list[Row]
    prefix: list[dict]
    soak: dict | None
    targets: list[tuple[str, str, str]]
    markdown: str
    table_path: Path
    plot_path: Path
    arrivals: list[dict] = field(default_factory=list)
    kv_cache: list[dict] = field(default_factory=list)
    greedy: dict | None = None
    apis: list[dict] = field(default_factory=list)


def run(cfg: Config) -> Results:
    """Every scenario on every server not skipped; the tables, plot and JSON written to ``cfg.out``."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    prefix, burst, caching, soaked, apis = [], [], [], None, []
    with contextlib.ExitStack() as stack:
        raw = None
        if "raw" not in cfg.skip and "levels" not in cfg.skip:
            raw = RawDecoder(cfg)
            stack.callback(raw.close)
        servers = start_servers(cfg, stack)
        rows = asyncio.run(all_levels(servers, raw, cfg)) if "levels" not in cfg.skip else []
        if cfg.api_levels and "apis" not in cfg.skip:
            apis = asyncio.run(api_streaming(servers, cfg))
        if "prefix" not in cfg.skip:
            system = long_system_prompt(cfg.model, cfg.prefix_tokens)
            for server in tqdm(servers, desc="prefix reuse", leave=False):
                prefix.append(asyncio.run(prefix_reuse(server, system, cfg)))
        if cfg.arrivals and "arrivals" not in cfg.skip:
            scenes = [(server, k) for k in cfg.arrivals for server in servers]
            for server, k in tqdm(scenes, desc="arrivals", leave=False):  # new prompts each time: nothing cached
                tag = uuid.uuid4().hex[:12]
                prompts = [long_text(cfg.model, cfg.arrival_tokens, f"Log {tag}-{j}") for j in range(cfg.arrival_prompts)]
                burst.append(asyncio.run(arrivals(server, k, prompts, cfg)))
    if "kv-cache" not in cfg.skip:
        system = long_system_prompt(cfg.model, cfg.prefix_tokens)
        history, shortened = edited_chat(cfg.model, cfg.chat_tokens)
        for kind in ("slots", "llama-server"):
            if kind not in cfg.skip:
                with launch.serve(kind, "-np", "2", "-c", "4096", "--cache-reuse", str(CACHE_REUSE), *server_flags(cfg)) as p:
                    caching.append(asyncio.run(kv_cache(OpenAIServer(kind, p.url), system, history, shortened)))
    if cfg.soak:  # distinct prompts fill the prompt cache to its limit, then evict
        with launch.serve("slots", "-np", "4", "-c", "8192", "--cache-ram", str(SOAK_CACHE_RAM_MIB), *server_flags(cfg)) as p:
            soaked = asyncio.run(soak(OpenAIServer("slots (4 x 2048)", p.url, pid=p.process.pid), cfg))
    greedy = greedy_drift(cfg) if cfg.greedy_runs else None  # no server running: the engine has the cores to itself
    targets = report.judge(rows, prefix, soaked, cfg, burst, caching, greedy, apis)
    plot_path, table_path = cfg.out / "bench.png", cfg.out / "results.md"
    if rows:
        report.plot(rows, plot_path)
    parts = [
        f"# llmkit bench: {max(cfg.concurrency)} streams max, {cfg.max_tokens} tokens each, threads {cfg.threads or os.cpu_count()}, "
        f"median of {cfg.rounds} round{'s' * (cfg.rounds > 1)}",
        "## Throughput and latency\n\n" + report.table(rows),
    ]
    if apis:
        parts.append(
            f"## Streaming through each chat API ({cfg.max_tokens} tokens per stream, median of {cfg.api_rounds} rounds)\n\n"
            "The same greedy prompt through chat, Responses and Messages, back to back in every round (chat and Responses with "
            "ignore_eos; Messages has none, and the prompt's answer runs past the budget); tokens from each API's usage. "
            "/ chat: the median of the ratios to chat's tok/s in the same round; range: their lowest and highest (for chat, its "
            "rounds against their median: what the machine alone moves). Server CPU: the server process's CPU time per generated "
            f"token. Target: on the slot server, >= {API_RATIO}x chat; a ratio below that fails only if it is also below chat's "
            "own lowest round (else this run cannot tell, and says so).\n\n" + report.apis_table(apis)
        )
    if prefix:
        parts.append(f"## Prefix reuse (~{cfg.prefix_tokens}-token shared prefix, first token only)\n\n" + report.prefix_table(prefix))
    if burst:
        parts.append(
            f"## Arrivals ({cfg.arrival_prompts} prompts of ~{cfg.arrival_tokens} tokens at once while streams run)\n\n"
            + report.arrivals_table(burst)
        )
    if caching:
        parts.append(f"## KV cache beyond one slot (2 slots, --cache-reuse {CACHE_REUSE})\n\n" + report.kv_cache_table(caching))
    if soaked:
        parts.append(f"## Soak (memory, --cache-ram {SOAK_CACHE_RAM_MIB})\n\n" + report.soak_table(soaked))
    if greedy:
        parts.append(
            "## Greedy answers alone vs batched\n\n"
            f"Chapter 6's {len(greedy['reviews'])} reviews, unconstrained, temperature 0, at most {greedy['max_tokens']} tokens, on an "
            f"in-process Engine with {greedy['slots']} slots of one KV stream each: every review answered alone, then "
            f"{greedy['runs']} times all {len(greedy['reviews'])} at once.\n\n" + report.greedy_table(greedy)
        )
    parts.append("## Targets\n\n" + report.targets_table(targets))
    markdown = "\n\n".join(parts) + "\n"
    table_path.write_text(markdown)
    data = {
        "config": {**asdict(cfg), "out": str(cfg.out), "skip": sorted(cfg.skip)},
        "rows": [asdict(r) for r in rows],
        "prefix": prefix,
        "arrivals": burst,
        "kv_cache": caching,
        "soak": soaked,
        "greedy": greedy,
        "apis": apis,
        "targets": targets,
    }
    (cfg.out / "results.json").write_text(json.dumps(data, indent=2))
    return Results(rows, prefix, soaked, targets, markdown, table_path, plot_path, burst, caching, greedy, apis)
