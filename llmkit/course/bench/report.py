"""What a bench run writes: markdown tables, the plot, and the targets (``targets``) judged on ratios measured in the
same run.

tables    one per scenario (``table`` for the concurrency levels, ``apis_table``, ``prefix_table``, ...)
plot      throughput and first-token time against concurrent streams (bench.png)
files     ``markdown`` (results.md, also printed) and ``data`` (results.json)
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from llmkit.course.bench.config import (
    CACHE_REUSE,
    PRIORITY_SLOTS,
    RAW,
    SMALL_BATCH_FLAGS,
    SOAK_CACHE_RAM_MIB,
    Config,
)
from llmkit.course.bench.levels import Row
from llmkit.course.bench.scenarios import Measured, shared_prefix
from llmkit.course.bench.scenarios.apis import ApiStreaming
from llmkit.course.bench.scenarios.arrivals import Arrivals
from llmkit.course.bench.scenarios.fleet import FleetRun
from llmkit.course.bench.scenarios.greedy import GreedyDrift
from llmkit.course.bench.scenarios.kv_cache import KvCache
from llmkit.course.bench.scenarios.prefix import PrefixReuse
from llmkit.course.bench.scenarios.priority import Priority
from llmkit.course.bench.scenarios.soak import Soak
from llmkit.course.bench.scenarios.speculation import Speculation
from llmkit.course.bench.targets import API_RATIO, Target, fmt, greedy_control, percent

# --- tables ---------------------------------------------------------------------------------


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


def apis_table(results: list[ApiStreaming]) -> str:
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


def prefix_table(results: list[PrefixReuse]) -> str:
    lines = ["| server | cold TTFT ms | warm TTFT ms | cold / warm | cached tokens (warm) |", "|---|---|---|---|---|"]
    for p in results:
        lines.append(f"| {p.server} | {p.cold_ms:.0f} | {p.warm_ms:.0f} | {p.speedup:.1f}x | {fmt(p.cached_tokens, 'd')} |")
    return "\n".join(lines)


def arrivals_table(results: list[Arrivals]) -> str:
    head = ["server", "running", "arrivals", "gap p50 ms", "gap p99 ms", "gap max ms", "arrival TTFT median ms", "arrival TTFT max ms",
            "tok/s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r.server} | {r.running} | {r.arrivals} | {fmt(r.gap_p50_ms)} | {fmt(r.gap_p99_ms)} | {fmt(r.gap_max_ms)} | "
                     f"{fmt(r.arrival_ttft_median_ms)} | {fmt(r.arrival_ttft_max_ms)} | {fmt(r.tokens_per_s, '.1f')} |")  # fmt: skip
    return "\n".join(lines)


def kv_cache_table(results: list[KvCache]) -> str:
    head = "| server | cold first token | same slot | from RAM, other slot | cold / RAM | edited ~1,000-token chat: share read again |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        share = f"{100 * r.edited_read_share:.0f} %" if r.edited_read_share is not None else "n/a"
        lines.append(f"| {r.server} | {r.cold_ms:.0f} ms | {r.same_slot_ms:.0f} ms | {r.ram_ms:.0f} ms ({r.ram_cached_tokens} cached) | "
                     f"{r.cold_ms / r.ram_ms:.1f}x | {share} of {r.chat_tokens} |")  # fmt: skip
    return "\n".join(lines)


def speculation_table(results: list[Speculation]) -> str:
    head = ["server", "--spec-type", "prompts", "streams", "tok/s without", "tok/s with", "speedup", "range over rounds", "drafted",
            "accepted", "acceptance", "same answer as without", "Python share of step"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        acceptance, share = percent(r.acceptance), percent(r.python_share, ".1f")
        lines.append(f"| {r.server} | {r.mode} | {r.prompts} | {r.streams} | {r.plain_tokens_per_s:.1f} | {r.tokens_per_s:.1f} | "
                     f"{r.speedup:.2f}x | {r.speedup_low:.2f}-{r.speedup_high:.2f} | {r.draft_n} | {r.draft_n_accepted} | {acceptance} | "
                     f"{r.same_answers} of {r.answers} | {share} |")  # fmt: skip
    return "\n".join(lines)


def priority_table(results: list[Priority]) -> str:
    lines = ["| server | high-priority TTFT, median | max | preempted | low answers as without preemption |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.server} | {r.ttft_ms:.0f} ms | {r.ttft_max_ms:.0f} ms | {r.preempted} | {r.low_same} of {r.low_total} |")
    return "\n".join(lines)


def fleet_table(results: list[FleetRun]) -> str:
    lines = [
        "| server | policy | cache hit | TTFT p50 | TTFT p99 | tok/s | requests per replica | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per = " / ".join(f"{n}" for n in r.per_replica.values())
        lines.append(f"| {r.server} | {r.policy} | {percent(r.cache_hit, '.1f')} | {r.ttft_p50_ms:.0f} ms | {r.ttft_p99_ms:.0f} ms | "
                     f"{r.tokens_per_s:.1f} | {per} | {r.errors} of {r.requests} |")  # fmt: skip
    return "\n".join(lines)


def soak_table(s: Soak) -> str:
    samples = ", ".join(f"{n}: {mb:.0f}" for n, mb in s.samples)
    return (
        f"{s.server}, {s.requests} requests. RSS MB at start {s.rss_start_mb:.0f}, after the first "
        f"{s.samples[1][0] if len(s.samples) > 1 else 0} {s.rss_first_mb:.0f}, last {s.rss_last_mb:.0f}, "
        f"peak (VmHWM) {s.rss_peak_mb:.0f}.\nSamples (requests: MB): {samples}"
    )


def greedy_table(g: GreedyDrift) -> str:
    """Per review: how many batched runs changed its greedy answer; then any review, and the alone-twice control."""
    lines = ["| review | batched runs whose answer differed from alone |", "|---|---|"]
    for r in g.reviews:
        text = r.review if len(r.review) <= 40 else r.review[:39] + "…"
        lines.append(f"| {text} | {r.differed} of {g.runs} |")
    lines.append(f"| any of the {len(g.reviews)} | {g.runs_with_difference} of {g.runs} |")
    return "\n".join(lines) + (
        f"\n\nControl, each review answered alone twice: {greedy_control(g)}. "
        f"The {g.runs} batched runs went through {g.batch_schedules} distinct batch schedule"
        f"{'s' * (g.batch_schedules != 1)} (tokens per step). {g.seconds:.0f} s in all."
    )


def targets_table(targets: list[Target]) -> str:
    lines = [f"| {t.name} | {t.measured} | {t.verdict} |" for t in targets]
    return "\n".join(["| target | measured | verdict |", "|---|---|---|", *lines])


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.server for r in rows):
        mine = [r for r in rows if r.server == name]
        xs = [r.concurrency for r in mine]
        style = {"linestyle": "--", "color": "grey"} if name == RAW else {"marker": "o"}
        tps.plot(xs, [r.tokens_per_s for r in mine], label=name, **style)
        if name != RAW:
            ttft.plot(xs, [r.ttft_median_ms for r in mine], label=name, **style)
    levels = sorted({r.concurrency for r in rows})
    for ax, title, unit in ((tps, "aggregate throughput", "tokens/s"), (ttft, "median time to first token", "ms")):
        ax.set(title=title, xlabel="concurrent streams", ylabel=unit, xscale="log", xticks=levels)
        ax.set_xticklabels([str(x) for x in levels])
        ax.grid(alpha=0.3)
        ax.legend()
    ttft.set_yscale("log")
    ttft.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ttft.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    tps.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the files: results.md and results.json ---------------------------------------------------------


def markdown(m: Measured, targets: list[Target], cfg: Config) -> str:
    """results.md (and what ``llmkit bench`` prints): a title, a section for each scenario that ran, the targets."""
    parts = [
        f"# llmkit bench: {max(cfg.concurrency)} streams max, {cfg.max_tokens} tokens each, threads {cfg.threads or os.cpu_count()}, "
        f"median of {cfg.rounds} round{'s' * (cfg.rounds > 1)}",
        "## Throughput and latency\n\n" + table(m.rows),
    ]
    if m.apis:
        parts.append(apis_section(m.apis, cfg))
    if m.prefix:
        parts.append(f"## Prefix reuse (~{cfg.prefix_tokens}-token shared prefix, first token only)\n\n" + prefix_table(m.prefix))
    if m.arrivals:
        parts.append(f"## Arrivals ({cfg.arrival_prompts} prompts of ~{cfg.arrival_tokens} tokens at once while streams run)\n\n"
                     f"llama-server at its default -b 2048, and at {SMALL_BATCH_FLAGS} (the slot server's step budget).\n\n"
                     + arrivals_table(m.arrivals))  # fmt: skip
    if m.kv_cache:
        parts.append(f"## KV cache beyond one slot (2 slots, --cache-reuse {CACHE_REUSE})\n\n" + kv_cache_table(m.kv_cache))
    if m.soak:
        parts.append(f"## Soak (memory, --cache-ram {SOAK_CACHE_RAM_MIB})\n\n" + soak_table(m.soak))
    if m.greedy:
        parts.append(greedy_section(m.greedy))
    if m.speculation:
        parts.append(speculation_section(m.speculation, cfg))
    if m.fleet:
        parts.append(f"## Fleet (vllm-router in front of 2 replicas at -t 1; a seeded trace of {cfg.fleet_conversations} chats of "
                     f"{cfg.fleet_turns} turns over 4 tenants, {cfg.fleet_tokens} tokens per answer; a fresh fleet per policy)\n\n"
                     + fleet_table(m.fleet))  # fmt: skip
    if m.priority:
        parts.append(f"## Priority ({PRIORITY_SLOTS} slots busy with low-priority streams, a high-priority request comes; "
                     f"{cfg.priority_rounds} rounds)\n\n" + priority_table(m.priority))  # fmt: skip
    if m.shared_prefix:
        parts.append(f"## Shared prefix (a burst of clients, one ~{shared_prefix.PREFIX_TOKENS}-token system prompt, "
                     f"{shared_prefix.ANSWER_TOKENS}-token answers; -np {max(cfg.shared_bursts)} -kvu on each server)\n\n"
                     + shared_prefix.table(m.shared_prefix))  # fmt: skip
    if m.shared_trace:
        parts.append(f"## Shared prefix, a trace on one server ({cfg.shared_trace} conversations of {shared_prefix.TRACE_TURNS} turns "
                     f"over {shared_prefix.TRACE_TENANTS} tenants, {shared_prefix.ANSWER_TOKENS}-token answers; medians of "
                     f"{cfg.rounds} rounds)\n\n" + shared_prefix.trace_table(m.shared_trace))  # fmt: skip
    parts.append("## Targets\n\n" + targets_table(targets))
    return "\n\n".join(parts) + "\n"


def apis_section(apis: list[ApiStreaming], cfg: Config) -> str:
    return (
        f"## Streaming through each chat API ({cfg.max_tokens} tokens per stream, median of {cfg.api_rounds} rounds)\n\n"
        "The same greedy prompt through chat, Responses and Messages, back to back in every round (chat and Responses with "
        "ignore_eos; Messages has none, and the prompt's answer runs past the budget); tokens from each API's usage. "
        "/ chat: the median of the ratios to chat's tok/s in the same round; range: their lowest and highest (for chat, its "
        "rounds against their median: what the machine alone moves). Server CPU: the server process's CPU time per generated "
        f"token. Target: on the slot server, >= {API_RATIO}x chat; a ratio below that fails only if it is also below chat's "
        "own lowest round (else this run cannot tell, and says so).\n\n" + apis_table(apis)
    )


def speculation_section(results: list[Speculation], cfg: Config) -> str:
    return (
        f"## Speculative decoding without a draft model ({cfg.max_tokens} tokens per answer, median of {cfg.rounds} "
        f"round{'s' * (cfg.rounds > 1)})\n\n"
        "Native /completion, greedy, ignore_eos, no cached prompt; at n streams, n clients each send every prompt of the kind "
        "in turn. Copy: a source file's copy begun after it, a JSON document to rewrite, a paragraph to quote; free: a story, "
        "an essay. The slot server is started once per --spec-type and answers without speculation when a request says "
        '"speculative.n_max": 0; llama-server (speculation per server only) is started without it and once per mode. '
        "Speedup: tok/s with / without, measured back to back in each round, the median of the rounds. Same answer: the "
        "speculative answers equal to the same server's without speculation (same prompt, level and round; batch numerics "
        "can tip a greedy choice).\n\n" + speculation_table(results)
    )


def greedy_section(g: GreedyDrift) -> str:
    return (
        "## Greedy answers alone vs batched\n\n"
        f"Chapter 6's {len(g.reviews)} reviews, unconstrained, temperature 0, at most {g.max_tokens} tokens, on an "
        f"in-process Engine with {g.slots} slots of one KV stream each: every review answered alone, then "
        f"{g.runs} times all {len(g.reviews)} at once.\n\n" + greedy_table(g)
    )


def data(m: Measured, targets: list[Target], cfg: Config) -> dict:
    """results.json: the config, every scenario's results as they were measured, and the targets."""
    return {
        "config": {**asdict(cfg), "out": str(cfg.out), "skip": sorted(cfg.skip)},
        **asdict(m),
        "targets": [{"target": t.name, "measured": t.measured, "verdict": t.verdict} for t in targets],
    }
