"""The model against the real fleet: the same seeded trace through N slot servers behind vllm-router, and through the
model of them; TTFT p50 and p99 and tokens/s side by side, with the model's error in %.

    rows = compare(make_trace(seed=0), replicas=(1, 2, 3), cost=StepCost.load(), cores=2)
    print(table(rows))

A measurement, not a test: it starts real fleets (``llmkit.course.fleet``), ~2 minutes per replica count on 2 cores.
The command that reruns it (on a quiet machine, calibrated there first):

    python -m llmkit sim calibrate -o cost.json && python -m llmkit sim check --cost cost.json --replicas 1 2 3

The model is given what the replay measured of each answer's length (``answer_lengths``): it predicts time, not what
the model writes. Replicas share the machine's cores (``cores``): three replicas at ``-t 1`` on two cores cannot each
run at their solo speed, and the model slows every step by ``(busy + background) / cores`` when the replicas stepping
at once and the machine's other busy threads (``background``: sampled while the real fleet runs, ``Background``)
outnumber the cores (``replica.Cores``). On a machine shared with other work that background is the model's largest
uncertainty: near saturation, 4 or 6 other busy threads move the TTFT p50 several-fold.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from llmkit.course.sim.cost import SERVER_STEP, Cost, StepCost
from llmkit.course.sim.replica import Cores
from llmkit.course.sim.run import Answers, SimResult, answer_lengths, simulate
from llmkit.course.trace import Record, Summary, Trace, summarize

if TYPE_CHECKING:
    from llmkit.course.fleet import Fleet

METRICS = ("ttft_p50", "ttft_p99", "tokens_per_s", "cache_hit")


@dataclass
class Comparison:
    replicas: int
    policy: str
    real: Summary
    sim: Summary
    background: float = 0.0  # other programs' runnable threads while the real fleet ran (the model's Cores.background)
    records: list[Record] = field(default_factory=list)  # the real replay's, request by request ...
    sim_records: list[Record] = field(default_factory=list)  # ... and the model's

    def error(self, metric: str) -> float:
        """(simulated - real) / real, in %."""
        real, sim = getattr(self.real, metric), getattr(self.sim, metric)
        return 100 * (sim - real) / real if real else math.nan


def runnable_threads(pids: Sequence[int]) -> int:
    """Threads of these processes running or ready to run now (state R in ``/proc/PID/task/TID/stat``)."""
    n = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError, IndexError):
                n += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
    return n


def scheduled(pids: Sequence[int]) -> tuple[float, float]:
    """Seconds these processes' threads have run on a core, and waited on a run queue for one, so far
    (``/proc/PID/task/TID/schedstat``'s first two fields, in ns)."""
    ran = waited = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            with contextlib.suppress(OSError, ValueError):
                on_cpu, on_queue = stat.read_text().split()[:2]
                ran, waited = ran + int(on_cpu), waited + int(on_queue)
    return ran / 1e9, waited / 1e9


class Background(threading.Thread):
    """While a real fleet runs: ten times a second, the machine's runnable threads that are not the replicas'
    (``/proc/loadavg``'s running count, less the replicas' and this sampler): everything else that competes with the
    replicas' steps for the cores, the router and the replaying client included. Their mean is the model's
    ``Cores.background`` (a load average taken before the run would miss what starts during it).

    And what that competition did: the replicas' threads' time on a core against their time waiting for one, from the
    start to ``done`` (``share``: the part of their runnable time they ran; a step's wall time is its CPU time plus
    its wait, measured to 1 %, ``scripts/sim_bias.py``). The model can take it instead of the count (``Cores.share``)."""

    def __init__(self, replica_pids: Sequence[int]):
        super().__init__(daemon=True)
        self.pids, self.done = list(replica_pids), threading.Event()
        self.samples: list[int] = []
        self.start_end = [scheduled(self.pids), (0.0, 0.0)]

    def run(self) -> None:
        self.start_end[0] = scheduled(self.pids)
        while not self.done.wait(0.1):
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            self.samples.append(max(0, running - 1 - runnable_threads(self.pids)))
        self.start_end[1] = scheduled(self.pids)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else os.getloadavg()[0]

    @property
    def share(self) -> float:
        """Of the replicas' runnable time from the start to ``done``, the part they ran (1.0: they never waited)."""
        self.join(5)
        (ran0, waited0), (ran1, waited1) = self.start_end
        ran, waited = ran1 - ran0, waited1 - waited0
        return ran / (ran + waited) if ran > 0 else 1.0


def real_fleet(trace: Trace, replicas: int, policy: str, max_tokens: int) -> tuple[list[Record], Background]:
    """The trace through a real fleet; and what competed with it meanwhile (``Background``)."""
    from llmkit.course import fleet

    with fleet.start(replicas, "slots", policy) as running:
        return asyncio.run(areal_run(running, trace, max_tokens))


async def areal_run(running: Fleet, trace: Trace, max_tokens: int) -> tuple[list[Record], Background]:
    """The trace through a running fleet (in a notebook's event loop), a ``Background`` sampler beside it."""
    from llmkit.course import fleet

    background = Background([replica.process.pid for replica in running.replicas])
    background.start()
    try:
        return await fleet.arun_trace(running, trace, max_tokens=max_tokens), background
    finally:
        background.done.set()


def render_cost(url: str, pid: int, messages: list[dict], calls: int = 50) -> tuple[float, float]:
    """What a prefix-aware router's ``/render`` call costs a worker (``url``, its process ``pid``): CPU seconds and
    seconds to the answer, each the mean of ``calls`` calls one after another."""
    import httpx

    ran, t0 = scheduled([pid])[0], time.perf_counter()
    for _ in range(calls):
        httpx.post(f"{url}/v1/chat/completions/render", json={"model": "any", "messages": messages}, timeout=60).raise_for_status()
    return (scheduled([pid])[0] - ran) / calls, (time.perf_counter() - t0) / calls


def modelled(
    trace: Trace, records: Sequence[Record], replicas: int, policy: str, cost: Cost, cores: Cores, max_tokens: int, **model: Any
) -> SimResult:
    """The model of the fleet that produced ``records``, its answers as long as theirs, its steps as the slot server's
    (a ``StepCost`` fit of the bare engine scaled by ``SERVER_STEP``); ``model``: more of ``simulate``'s settings."""
    answers = Answers(max_tokens, answer_lengths(records))
    served = cost.scaled(SERVER_STEP) if isinstance(cost, StepCost) else cost
    return simulate(trace, replicas, policy, cost=served, cores=cores.cores, background=cores.background, share=cores.share,
                    answers=answers, **model)  # fmt: skip


def compare(
    trace: Trace,
    replicas: Sequence[int] = (1, 2, 3),
    policy: str = "cache_aware",
    *,
    cost: Cost | None = None,
    cores: float | None = None,
    max_tokens: int = 24,
) -> list[Comparison]:
    """Each replica count: the real fleet's replay, then the model's (``cores``: this machine's, by default; its
    background: the other programs' runnable threads measured while the real fleet ran)."""
    cost = cost or StepCost.load()
    cores = cores or os.cpu_count()
    rows = []
    for n in replicas:
        records, background = real_fleet(trace, n, policy, max_tokens)
        sim = modelled(trace, records, n, policy, cost, contention(cores, background), max_tokens)
        rows.append(Comparison(n, policy, summarize(records), sim.summary, background.mean, records, sim.records))
    return rows


RealRun = tuple[Sequence[Record], "float | Background"]  # a real replay's records, and the other programs' busy threads meanwhile


@dataclass
class Repeated:
    """One fleet (replicas, policy) run for real several times, and the model of each run (its answers as long, its
    background as measured): the model's error beside the real runs' own spread."""

    replicas: int
    policy: str
    real: list[Summary]
    sim: list[Summary]
    backgrounds: list[float]
    sim_records: list[list[Record]] = field(default_factory=list)

    @property
    def background(self) -> float:
        """The median of the real runs' other busy threads."""
        return statistics.median(self.backgrounds)

    def median(self, metric: str, side: str = "real") -> float:
        return statistics.median(getattr(s, metric) for s in getattr(self, side))

    def error(self, metric: str) -> float:
        """(the model's median - the real median) / the real median, in %."""
        real = self.median(metric)
        return 100 * (self.median(metric, "sim") - real) / real if real else math.nan

    def spread(self, metric: str) -> float:
        """The real runs' range (max - min) / their median, in %: how far one real run lands from another."""
        values = [getattr(s, metric) for s in self.real]
        return 100 * (max(values) - min(values)) / self.median(metric)


def contention(cores: float | None, background: float | Background) -> Cores:
    """The model's cores for a real run: its other programs' busy threads (a count), or a ``Background`` sampler's
    measured share of a core (``Cores.share``: what the competition did, not how many competed)."""
    if isinstance(background, Background):
        return Cores(cores, background.mean, share=background.share)
    return Cores(cores, background)


def check_runs(
    real_runs: Mapping[tuple[int, str], RealRun | Sequence[RealRun]], trace: Trace | Callable[[int, str], Trace], cost: Cost,
    cores: float | None, max_tokens: int, **model: Any,
) -> dict[tuple[int, str], Repeated]:  # fmt: skip
    """Each (replicas, policy) of ``real_runs`` (one real run as a tuple, or a list of them), modelled run by run on ``trace`` (or
    ``trace(replicas, policy)``) with ``cores`` shared, each run's background and answer lengths; ``model``: more of
    ``simulate``'s settings (``overhead``...)."""
    rows = {}
    for (n, policy), given in real_runs.items():
        runs = [given] if isinstance(given, tuple) else given  # one run: a (records, background) tuple; several: a list
        row = Repeated(n, policy, [], [], [])
        for records, background in cast(Sequence[RealRun], runs):
            of = trace(n, policy) if callable(trace) else trace
            result = modelled(of, records, n, policy, cost, contention(cores, background), max_tokens, **model)
            row.real.append(summarize(records))
            row.sim.append(result.summary)
            row.backgrounds.append(background if isinstance(background, float | int) else background.mean)
            row.sim_records.append(result.records)
        rows[n, policy] = row
    return rows


def table(rows: Sequence[Comparison]) -> str:
    """Markdown: per replica count, each metric real / simulated / error."""
    head = "| replicas | policy | " + " | ".join(f"{m} real | sim | err %" for m in METRICS) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(METRICS))]
    for row in rows:
        cells = []
        for m in METRICS:
            scale = 1000 if m.startswith("ttft") else 1
            cells += [f"{getattr(row.real, m) * scale:.3g}", f"{getattr(row.sim, m) * scale:.3g}", f"{row.error(m):+.0f}"]
        lines.append(f"| {row.replicas} | {row.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_check(rows: Sequence[Comparison], axes: Any = None) -> Any:
    """Real and simulated TTFT p50, p99 and tokens/s by fleet size, side by side."""
    import matplotlib.pyplot as plt

    axes = axes if axes is not None else plt.subplots(1, 3, figsize=(11, 3.5))[1]
    sizes = [row.replicas for row in rows]
    for ax, metric in zip(axes, METRICS[:3], strict=True):
        ax.plot(sizes, [getattr(r.real, metric) for r in rows], "o-", label="real fleet")
        ax.plot(sizes, [getattr(r.sim, metric) for r in rows], "s--", label="model")
        ax.set(title=metric, xlabel="replicas", xticks=sizes)
    axes[0].legend()
    return axes
