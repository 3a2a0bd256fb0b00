"""A question this machine cannot answer: how many replicas a TTFT SLO needs at thousands of users, per policy, and how
the answer moves when a step costs what it costs on a GPU.

    users = scaled_trace(users=2000, rate=20)      # the trace's tenant mix, conversations arriving at 20 a second
    found = replicas_for_slo(users, "cache_aware", slo=1.0)   # the fewest replicas with TTFT p99 under 1 s
    found.replicas, found.tried                     # the answer, and every fleet size the search ran

Each replica is on its own machine (no shared cores) and runs ``llmkit serve slots``'s defaults unless ``config``
says otherwise. A p99 can be out of reach at any size: the prompts no replica has seen cost their whole prefill (a
policy that scatters a tenant's users makes every replica read its prefix once), so the search gives up when doubling
the fleet gains less than 5 %. The search assumes that more replicas never make the p99 worse (true of every policy here but
``consistent_hash``, whose ring can put two busy sessions together at any size): it doubles the fleet until the SLO
holds, then bisects; ``tried`` shows every point it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmkit.course.sim.cost import SERVER_STEP, Cost, GpuLikeCost, StepCost
from llmkit.course.sim.replica import ReplicaConfig
from llmkit.course.sim.run import Answers, simulate
from llmkit.course.trace import Summary, Trace, make_trace


def scaled_trace(users: int = 2000, rate: float = 20.0, seed: int = 0, **shape: Any) -> Trace:
    """The trace's tenant mix at scale: ``users`` conversations arriving as a Poisson process of ``rate`` per second,
    each as ``make_trace`` makes them (4 tenants, 4 turns, 2 s think time: ``shape`` changes them)."""
    return make_trace(seed=seed, conversations=users, rate=rate, **shape)


@dataclass
class Capacity:
    policy: str
    slo: float  # seconds of TTFT p99
    replicas: int  # the fewest that meet it (0: none: doubling the fleet stopped helping, or the search's limit)
    tried: dict[int, Summary] = field(default_factory=dict)  # every fleet size run, and what it measured
    curve: str = "cpu"  # the step cost curve it ran on (CURVES)


def replicas_for_slo(
    trace: Trace,
    policy: str,
    slo: float = 1.0,
    *,
    cost: Cost | None = None,
    config: ReplicaConfig | None = None,
    limit: int = 1024,
    max_tokens: int = 24,
    start: int = 1,
) -> Capacity:
    """The fewest replicas whose simulated TTFT p99 is under ``slo`` seconds on ``trace`` (doubling from ``start``, then
    bisection). A ``start`` above 1 saves the slowest runs, the small fleets whose queues hold thousands of requests,
    and takes ``start // 2`` replicas to fail: check it in ``tried`` if ``start`` met the SLO at once."""
    found = Capacity(policy, slo, 0)
    answers = Answers(max_tokens)

    def meets(n: int) -> bool:
        found.tried[n] = simulate(trace, n, policy, cost=cost, config=config, answers=answers).summary
        return found.tried[n].ttft_p99 < slo

    high = start
    while not meets(high):
        if high >= limit or (high > start and found.tried[high].ttft_p99 > 0.95 * found.tried[high // 2].ttft_p99):
            return found  # out of the search's range, or doubling the fleet no longer helps: the SLO is out of reach
        high = min(2 * high, limit)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    found.replicas = high
    return found


CURVES = ("cpu", "gpu-like")


def curve(name: str, cpu: StepCost | None = None) -> Cost:
    """The measured CPU curve (as the slot server steps: ``SERVER_STEP``), or the GPU-like shape at its one-token speed
    (``GpuLikeCost.like``)."""
    cpu = (cpu or StepCost.load()).scaled(SERVER_STEP)
    return cpu if name == "cpu" else GpuLikeCost.like(cpu)


def capacity_table(
    trace: Trace,
    policies: Sequence[str],
    slo: float = 1.0,
    curves: Sequence[str] = CURVES,
    *,
    cost: StepCost | None = None,
    config: ReplicaConfig | None = None,
) -> list[Capacity]:
    """``replicas_for_slo`` for each policy on each cost curve (``cost``: the CPU fit; each row's ``tried`` keeps every
    run's summary)."""
    rows = []
    for name in curves:
        for policy in policies:
            row = replicas_for_slo(trace, policy, slo, cost=curve(name, cost), config=config)
            row.curve = name
            rows.append(row)
    return rows


def capacity_markdown(rows: Sequence[Capacity]) -> str:
    """Per curve and policy: the replicas needed, and the TTFT p50/p99 and cache hits at that size (or at the largest tried)."""
    lines = [
        "| curve | policy | replicas for the SLO | TTFT p50 ms | TTFT p99 ms | cache hit | sizes tried |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        at = row.tried[row.replicas or max(row.tried)]
        needed = str(row.replicas) if row.replicas else f"out of reach (p99 {at.ttft_p99:.2f} s at {max(row.tried)})"
        tried = " ".join(str(n) for n in sorted(row.tried))
        ttft = f"{at.ttft_p50 * 1000:.0f} | {at.ttft_p99 * 1000:.0f}"
        lines.append(f"| {row.curve} | {row.policy} | {needed} | {ttft} | {at.cache_hit:.0%} | {tried} |")
    return "\n".join(lines)


def plot_capacity(rows: Sequence[Capacity], ax: Any = None) -> Any:
    """TTFT p99 against fleet size, one line per policy and curve (every size the searches ran), the SLO dashed."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for row in rows:
        sizes = sorted(row.tried)
        ax.plot(sizes, [row.tried[n].ttft_p99 for n in sizes], "o-" if row.curve == "cpu" else "s--", label=f"{row.policy} ({row.curve})")
    if rows:
        ax.axhline(rows[0].slo, color="grey", linestyle=":", label="SLO")
    ax.set(xscale="log", yscale="log", xlabel="replicas", ylabel="TTFT p99 (s)")
    ax.legend(fontsize="small")
    return ax
