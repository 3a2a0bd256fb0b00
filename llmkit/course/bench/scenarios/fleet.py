"""Fleet: the router's policies in front of replicas of each server, on the same multi-tenant trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmkit.course.bench.config import Config

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class FleetRun:
    """One policy in front of ``replicas`` replicas of ``server``, on the seeded multi-tenant trace: the share of prompt
    tokens served from a cache (the servers' own counts), time to first token, tokens/s, requests per replica."""

    server: str
    policy: str
    requests: int
    errors: int
    cache_hit: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    per_replica: dict[str, int]


def fleet_runs(server: str, policies: Sequence[str], cfg: Config, flags: Sequence[str]) -> list[FleetRun]:
    """Each policy through a fresh fleet (cold caches) of 2 replicas at ``-t 1``, on the same trace (``llmkit.course.fleet.compare``)."""
    from llmkit.course import fleet, trace

    scenario = trace.make_trace(seed=0, conversations=cfg.fleet_conversations, turns=cfg.fleet_turns)
    out = []
    for policy, records in fleet.compare(server, policies, scenario, 2, flags, max_tokens=cfg.fleet_tokens).items():
        s = trace.summarize(records)
        per = {replica: n for replica, (n, _) in sorted(s.per_replica.items())}
        out.append(FleetRun(server, policy, s.requests, s.errors, s.cache_hit, 1e3 * s.ttft_p50, 1e3 * s.ttft_p99, s.tokens_per_s, per))
    return out
