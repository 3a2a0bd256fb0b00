"""What a bench run writes: markdown tables, the plot, and the targets judged on ratios measured in the same run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmkit.course.bench.config import API_RATIO, NO_BUDGET, RAW, SOAK_CACHE_RAM_MIB, Config
from llmkit.course.bench.scenarios import Row

GROWTH_LIMIT = 1.03  # soak: last RSS sample / first (after 100 requests) must stay under this


def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[Row]) -> str:
    columns = ["server", "streams", "tokens", "wall s", "aggregate tok/s", "TTFT median ms", "TTFT p90 ms",
               "per-stream tok/s", "busy slots/decode", "Python share of step"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        share = fmt(None if r.python_share is None else 100 * r.python_share, ".1f", " %")
        lines.append(
            f"| {r.server} | {r.concurrency} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_s:.1f} | {fmt(r.ttft_median_ms)} | "
            f"{fmt(r.ttft_p90_ms)} | {fmt(r.stream_tokens_per_s, '.1f')} | {fmt(r.busy_slots_per_decode, '.2f')} | {share} |"
        )
    return "\n".join(lines)


def apis_table(results: list[dict]) -> str:
    """One row per server, level and API: the median round's numbers, the median ratio to chat and the rounds' range."""
    columns = ["server", "streams", "API", "tokens", "wall s", "aggregate tok/s", "/ chat", "range over rounds", "TTFT median ms",
               "per-stream tok/s", "server CPU ms/token"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        tokens = f"{r['tokens']}" + ("" if r["min_tokens"] == r["budget"] else f" (fewest {r['min_tokens']} of {r['budget']})")
        lines.append(f"| {r['server']} | {r['streams']} | {r['api']} | {tokens} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ratio']:.3f} | {r['ratio_low']:.2f}-{r['ratio_high']:.2f} | {fmt(r['ttft_median_ms'])} | "
                     f"{fmt(r['stream_tokens_per_s'], '.1f')} | {fmt(r['cpu_ms_per_token'], '.2f')} |")  # fmt: skip
    return "\n".join(lines)


def prefix_table(results: list[dict]) -> str:
    lines = ["| server | cold TTFT ms | warm TTFT ms | cold / warm | cached tokens (warm) |", "|---|---|---|---|---|"]
    for p in results:
        cached = fmt(p["cached_tokens"], "d")
        lines.append(f"| {p['server']} | {p['cold_ms']:.0f} | {p['warm_ms']:.0f} | {p['speedup']:.1f}x | {cached} |")
    return "\n".join(lines)


def arrivals_table(results: list[dict]) -> str:
    head = [
        "server",
        "running",
        "arrivals",
        "gap p50 ms",
        "gap p99 ms",
        "gap max ms",
        "arrival TTFT median ms",
        "arrival TTFT max ms",
        "tok/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r['server']} | {r['running']} | {r['arrivals']} | {fmt(r['gap_p50_ms'])} | {fmt(r['gap_p99_ms'])} | "
                     f"{fmt(r['gap_max_ms'])} | {fmt(r['arrival_ttft_median_ms'])} | {fmt(r['arrival_ttft_max_ms'])} | "
                     f"{fmt(r['tokens_per_s'], '.1f')} |")  # fmt: skip
    return "\n".join(lines)


def soak_table(s: dict) -> str:
    samples = ", ".join(f"{n}: {mb:.0f}" for n, mb in s["samples"])
    return (
        f"{s['server']}, {s['requests']} requests. RSS MB at start {s['rss_start_mb']:.0f}, after the first "
        f"{s['samples'][1][0] if len(s['samples']) > 1 else 0} {s['rss_first_mb']:.0f}, last {s['rss_last_mb']:.0f}, "
        f"peak (VmHWM) {s['rss_peak_mb']:.0f}.\nSamples (requests: MB): {samples}"
    )


def greedy_control(g: dict) -> str:
    """The control: each review answered alone twice, identical or how many answers differed."""
    return "identical" if g["alone_twice_identical"] else f"{g['alone_twice_differed']} of {len(g['reviews'])} answers differed"


def greedy_table(g: dict) -> str:
    """Per review: how many batched runs changed its greedy answer; then any review, and the alone-twice control."""
    runs = g["runs"]
    lines = ["| review | batched runs whose answer differed from alone |", "|---|---|"]
    for r in g["reviews"]:
        text = r["review"] if len(r["review"]) <= 40 else r["review"][:39] + "…"
        lines.append(f"| {text} | {r['differed']} of {runs} |")
    lines.append(f"| any of the {len(g['reviews'])} | {g['runs_with_difference']} of {runs} |")
    return "\n".join(lines) + (
        f"\n\nControl, each review answered alone twice: {greedy_control(g)}. "
        f"The {runs} batched runs went through {g['batch_schedules']} distinct batch schedule"
        f"{'s' * (g['batch_schedules'] != 1)} (tokens per step). {g['seconds']:.0f} s in all."
    )


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


def kv_cache_table(results: list[dict]) -> str:
    head = "| server | cold first token | same slot | from RAM, other slot | cold / RAM | edited ~1,000-token chat: share read again |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        share = f"{100 * r['edited_read_share']:.0f} %" if r["edited_read_share"] is not None else "n/a"
        lines.append(f"| {r['server']} | {r['cold_ms']:.0f} ms | {r['same_slot_ms']:.0f} ms | {r['ram_ms']:.0f} ms "
                     f"({r['ram_cached_tokens']} cached) | {r['cold_ms'] / r['ram_ms']:.1f}x | "
                     f"{share} of {r['chat_tokens']} |")  # fmt: skip
    return "\n".join(lines)


def judge(
    rows: list[Row],
    prefix: list[dict],
    soaked: dict | None,
    cfg: Config,
    burst: Sequence[dict] = (),
    caching: Sequence[dict] = (),
    greedy: dict | None = None,
    apis: Sequence[dict] = (),
) -> list[tuple[str, str, str]]:
    """The targets: (target, measured, PASS | FAIL | n/a | info), judged on ratios of numbers from this run."""
    n = max(cfg.concurrency)
    at = {(r.server, r.concurrency): r for r in rows}
    slots, seq, raw = at.get(("slots", n)), at.get(("sequential", n)), at.get((RAW, n))
    out = []

    def check(target: str, ratio: float | None, ok, shown: str, note: str = "") -> None:
        if ratio is None:
            out.append((target, "not measured", "n/a"))
        else:
            out.append((target, shown + note, "PASS" if ok(ratio) else "FAIL"))

    r = slots.tokens_per_s / seq.tokens_per_s if slots and seq else None
    note = ""
    if raw and (raw1 := at.get((RAW, 1))):  # the most batching can give on this machine, these prompts
        note = f" (headroom here: raw loop {n} sequences / 1 = {raw.tokens_per_s / raw1.tokens_per_s:.2f}x)"
    check(f"slots aggregate tok/s >= 2.0x sequential ({n} streams)", r, lambda x: x >= 2.0, f"{r or 0:.2f}x", note)
    r = slots.tokens_per_s / raw.tokens_per_s if slots and raw else None
    target = f"slots aggregate tok/s >= 97 % of raw batched decode, same prompts and tokens ({n} sequences)"
    note = ""
    if slots and raw and slots.stream_tokens_per_s and raw.stream_tokens_per_s:  # the decode phase alone, prompts read
        note = f" (decode phase alone, per stream: {100 * slots.stream_tokens_per_s / raw.stream_tokens_per_s:.0f} %)"
    check(target, r, lambda x: x >= 0.97, f"{100 * (r or 0):.0f} %", note)
    for level in cfg.concurrency:
        mine, theirs = at.get(("slots", level)), at.get(("llama-server", level))
        share = mine.python_share if mine else None
        check(f"Python share of slot-server step time < 3 % ({level} streams)", share, lambda x: x < 0.03, f"{100 * (share or 0):.1f} %")
        r = mine.tokens_per_s / theirs.tokens_per_s if mine and theirs else None
        check(f"slots aggregate tok/s level with llama-server, >= 0.95x ({level} streams)", r, lambda x: x >= 0.95, f"{r or 0:.2f}x")
    api = {(a["server"], a["api"], a["streams"]): a for a in apis}
    for level in cfg.api_levels:
        chat = api.get(("slots", "chat", level))
        for name in ("responses", "messages"):
            a = api.get(("slots", name, level))
            target = f"slots streaming through {name}: aggregate tok/s >= {API_RATIO}x chat's ({level} streams)"
            if not a or not chat:
                out.append((target, "not measured", "n/a"))
                continue
            shown = (f"{a['ratio']:.3f}x (rounds {a['ratio_low']:.2f}-{a['ratio_high']:.2f}; "
                     f"chat's own rounds {chat['ratio_low']:.2f}-{chat['ratio_high']:.2f})")  # fmt: skip
            if a["min_tokens"] < a["budget"]:
                shown += f", fewest tokens {a['min_tokens']} of {a['budget']}"
            if a["ratio"] >= API_RATIO:
                out.append((target, shown, "PASS"))
            elif a["ratio"] < chat["ratio_low"]:  # slower than chat ever was against itself: beyond this run's noise
                out.append((target, shown, "FAIL"))
            else:  # the machine moved chat alone further than that: this run cannot tell
                out.append((target, shown + ": within chat's own spread, not judged", "n/a"))
        responses, messages = (api.get(("llama-server", name, level)) for name in ("responses", "messages"))
        if responses and messages:
            out.append((f"llama-server streaming through responses, messages: aggregate tok/s / chat's ({level} streams)",
                        f"{responses['ratio']:.3f}x, {messages['ratio']:.3f}x", "info"))  # fmt: skip
    p = next((p for p in prefix if p["server"] == "slots"), None)
    r = p["speedup"] if p else None
    check("slots prefix reuse: cold TTFT / warm TTFT >= 20x", r, lambda x: x >= 20, f"{r or 0:.1f}x")
    r = soaked["growth"] if soaked else None
    note = f" ({soaked['rss_first_mb']:.0f} -> {soaked['rss_last_mb']:.0f} MB, peak {soaked['rss_peak_mb']:.0f} MB)" if soaked else ""
    check(f"slots RSS does not grow over the soak (last / first <= {GROWTH_LIMIT})", r, lambda x: x <= GROWTH_LIMIT, f"{r or 0:.3f}", note)
    r = (soaked["rss_last_mb"] - soaked["rss_start_mb"]) / SOAK_CACHE_RAM_MIB if soaked else None
    check(
        f"slots RSS growth over the soak <= --cache-ram ({SOAK_CACHE_RAM_MIB} MiB) + 10 %",
        r,
        lambda x: x <= 1.1,
        f"{r or 0:.2f}x --cache-ram",
    )
    kv = next((c for c in caching if c["server"] == "slots"), None)
    r = kv["cold_ms"] / kv["ram_ms"] if kv else None
    check(f"slots prompt cache: a ~{cfg.prefix_tokens}-token prefix from RAM on another slot, first token >= 10x faster than cold", r,
          lambda x: x >= 10, f"{r or 0:.1f}x")  # fmt: skip
    r = kv["edited_read_share"] if kv else None
    check(f"slots cache reuse: an edited early message in a ~{cfg.chat_tokens}-token chat re-reads <= 15 % of it", r, lambda x: x <= 0.15,
          f"{100 * (r or 0):.0f} %")  # fmt: skip
    if (real := next((c for c in caching if c["server"] == "llama-server"), None)) and kv:
        out.append(("prompt cache and cache reuse, llama-server (same requests)",
                    f"RAM {real['cold_ms'] / real['ram_ms']:.1f}x faster than cold; "
                    f"re-reads {100 * (real['edited_read_share'] or 0):.0f} %", "info"))  # fmt: skip
    nb = at.get((NO_BUDGET, n))
    r = slots.tokens_per_s / nb.tokens_per_s if slots and nb else None
    check(f"slots aggregate tok/s with the step budget >= 0.95x without it ({n} streams)", r, lambda x: x >= 0.95, f"{r or 0:.2f}x")
    scene = {(b["server"], b["running"]): b for b in burst}
    for k in cfg.arrivals:
        ours, plain, real = scene.get(("slots", k)), scene.get((NO_BUDGET, k)), scene.get(("llama-server", k))
        for base, limit in ((plain, "without it"), (real, "llama-server's")):
            r = ours["gap_max_ms"] / base["gap_max_ms"] if ours and base and base["gap_max_ms"] else None
            check(
                f"burst with {k} running: worst gap between two tokens with the budget <= 0.25x {limit}",
                r,
                lambda x: x <= 0.25,
                f"{r or 0:.2f}x",
            )
        r = ours["arrival_ttft_median_ms"] / plain["arrival_ttft_median_ms"] if ours and plain else None
        check(
            f"burst with {k} running: arrivals' median first token with the budget <= 1.5x without it",
            r,
            lambda x: x <= 1.5,
            f"{r or 0:.2f}x",
        )
    if greedy:  # information, not a target: where two tokens are nearly tied, a batch's shape can tip a greedy choice
        out.append((f"greedy answers alone vs batched, {len(greedy['reviews'])} requests on {greedy['slots']} slots, one KV stream each",
                    f"{greedy['runs_with_difference']} of {greedy['runs']} batched runs changed at least one answer; "
                    f"alone twice: {greedy_control(greedy)}", "info"))  # fmt: skip
    others = [s for s in dict.fromkeys(r.server for r in rows) if s not in ("sequential", "slots", NO_BUDGET, RAW)]
    for other in others:  # for information: the production server(s) on the same prompts
        if slots and (o := at.get((other, n))):
            ttft = f"{slots.ttft_median_ms / o.ttft_median_ms:.2f}x" if slots.ttft_median_ms and o.ttft_median_ms else "n/a"
            ratios = f"{slots.tokens_per_s / o.tokens_per_s:.2f}x, {ttft}"
            out.append((f"slots / {other}: aggregate tok/s, median TTFT ({n} streams)", ratios, "info"))
    return out


def targets_table(targets: list[tuple[str, str, str]]) -> str:
    return "\n".join(["| target | measured | verdict |", "|---|---|---|", *(f"| {t} | {m} | {v} |" for t, m, v in targets)])
