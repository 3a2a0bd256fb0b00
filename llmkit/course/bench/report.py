"""What a bench run writes: results.md (each scenario's section, then the targets), results.json, and the plot of the
concurrency levels (bench.png). Each scenario writes its own section (``Scenario.section``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from llmkit.course.bench.config import RAW, Config
from llmkit.course.bench.scenario import Measured
from llmkit.course.bench.scenarios import SCENARIOS
from llmkit.course.bench.scenarios.levels import Row
from llmkit.course.bench.targets import Target


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


def markdown(m: Measured, targets: list[Target], cfg: Config) -> str:
    """results.md (and what ``llmkit bench`` prints): a title, a section for each scenario that ran, the targets."""
    title = (f"# llmkit bench: {max(cfg.concurrency)} streams max, {cfg.max_tokens} tokens each, threads {cfg.threads or os.cpu_count()}, "
             f"median of {cfg.rounds} round{'s' * (cfg.rounds > 1)}")  # fmt: skip
    sections = [s.section(m[s.name], cfg) for s in SCENARIOS if m.get(s.name)]
    return "\n\n".join([title, *filter(None, sections), "## Targets\n\n" + targets_table(targets)]) + "\n"


def data(m: Measured, targets: list[Target], cfg: Config) -> dict:
    """results.json: the config, every scenario's results as they were measured (under its name), and the targets."""
    return {
        "config": {**dataclasses.asdict(cfg), "out": str(cfg.out), "skip": sorted(cfg.skip)},
        **{name: plain(results) for name, results in m.items()},
        "targets": [{"target": t.name, "measured": t.measured, "verdict": t.verdict} for t in targets],
    }


def plain(results: Any) -> Any:
    """A scenario's results as JSON values: its dataclasses as dicts."""
    if dataclasses.is_dataclass(results) and not isinstance(results, type):
        return dataclasses.asdict(results)
    return [plain(r) for r in results] if isinstance(results, list) else results
