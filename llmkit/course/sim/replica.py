"""One slot server in the model: the engine's own ``Scheduler`` (its slots, its prompt cache, its queue, its policy)
over ``TokenMemory``, a KV cache of token counts without tensors, and its engine loop as a simpy process.

Every decision is the engine's code, not a copy: admission and the slot choice, the prompt cache's swaps, what a
slot keeps of a new prompt, idle slots copied to RAM and cleared, each step's batch (``build_batch``, the step
budget included) and its commit. What the model adds is time, in the runner's place: each step costs what the
calibrated ``Cost`` says for its batch (plus the prompt-cache copies of its admissions), slowed when more replicas
step at once than the machine has cores (``Cores``); and the answer, in the sampler's: each request's tokens are given.

What is simplified: no speculation; a request's HTTP handling and the router's hop are a fixed ``latency``, not CPU
work; no context shift, no cache reuse (``--cache-reuse 0``, the default); the step that admits requests starts at
once (the real loop also waits for the next request's tokenization).
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, cast

import simpy

from llmkit.course.sim.cost import Cost, pairs
from llmkit.course.sim.router import HeldBlocks
from llmkit.engine.config import AUTO_PARALLEL, DEFAULT_STEP_TOKENS, EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import End, Request, RequestParams
from llmkit.engine.scheduler import Chunk, Scheduler
from llmkit.engine.slot import Slot
from llmkit.engine.steps import Counters, Share
from llmkit.sampling import Sampler
from llmkit.text import Detokenizer, StopMatcher

PARAMS = RequestParams()  # what the trace's requests ask of the slot choice: cache_prompt on, no slot named


class TokenMemory:
    """The KV cache without tensors (a ``KVMemory``, as ``llama.Context`` is), for ``Slot`` and ``PromptCache``: a
    sequence's state is one byte per token (the cache's byte limit is converted to tokens, ``Replica.__init__``), and
    every token copied to or from RAM is counted, for the step's time."""

    can_shift = True

    def __init__(self, slots: list[Slot], n_ctx: int, n_ctx_seq: int):
        self.slots, self.n_ctx, self.n_ctx_seq = slots, n_ctx, n_ctx_seq
        self.copied = 0  # tokens copied to or from the prompt cache since the last step

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        return True

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        pass

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        pass

    def seq_state(self, seq_id: int) -> mmap.mmap:
        n = len(self.slots[seq_id].cache_tokens)
        self.copied += n
        return mmap.mmap(-1, max(n, 1))

    def set_seq_state(self, seq_id: int, data: mmap.mmap | bytearray) -> bool:
        self.copied += len(data)
        return True


@dataclass
class SimRequest:
    """One turn of a conversation, as a replica sees it; its times are filled in as it runs."""

    id: int
    prompt: list[int]
    answer: list[int]  # the tokens it will sample (the last one may be the end token)
    on_first: Callable[[SimRequest], object] = lambda request: None  # its first token is sampled
    on_done: Callable[[SimRequest], object] = lambda request: None  # its answer is complete
    n_cached: int = 0  # prompt tokens found in the slot's KV cache
    t_first: float = 0.0  # when its first token was sampled
    t_end: float = 0.0


@dataclass
class Cores:
    """The machine's cores, shared by every replica on it (``cores=None``: each replica on its own machine).

    The calibrated costs are CPU seconds: a step's time on a core of its own. A step that starts while ``busy`` replicas
    step (itself included) beside ``background`` busy threads of other programs (a shared machine's load average) gets
    ``cores / (busy + background)`` of a core when they outnumber the cores, so it runs that much longer. That fair
    share is a bound, not what Linux gives: a thread that sleeps between steps is owed time by the scheduler, and the
    replicas got 1.2-1.6x their fair share beside 3-7 other busy threads (``scripts/sim_bias.py``). ``share``, when a
    real run measured it (``check.Background.share``), is what they got: every step then takes ``1 / share`` times its cost.
    """

    cores: float | None = None
    background: float = 0.0
    busy: int = 0
    share: float | None = None

    def slowdown(self) -> float:
        if self.cores is None:
            return 1.0
        return 1 / self.share if self.share else max(1.0, (self.busy + self.background) / self.cores)


@dataclass(frozen=True)
class ReplicaConfig:
    """A slot server's settings that the model reads (``llmkit serve slots``'s defaults)."""

    n_slots: int = AUTO_PARALLEL  # -np -1: 4 slots ...
    kv_unified: bool = True  # ... on a unified KV cache (idle slots are cleared once copied to the prompt cache)
    kv_share: bool = False  # --kv-share: a prefix's cells taken by every request that starts with it (SGLang's radix cache)
    n_ctx: int = 8192
    n_batch: int = 2048
    step_tokens: int = DEFAULT_STEP_TOKENS
    cache_ram_mib: int = 8192
    state_bytes_per_token: int = 23_040  # SmolLM2-135M's KV cells per token (f16): what --cache-ram holds

    def engine_config(self) -> EngineConfig:
        """The engine's settings these stand for (its scheduler runs on them)."""
        return EngineConfig(
            n_parallel=self.n_slots, n_ctx=self.n_ctx, n_batch=self.n_batch, kv_unified=self.kv_unified,
            step_tokens=self.step_tokens, cache_ram_mib=self.cache_ram_mib, kv_share=self.kv_share,
        ).resolved()  # fmt: skip


@dataclass
class Replica:
    env: simpy.Environment
    index: int
    cost: Cost
    cores: Cores
    config: ReplicaConfig = field(default_factory=ReplicaConfig)
    held: HeldBlocks | None = None  # what its KV events would tell a kv_aware router (kept only for that policy)

    def __post_init__(self) -> None:
        config, n_ctx_seq = self.config.engine_config(), self.config.n_ctx // (1 if self.config.kv_unified else self.config.n_slots)
        self.memory = TokenMemory([], self.config.n_ctx, n_ctx_seq)
        self.scheduler = Scheduler(config, self.memory, start_job, Counters())
        self.memory.slots = self.scheduler.holders
        if self.cache is not None and self.cache.limit_bytes:
            self.cache.limit_bytes //= self.config.state_bytes_per_token  # one byte per token in TokenMemory
        self.runs: dict[int, SimRequest] = {}  # by the engine request's id
        self.batches: deque[tuple[Share, ...]] = deque(maxlen=10_000)  # the last steps' batches, as StepRecord.batch
        self.work = self.env.event()
        self.steps = 0
        self.cpu_seconds = self.step_seconds_total = 0.0  # the steps' cost on a core of their own; their time as slowed
        self.env.process(self.loop())

    @property
    def slots(self) -> list[Slot]:
        return self.scheduler.slots

    @property
    def cache(self) -> PromptCache | None:
        return self.scheduler.prompt_cache

    def submit(self, run: SimRequest) -> None:
        request = Request(run.prompt, PARAMS)
        self.runs[request.id] = run
        self.scheduler.add(request)
        if not self.work.triggered:
            self.work.succeed()

    def loop(self) -> Generator[simpy.Event, Any, None]:
        """Wait for work, then step, again (``Engine.loop``): the scheduler admits and plans one batch (the engine's own
        ``Scheduler``), the step's time passes, the scheduler commits it, each job that asked samples its next token."""
        while True:
            if not self.scheduler.waiting and not self.scheduler.busy():
                self.work = self.env.event()
                yield self.work
            for started in self.scheduler.admit():
                self.runs[started.job.request.id].n_cached = started.job.n_cached
            self.sync_held()
            plan = self.scheduler.plan(self.config.n_batch, {})
            self.cores.busy += 1
            cpu = self.step_seconds(plan)
            seconds = cpu * self.cores.slowdown()
            yield self.env.timeout(seconds)
            self.cpu_seconds, self.step_seconds_total = self.cpu_seconds + cpu, self.step_seconds_total + seconds
            self.cores.busy -= 1
            Scheduler.commit(plan)
            self.batches.append(tuple(Share(c.slot.id, len(c.tokens), c.is_prompt, c.i_logits >= 0) for c in plan))
            for chunk in plan:
                if chunk.i_logits >= 0:
                    self.sample(chunk)
            self.sync_held()
            self.steps += 1

    def sync_held(self) -> None:
        if self.held is not None:
            self.held.sync(self.scheduler.holders, self.cache, shares=self.config.kv_share)

    def step_seconds(self, plan: list[Chunk]) -> float:
        """The calibrated cost of the batch, plus the prompt-cache copies made while admitting its requests."""
        n_streams = sum(1 for chunk in plan if not chunk.is_prompt)
        n_prompt = sum(len(chunk.tokens) for chunk in plan if chunk.is_prompt)
        context = sum(pairs(len(chunk.tokens), chunk.slot.n_past) for chunk in plan) / 1000
        copied, self.memory.copied = self.memory.copied, 0
        return self.cost(n_prompt, n_streams, context) + self.cost.state_per_token * copied

    def sample(self, chunk: Chunk) -> None:
        """The job's next token is its answer's next one (the model gives the answer; ``Engine.sample`` would sample it).
        Its first marks the first token's time; its last ends it: the slot keeps its KV cache for the next request."""
        job, run = chunk.job, self.runs[chunk.job.request.id]
        job.last_token = run.answer[len(job.output)]  # (Job.push, without the text: the model writes none)
        job.output.append(job.last_token)
        if len(job.output) == 1:
            run.t_first = self.env.now
            run.on_first(run)
        if len(job.output) == len(run.answer):
            self.scheduler.end(job.request, job.outcome(End.LIMIT, chunk.slot.id, chunk.slot.n_past), chunk.slot)
            del self.runs[job.request.id]
            run.t_end = self.env.now
            run.on_done(run)


def start_job(request: Request, n_keep: int, n_moved: int) -> Job:
    """The run of a request, without a model: no sampler (``sample`` takes the answer's tokens), no text."""
    return Job(request, cast(Sampler, NoSampler()), Detokenizer(bytes), StopMatcher(), request.prompt, n_keep, n_cached=n_keep)


class NoSampler:
    def close(self) -> None:
        pass
