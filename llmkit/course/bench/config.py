"""What one bench run is asked to do (``Config``), and the names every part of it shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmkit.engine.config import DEFAULT_STEP_TOKENS

RAW = "raw decode (no server)"  # the row name of the raw loop
NO_BUDGET = "slots, no budget"  # the slot server with --step-tokens 0
# llama-server with -b and -ub at the slot server's step budget (the arrivals scenario only): every step it makes holds
# at most that many tokens, as the slot server's steps do while a stream runs
SMALL_BATCH_FLAGS = f"-b {DEFAULT_STEP_TOKENS} -ub {DEFAULT_STEP_TOKENS}"
SMALL_BATCH = f"llama-server {SMALL_BATCH_FLAGS}"
CACHE_REUSE = 64  # --cache-reuse of the kv_cache scenario's servers (llama-server's presets use 256)
SOAK_CACHE_RAM_MIB = 64  # --cache-ram of the soak's server: small, so that 1000 distinct prompts must evict
SPEC_MODES = ("ngram-simple", "ngram-mod")  # the speculation scenario's --spec-type modes, on both servers
SPEC_SLOW_START = 4  # the slot server's --spec-slow-start in the speculation scenario, beside 0 (llama-server's way)


def spec_mode(spec_type: str, slow_start: int = 0) -> str:
    """The speculation scenario's name of a server's settings: "ngram-mod", "ngram-mod, slow start 4"."""
    return f"{spec_type}, slow start {slow_start}" if slow_start else spec_type


GREEDY_SLOTS = 4  # the greedy-drift engine's slots (explicit n_parallel: one KV stream each), as chapter 6's server
# the fleet scenario: vllm-router's policies in front of 2 replicas of each server on a seeded multi-tenant trace
# (llmkit.course.trace); kv_aware routes on KV events, which only the slot server publishes (--kv-events)
FLEET_POLICIES = ("round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware")
FLEET_FLAGS = {"slots": ("--kv-events",), "llama-server": ()}
PRIORITY_SLOTS = 2  # the priority scenario's slots, all busy with low-priority streams when the high-priority request comes
# the priority scenario's slot servers: name -> flags (llama-server has no priority: it is the first one's way)
PRIORITY_SERVERS = {
    "slots, llama-server's policy (waits)": (),
    "slots, priority (preempts, KV kept in RAM)": ("--scheduling-policy", "priority"),
    "slots, priority (preempts, KV read again)": ("--scheduling-policy", "priority", "--cache-ram", "0"),
}


@dataclass
class Config:
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    max_tokens: int = 128
    threads: int | None = None  # CPU threads for the servers we start and the raw loop (None: all cores)
    model: str | None = None
    urls: dict[str, str] = field(default_factory=dict)  # name -> base URL of an OpenAI-compatible server
    out: Path = Path("bench-results")
    # servers (sequential, slots, no-budget, llama-server, raw) and scenarios (scenarios.SCENARIOS' names) left out
    skip: frozenset[str] = frozenset()
    ctx_per_slot: int = 1024
    prefix_tokens: int = 800
    chat_tokens: int = 1000  # the kv_cache scenario's edited chat
    cache_prompt: bool = False  # let servers reuse cached prompts in the concurrency levels
    soak: int = 0  # requests in the soak test (0: no soak)
    rounds: int = 1  # runs of each concurrency level per server (and of each speculation pair); the median run is reported
    arrivals: tuple[int, ...] = (1, 4)  # running streams in the arrivals scenario (empty: skip it)
    arrival_prompts: int = 3  # long prompts arriving at once
    arrival_tokens: int = 350  # tokens of each arriving prompt
    soak_every: int = 100
    greedy_runs: int = 0  # greedy drift: batched runs of chapter 6's 8 reviews, each compared with the answers alone (0: skip it)
    greedy_tokens: int = 64  # greedy drift: max_tokens of each answer (chapter 6's MAX_TOKENS)
    api_streams: tuple[int, ...] = (1, 8)  # API streaming cost: concurrent streams through each chat API (empty: skip it)
    api_rounds: int = 5  # API streaming cost: rounds, each API's ratio to chat taken within a round, the median reported
    spec_streams: tuple[int, ...] = (1, 4)  # speculation: concurrent clients, each sending every prompt in turn (empty: skip it)
    priority_rounds: int = 3  # priority: high-priority requests sent, each while every slot streams (0: skip it)
    shared_bursts: tuple[int, ...] = (4, 8)  # shared prefix: clients sending one system prompt at once (empty: skip it)
    shared_trace: int = 12  # shared prefix: conversations of the multi-tenant trace each server replays (0: skip it)
    fleet_policies: tuple[str, ...] = FLEET_POLICIES  # fleet: the router's policies compared (empty: skip it)
    fleet_conversations: int = 10  # fleet: the trace's users (4 tenants), each ...
    fleet_turns: int = 4  # ... asking this many questions in a chat that grows
    fleet_tokens: int = 24  # fleet: max_tokens of each answer

    @property
    def api_levels(self) -> tuple[int, ...]:
        """``api_streams`` capped at the slots of the servers started here (``max(concurrency)``): more would wait for one."""
        return tuple(sorted({min(n, max(self.concurrency)) for n in self.api_streams}))


class BenchError(RuntimeError):
    pass
