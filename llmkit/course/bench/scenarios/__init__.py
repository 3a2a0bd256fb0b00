"""What the bench measures, one scenario per module, every server treated alike.

    levels        the concurrency levels: n clients at once on every server, and the raw loop (no server) beside them
    apis          the same streams through chat, Responses and Messages, at 1 and 8 streams: tok/s per API vs chat
    prefix        first token behind a new long prefix (cold) vs behind the same prefix again (warm)
    arrivals      a burst of long prompts while streams run: the streams' worst gap, the arrivals' first token
    kv_cache      a long prefix back from the host-RAM prompt cache on another slot; an edited chat with cache reuse
    soak          many short requests, the server's resident memory sampled as they go
    speculation   draft-free speculative decoding on and off, on prompts whose answers repeat them and on free text
    priority      a high-priority request while every slot streams: waiting for a slot, or preempting one
    fleet         the router's policies in front of replicas, on a multi-tenant trace
    shared_prefix a burst of clients behind one system prompt, on the servers with and without --kv-share
    greedy        in-process, no server: do greedy answers alone and batched (one KV stream per slot) agree?

Each module ends with its ``SCENARIO`` (``bench.scenario.Scenario``): its name (its ``--skip`` name, its key in
``Measured`` and results.json), ``run`` (its results: a dataclass named after it, one per server and level), its
``section`` of results.md and its ``targets``. A new scenario is one module here and its line in ``SCENARIOS``, the
order a run takes them in: first those on the servers started together (``shared``), then those that start servers of
their own, then the in-process one, when no server is running and the engine has the cores.
"""

from __future__ import annotations

from typing import Any

from llmkit.course.bench.config import Config
from llmkit.course.bench.scenario import Measured, Scenario
from llmkit.course.bench.scenarios import (
    apis,
    arrivals,
    fleet,
    greedy,
    kv_cache,
    levels,
    prefix,
    priority,
    shared_prefix,
    soak,
    speculation,
)
from llmkit.course.bench.targets import Target

SCENARIOS: list[Scenario[Any]] = [
    levels.SCENARIO, apis.SCENARIO, prefix.SCENARIO, arrivals.SCENARIO,  # on the servers started together
    kv_cache.SCENARIO, soak.SCENARIO, speculation.SCENARIO, priority.SCENARIO, fleet.SCENARIO, shared_prefix.SCENARIO,
    greedy.SCENARIO,  # in-process
]  # fmt: skip


def judge(m: Measured, cfg: Config) -> list[Target]:
    """Every scenario's targets, judged on what it measured (one not measured: its targets say so)."""
    return [t for s in SCENARIOS for t in s.targets(m.get(s.name), cfg)]
