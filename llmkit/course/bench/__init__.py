"""``llmkit bench``: the servers side by side, through HTTP, at 1, 2, 4 and 8 concurrent streams.

    llmkit bench                                   # sequential vs slot server (both started here)
    llmkit bench --url llama-server=http://127.0.0.1:8081 --soak 1000

What one run measures (and writes to ``bench-results/``: results.md, results.json, bench.png):

- an "engine limit": a plain loop on ``llmkit.llama`` decoding 1..8 sequences in
  one batch per step, no server (``RawDecoder``);
- every server at every concurrency level (``scenarios.levels``): each client
  sends one streamed request; aggregate tokens/s = all generated tokens / (first
  request sent -> last stream done), time to first token (TTFT), tokens/s per
  stream, and from ``/metrics`` busy slots per decode and Python's share of each step;
- API streaming cost (``scenarios.apis``), on the slot server and llama-server:
  the same greedy streams through chat, Responses and Messages at 1 and 8 streams,
  back to back in each of 5 rounds: aggregate tokens/s per API and its ratio to chat's;
- prefix reuse (``scenarios.prefix``): TTFT of a request with a new ~800-token
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
- fleet (``scenarios.fleet``): vllm-router's policies (round_robin, power_of_two, consistent_hash, cache_aware,
  kv_aware) in front of 2 replicas (``-t 1``) of the slot server (with ``--kv-events``) and of llama-server (no events:
  no kv_aware), a fresh fleet per policy, the same seeded multi-tenant trace (``llmkit.course.trace``): the share of
  prompt tokens served from cache, TTFT p50 and p99, tokens/s, requests per replica;
- with ``--soak N``: N short requests with distinct prefixes to a slot server with
  4 slots of 2048 tokens and ``--cache-ram 64``, its resident memory sampled every
  100 requests (``scenarios.soak``);
- with ``--greedy-runs R``: chapter 6's 8 reviews, greedy, on an in-process ``Engine``
  with 4 slots of one KV stream each: answered alone, then R times all at once; how many
  batched answers differ from alone (``scenarios.greedy``; information, no target);
- the targets, each scenario's, judged on ratios (``scenarios.judge``).

Every server gets the same prompts: the sequential server's translation prompt,
sent to OpenAI-compatible servers as the chat message it renders to, so every
server evaluates the same tokens. OpenAI-compatible requests use
``ignore_eos`` so that every stream generates exactly ``max_tokens`` tokens, and
``cache_prompt: false`` in the concurrency levels (no server reuses a previous
level's prompt; ``--cache-prompt`` turns that off); prefix reuse has its own scenario. The speculation
scenario is the exception: native ``/completion`` prompts of its own (``prompts.spec_prompts``), no chat
template, not streamed, so that each answer's ``timings`` (drafts, acceptances) come back.

Any scenario runs alone by skipping the others by name (``scenarios.SCENARIOS``), e.g. speculation only:
``llmkit bench --skip levels apis prefix arrivals kv-cache priority fleet shared-prefix`` (soak and greedy run only
when asked: ``--soak N``, ``--greedy-runs R``).

The package, one role per module:

    config     Config, the names shared by every part
    prompts    the texts, the translation prompt, long made-up texts of N tokens
    servers    SequentialServer, OpenAIServer: each kind's request and stream; starting them
    targets    Target: one line of the targets table, judged on ratios measured in the run
    scenario   Scenario: one scenario's name, run, section of results.md and targets; Stage: the servers the first
               share; Measured: each scenario's results under its name
    scenarios/ what is measured, one module per scenario (levels, apis, prefix, arrivals, kv_cache, soak, speculation,
               priority, fleet, shared_prefix, greedy), and SCENARIOS, the list a run goes through
    report     results.md, results.json and the plot
    run() (here) runs the scenarios chosen and writes the results
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from llmkit.course.bench import report
from llmkit.course.bench.config import NO_BUDGET, PRIORITY_SERVERS, RAW, SMALL_BATCH, BenchError, Config
from llmkit.course.bench.prompts import LANG, TEXTS, chat_prompt, long_system_prompt, long_text
from llmkit.course.bench.scenario import Measured, Scenario, Stage
from llmkit.course.bench.scenarios import SCENARIOS, judge
from llmkit.course.bench.scenarios.levels import RawDecoder, Row
from llmkit.course.bench.servers import OpenAIServer, SequentialServer, Server
from llmkit.course.bench.targets import Target

__all__ = [
    "LANG", "NO_BUDGET", "PRIORITY_SERVERS", "RAW", "SCENARIOS", "SMALL_BATCH", "TEXTS", "BenchError", "Config", "Measured",
    "OpenAIServer", "RawDecoder", "Results", "Row", "Scenario", "SequentialServer", "Server", "Target", "chat_prompt", "judge",
    "long_system_prompt", "long_text", "run",
]  # fmt: skip


@dataclass(frozen=True)
class Results:
    """What was measured (each scenario's results under its name), the targets judged on it, and what was written:
    results.md's text and where it and the plot are."""

    measured: Measured
    targets: list[Target]
    markdown: str
    table_path: Path
    plot_path: Path | None  # None: no concurrency levels measured, no plot


def run(cfg: Config) -> Results:
    """Every scenario chosen (not skipped, asked for), on every server not skipped; the tables, plot and JSON written to
    ``cfg.out``."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    measured = measure(cfg)
    targets = judge(measured, cfg)
    plot_path, table_path = (cfg.out / "bench.png" if measured.get("levels") else None), cfg.out / "results.md"
    if plot_path is not None:  # the plot is of the concurrency levels: none when they were skipped
        report.plot(measured["levels"], plot_path)
    markdown = report.markdown(measured, targets, cfg)
    table_path.write_text(markdown)
    (cfg.out / "results.json").write_text(json.dumps(report.data(measured, targets, cfg), indent=2))
    return Results(measured, targets, markdown, table_path, plot_path)


def measure(cfg: Config) -> Measured:
    """The scenarios chosen, in ``SCENARIOS``' order: first those on the servers started together (stopped after the
    last of them), then each of the others with the servers it starts (stopped after it)."""
    chosen = [s for s in SCENARIOS if s.chosen(cfg)]
    m: Measured = {}
    with contextlib.ExitStack() as stack:
        stage = Stage(cfg, stack)
        for s in (s for s in chosen if s.shared):
            m[s.name] = s.run(cfg, stage)
    for s in (s for s in chosen if not s.shared):
        with contextlib.ExitStack() as stack:
            m[s.name] = s.run(cfg, Stage(cfg, stack))
    return m
