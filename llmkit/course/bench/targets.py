"""The bench's targets, judged on ratios measured in the same run: ``judge`` makes one ``Target`` per line, each
computed by a short function below with its threshold as a named constant just above it (what it is, and why that
number). ``report`` writes them in results.md and results.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from llmkit.course.bench.config import (
    NO_BUDGET,
    PRIORITY_SERVERS,
    RAW,
    SMALL_BATCH,
    SMALL_BATCH_FLAGS,
    SOAK_CACHE_RAM_MIB,
    SPEC_MODES,
    SPEC_SLOW_START,
    Config,
    spec_mode,
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

Levels = dict[tuple[str, int], Row]  # (server, concurrent streams) -> its row


class OfServer(Protocol):
    @property
    def server(self) -> str: ...


S = TypeVar("S", bound=OfServer)  # one server's result in a scenario: PrefixReuse, KvCache, ...


def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def percent(share: float | None, spec: str = ".0f") -> str:
    return fmt(None if share is None else 100 * share, spec, " %")


def greedy_control(g: GreedyDrift) -> str:
    """The control: each review answered alone twice, identical or how many answers differed."""
    return "identical" if g.alone_twice_identical else f"{g.alone_twice_differed} of {len(g.reviews)} answers differed"


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
