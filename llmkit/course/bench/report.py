"""What a bench run writes: markdown tables, the plot, and the targets judged on ratios measured in the same run.

tables    one per scenario (``table`` for the concurrency levels, ``apis_table``, ``prefix_table``, ...)
plot      throughput and first-token time against concurrent streams (bench.png)
targets   ``judge``: one ``Target`` per line, each computed by a short function below with its threshold
          as a named constant just above it (what it is, and why that number)
files     ``markdown`` (results.md, also printed) and ``data`` (results.json)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from llmkit.course.bench import shared_prefix
from llmkit.course.bench.config import (
    CACHE_REUSE,
    NO_BUDGET,
    PRIORITY_SERVERS,
    PRIORITY_SLOTS,
    RAW,
    SMALL_BATCH,
    SMALL_BATCH_FLAGS,
    SOAK_CACHE_RAM_MIB,
    SPEC_MODES,
    SPEC_SLOW_START,
    Config,
    spec_mode,
)
from llmkit.course.bench.scenarios import (
    ApiStreaming,
    Arrivals,
    FleetRun,
    GreedyDrift,
    KvCache,
    Measured,
    PrefixReuse,
    Priority,
    Row,
    Soak,
    Speculation,
)  # fmt: skip

Levels = dict[tuple[str, int], Row]  # (server, concurrent streams) -> its row


class OfServer(Protocol):
    @property
    def server(self) -> str: ...


S = TypeVar("S", bound=OfServer)  # one server's result in a scenario: PrefixReuse, KvCache, ...


# --- tables ---------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def percent(share: float | None, spec: str = ".0f") -> str:
    return fmt(None if share is None else 100 * share, spec, " %")


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


def greedy_control(g: GreedyDrift) -> str:
    """The control: each review answered alone twice, identical or how many answers differed."""
    return "identical" if g.alone_twice_identical else f"{g.alone_twice_differed} of {len(g.reviews)} answers differed"


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


# --- targets: one Target per line of the table -----------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One line of the targets table: what is aimed at (its threshold in the words), what this run measured, the verdict."""

    name: str
    measured: str  # the number as shown, with what explains it ("not measured": this run has no such number)
    ok: bool | None  # met or not; None: not judged (not measured, or within this run's own noise)
    info: bool = False  # a number shown beside the targets, never judged

    @property
    def verdict(self) -> str:
        """PASS, FAIL, n/a (not judged) or info."""
        if self.info:
            return "info"
        return "n/a" if self.ok is None else "PASS" if self.ok else "FAIL"


def unmeasured(name: str) -> Target:
    return Target(name, "not measured", None)


def info(name: str, measured: str) -> Target:
    return Target(name, measured, None, info=True)


def judge(m: Measured, cfg: Config) -> list[Target]:
    """The targets, judged on ratios of numbers measured in this run (a slower or busier machine moves both
    sides of a ratio alike), with numbers for information beside them."""
    at: Levels = {(r.server, r.concurrency): r for r in m.rows}
    n = max(cfg.concurrency)
    return [
        batching_target(at, n),
        raw_decode_target(at, n),
        *(t for level in cfg.concurrency for t in (python_share_target(at, level), llama_server_target(at, level))),
        *api_targets(m.apis, cfg.api_levels),
        prefix_target(m.prefix),
        *soak_targets(m.soak),
        *kv_cache_targets(m.kv_cache, cfg),
        budget_target(at, n),
        *(t for k in cfg.arrivals for t in burst_targets(m.arrivals, k)),
        *greedy_info(m.greedy),
        *speculation_targets(m.speculation, cfg),
        *priority_targets(m.priority),
        *fleet_targets(m.fleet),
        *(Target(name, measured, ok) for name, measured, ok in shared_prefix.targets(m.shared_prefix)),
        *production_info(at, n),
    ]


def result_of(results: Sequence[S], server: str) -> S | None:
    """The result of ``server`` in one scenario's ``results``, or None."""
    return next((r for r in results if r.server == server), None)


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


# A warm request reads ~1 new token behind a cached ~800-token prefix where a cold one reads them all: its first token
# must come at least 20 times sooner.
PREFIX_SPEEDUP = 20


def prefix_target(prefix: Sequence[PrefixReuse]) -> Target:
    name = f"slots prefix reuse: cold TTFT / warm TTFT >= {PREFIX_SPEEDUP}x"
    if not (p := result_of(prefix, "slots")):
        return unmeasured(name)
    return Target(name, f"{p.speedup:.1f}x", p.speedup >= PREFIX_SPEEDUP)


# A high-priority request that preempts gets its first token after its own prompt, where one that waits gets it after a
# low-priority answer of 4 x max_tokens tokens has ended: at least 5 times sooner (both with the RAM copy of the preempted
# KV and without it). And the preempted answers come out as without preemption (greedy).
PREEMPTION_SPEEDUP = 5


def priority_targets(results: Sequence[Priority]) -> list[Target]:
    waits, *preempting = list(PRIORITY_SERVERS)
    out = []
    for name in preempting:
        target = f"{name}: high-priority TTFT, waiting / preempting >= {PREEMPTION_SPEEDUP}x, preempted answers unchanged"
        slow, fast = result_of(results, waits), result_of(results, name)
        if slow is None or fast is None:
            out.append(unmeasured(target))
            continue
        r = slow.ttft_ms / fast.ttft_ms
        measured = f"{r:.1f}x, {fast.low_same} of {fast.low_total} unchanged, {fast.preempted} preempted"
        out.append(Target(target, measured, r >= PREEMPTION_SPEEDUP and fast.low_same == fast.low_total and fast.preempted > 0))
    return out


def fleet_targets(results: Sequence[FleetRun]) -> list[Target]:
    """The slot server's fleet: routing on what the replicas' caches hold serves more of the trace's prompts from cache than
    routing blind (round_robin); the other orderings, for information (a small trace moves them)."""
    runs = {(r.server, r.policy): r for r in results}
    name = "slots fleet: kv_aware cache hit >= round_robin's"
    kv, rr, ca = runs.get(("slots", "kv_aware")), runs.get(("slots", "round_robin")), runs.get(("slots", "cache_aware"))
    if kv is None or rr is None:
        return [unmeasured(name)]
    out = [Target(name, f"{percent(kv.cache_hit, '.1f')} vs {percent(rr.cache_hit, '.1f')}", kv.cache_hit >= rr.cache_hit)]
    if ca is not None:
        out.append(info("slots fleet: cache hit, kv_aware / cache_aware / round_robin",
                        " / ".join(percent(r.cache_hit, ".1f") for r in (kv, ca, rr))))  # fmt: skip
    return out


# No leak: once the first requests' one-time allocations are done, resident memory levels off; the last sample may be
# at most 3 % above the first (allocator noise).
GROWTH_LIMIT = 1.03
# And all the soak's growth from the start stays within the prompt cache's limit (--cache-ram), plus 10 % for the
# allocator's own overhead: the prompt cache is what is allowed to grow, up to its limit.
OVER_CACHE_RAM = 1.1


def soak_targets(s: Soak | None) -> list[Target]:
    growth = f"slots RSS does not grow over the soak (last / first <= {GROWTH_LIMIT})"
    bounded = f"slots RSS growth over the soak <= --cache-ram ({SOAK_CACHE_RAM_MIB} MiB) + {100 * (OVER_CACHE_RAM - 1):.0f} %"
    if s is None:
        return [unmeasured(growth), unmeasured(bounded)]
    mb = f" ({s.rss_first_mb:.0f} -> {s.rss_last_mb:.0f} MB, peak {s.rss_peak_mb:.0f} MB)"
    of_cache = (s.rss_last_mb - s.rss_start_mb) / SOAK_CACHE_RAM_MIB
    return [
        Target(growth, f"{s.growth:.3f}{mb}", s.growth <= GROWTH_LIMIT),
        Target(bounded, f"{of_cache:.2f}x --cache-ram", of_cache <= OVER_CACHE_RAM),
    ]


# The host-RAM prompt cache: a long prefix restored from RAM on another slot must give its first token at least 10 times
# sooner than reading it cold (copying its KV back is far cheaper than computing it).
FROM_RAM_SPEEDUP = 10
# Cache reuse (--cache-reuse): editing an early message of a long chat must not re-read it all; the chunks after the
# edit are shifted into place, and at most 15 % of the chat is read again.
EDITED_READ_SHARE = 0.15


def kv_cache_targets(caching: Sequence[KvCache], cfg: Config) -> list[Target]:
    """The prompt cache and cache reuse on the slot server; llama-server's numbers on the same requests for information."""
    ram = (f"slots prompt cache: a ~{cfg.prefix_tokens}-token prefix from RAM on another slot, "
           f"first token >= {FROM_RAM_SPEEDUP}x faster than cold")  # fmt: skip
    edited = (f"slots cache reuse: an edited early message in a ~{cfg.chat_tokens}-token chat "
              f"re-reads <= {100 * EDITED_READ_SHARE:.0f} % of it")  # fmt: skip
    if not (kv := result_of(caching, "slots")):
        return [unmeasured(ram), unmeasured(edited)]
    out = [Target(ram, f"{kv.cold_ms / kv.ram_ms:.1f}x", kv.cold_ms / kv.ram_ms >= FROM_RAM_SPEEDUP)]
    share = kv.edited_read_share
    out.append(unmeasured(edited) if share is None else Target(edited, f"{100 * share:.0f} %", share <= EDITED_READ_SHARE))
    if real := result_of(caching, "llama-server"):
        measured = f"RAM {real.cold_ms / real.ram_ms:.1f}x faster than cold; re-reads {100 * (real.edited_read_share or 0):.0f} %"
        out.append(info("prompt cache and cache reuse, llama-server (same requests)", measured))
    return out


# The step budget (prompts read in chunks beside running streams) may cost at most 5 % of the throughput at the top level.
BUDGET_COST = 0.95


def budget_target(at: Levels, n: int) -> Target:
    name = f"slots aggregate tok/s with the step budget >= {BUDGET_COST}x without it ({n} streams)"
    slots, plain = at.get(("slots", n)), at.get((NO_BUDGET, n))
    if not slots or not plain:
        return unmeasured(name)
    r = slots.tokens_per_s / plain.tokens_per_s
    return Target(name, f"{r:.2f}x", r >= BUDGET_COST)


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


def greedy_info(g: GreedyDrift | None) -> list[Target]:
    """Information, not a target: where two tokens are nearly tied, a batch's shape can tip a greedy choice."""
    if g is None:
        return []
    name = f"greedy answers alone vs batched, {len(g.reviews)} requests on {g.slots} slots, one KV stream each"
    return [info(name, f"{g.runs_with_difference} of {g.runs} batched runs changed at least one answer; alone twice: {greedy_control(g)}")]


# Speculation where answers repeat their prompt: the slot server's speedup (its best --spec-type) at least llama-server's
# (its best ngram mode) at 1 stream, each against the same server without speculation, on the same prompts ...
SPEC_OVER_LLAMA_SERVER = 1.0
# ... and a gain at more streams, where a step's batch holds every stream's drafts (the step costs more, and fewer
# steps are saved) ...
SPEC_GAIN = 1.0
# ... while on free text (few drafts, mostly cut) every mode with the slow start costs at most 3 % of the tok/s without
# speculation (without it, as llama-server, a long draft cut at once costs ~20 one-token steps: shown, not judged).
SPEC_FREE_TEXT = 0.97


def speculation_targets(results: Sequence[Speculation], cfg: Config) -> list[Target]:
    """Copy-heavy prompts: the slot server's best speedup against llama-server's best at the first level, above 1 at the
    others; free text: each mode of the slot server with its slow start against no speculation; same answers and
    acceptance for information."""
    if not cfg.spec_streams or "speculation" in cfg.skip:
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
