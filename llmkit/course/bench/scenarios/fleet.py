"""Fleet: the router's policies in front of replicas of each server, on the same multi-tenant trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmkit.course.bench.config import FLEET_FLAGS, Config
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.targets import Target, info, percent, unmeasured


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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> list[FleetRun]:
    """Each server not skipped, the policies in front of its replicas."""
    return [run for server, flags in FLEET_FLAGS.items() if server not in cfg.skip for run in fleet_server_runs(server, flags, cfg)]


def fleet_server_runs(server: str, flags: tuple[str, ...], cfg: Config) -> list[FleetRun]:
    """The policies in front of ``server``: llama-server publishes no KV events, so kv_aware is the slot server's alone."""
    policies = [p for p in cfg.fleet_policies if p != "kv_aware" or server == "slots"]
    return fleet_runs(server, policies, cfg, flags)


def table(results: list[FleetRun]) -> str:
    lines = [
        "| server | policy | cache hit | TTFT p50 | TTFT p99 | tok/s | requests per replica | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per = " / ".join(f"{n}" for n in r.per_replica.values())
        lines.append(f"| {r.server} | {r.policy} | {percent(r.cache_hit, '.1f')} | {r.ttft_p50_ms:.0f} ms | {r.ttft_p99_ms:.0f} ms | "
                     f"{r.tokens_per_s:.1f} | {per} | {r.errors} of {r.requests} |")  # fmt: skip
    return "\n".join(lines)


def section(results: list[FleetRun], cfg: Config) -> str:
    return (f"## Fleet (vllm-router in front of 2 replicas at -t 1; a seeded trace of {cfg.fleet_conversations} chats of "
            f"{cfg.fleet_turns} turns over 4 tenants, {cfg.fleet_tokens} tokens per answer; a fresh fleet per policy)\n\n"
            + table(results))  # fmt: skip


def targets(results: list[FleetRun] | None, cfg: Config) -> list[Target]:
    return fleet_targets(results or [])


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


SCENARIO = Scenario("fleet", run, section, targets, wanted=lambda cfg: bool(cfg.fleet_policies))
