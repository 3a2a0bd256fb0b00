"""What the bench measures, one scenario per module, every server treated alike.

    apis          api_streaming: the same streams through chat, Responses and Messages, at 1 and 8 streams: tok/s per API vs chat
    prefix        prefix_reuse: first token behind a new long prefix (cold) vs behind the same prefix again (warm)
    arrivals      a burst of long prompts while streams run: the streams' worst gap, the arrivals' first token
    kv_cache      a long prefix back from the host-RAM prompt cache on another slot; an edited chat with cache reuse
    soak          many short requests, the server's resident memory sampled as they go
    greedy        greedy_drift: in-process, no server: do greedy answers alone and batched (one KV stream per slot) agree?
    speculation   draft-free speculative decoding on and off, on prompts whose answers repeat them and on free text
    priority      a high-priority request while every slot streams: waiting for a slot, or preempting one
    fleet         fleet_runs: the router's policies in front of replicas, on a multi-tenant trace
    shared_prefix a burst of clients behind one system prompt, on the servers with and without --kv-share (its own
                  table and targets already here: the shape the others are to take)

(The concurrency levels, ``all_levels`` and its ``Row``, are ``bench.levels``'.) Each scenario returns its numbers in
a dataclass named after it (``prefix_reuse`` -> ``PrefixReuse``), one per server (and level), and ``Measured`` holds
them all for one run. A new scenario is a module here with an async function that takes a ``Server`` (and the
``Config``) and returns its dataclass; ``llmkit.course.bench.run`` calls it for every server, ``report`` turns its
results into a table and ``targets``, if it has one, into its targets. (``greedy_drift`` is about llama.cpp's numbers,
not a server's: it runs once, on an ``Engine`` of its own.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmkit.course.bench.levels import Row
from llmkit.course.bench.scenarios.apis import ApiStreaming
from llmkit.course.bench.scenarios.arrivals import Arrivals
from llmkit.course.bench.scenarios.fleet import FleetRun
from llmkit.course.bench.scenarios.greedy import GreedyDrift
from llmkit.course.bench.scenarios.kv_cache import KvCache
from llmkit.course.bench.scenarios.prefix import PrefixReuse
from llmkit.course.bench.scenarios.priority import Priority
from llmkit.course.bench.scenarios.shared_prefix import SharedPrefix, TraceRun
from llmkit.course.bench.scenarios.soak import Soak
from llmkit.course.bench.scenarios.speculation import Speculation


@dataclass
class Measured:
    """Every scenario's results of one bench run (empty, or None, where it was skipped)."""

    rows: list[Row] = field(default_factory=list)
    apis: list[ApiStreaming] = field(default_factory=list)
    prefix: list[PrefixReuse] = field(default_factory=list)
    arrivals: list[Arrivals] = field(default_factory=list)
    kv_cache: list[KvCache] = field(default_factory=list)
    soak: Soak | None = None
    greedy: GreedyDrift | None = None
    speculation: list[Speculation] = field(default_factory=list)
    priority: list[Priority] = field(default_factory=list)
    fleet: list[FleetRun] = field(default_factory=list)
    shared_prefix: list[SharedPrefix] = field(default_factory=list)
    shared_trace: list[TraceRun] = field(default_factory=list)
