"""One slot server in the model: its slots, its prompt cache, its queue, and its engine loop as a simpy process.

The decisions are the engine's own code, not a copy: which slot a request gets (``scheduler.choose_slot``), whether
the slot's prompt goes to the prompt cache first and which cached prompt comes back (``scheduler.swaps_prompt``,
``PromptCache.save/load/update``), what a slot keeps of a new prompt (``Slot.reuse``), idle slots copied to RAM and
cleared on a unified KV cache (``Engine.save_idle_slots``). They run on the real ``Slot`` and ``PromptCache`` over
``TokenMemory``, a KV cache of token counts without tensors. What the model adds is time: each step costs what the
calibrated ``Cost`` says for its batch (plus the prompt-cache copies of its admissions), slowed when more replicas
step at once than the machine has cores (``Cores``).

What is simplified: one token per step per stream (no speculation); the answer's length is given (the model does
not sample); a request's HTTP handling and the router's hop are a fixed ``latency``, not CPU work; no context shift,
no cache reuse (``--cache-reuse 0``, the default); the step that admits requests starts at once (the real loop also
waits for the next request's tokenization).
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from llmkit.course.sim.cost import Cost, pairs
from llmkit.course.sim.router import HeldBlocks
from llmkit.engine.config import AUTO_PARALLEL, DEFAULT_STEP_TOKENS
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import RequestParams
from llmkit.engine.scheduler import choose_slot, swaps_prompt
from llmkit.engine.slot import Slot
from llmkit.llama import Context

PARAMS = RequestParams()  # what the trace's requests ask of the slot choice: cache_prompt on, no slot named


class TokenMemory(Context):
    """The KV cache without tensors, for ``Slot`` and ``PromptCache``: a sequence's state is one byte per token (the
    cache's byte limit is converted to tokens, ``Replica.__init__``), and every token copied to or from RAM is counted,
    for the step's time. No llama.cpp context is created."""

    def __init__(self, slots: list[Slot]):  # (no super().__init__: it would create a llama.cpp context)
        self.slots = slots
        self.copied = 0  # tokens copied to or from the prompt cache since the last step

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        return True

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
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
class SimJob:
    """A request on a slot (``engine.job.Job``): how much of its prompt is in the KV cache, how many tokens it made."""

    request: SimRequest
    slot: Slot
    n_prompt_done: int
    n_output: int = 0

    @property
    def is_generating(self) -> bool:
        return self.n_prompt_done == len(self.request.prompt)


@dataclass
class Cores:
    """The machine's cores, shared by every replica on it (``cores=None``: each replica on its own machine).

    The calibrated costs are CPU seconds: a step's time on a core of its own. A step that starts while ``busy`` replicas
    step (itself included) beside ``background`` busy threads of other programs (a shared machine's load average) gets
    ``cores / (busy + background)`` of a core when they outnumber the cores, so it runs that much longer.
    """

    cores: float | None = None
    background: float = 0.0
    busy: int = 0

    def slowdown(self) -> float:
        return 1.0 if self.cores is None else max(1.0, (self.busy + self.background) / self.cores)


@dataclass(frozen=True)
class ReplicaConfig:
    """A slot server's settings that the model reads (``llmkit serve slots``'s defaults)."""

    n_slots: int = AUTO_PARALLEL  # -np -1: 4 slots ...
    kv_unified: bool = True  # ... on a unified KV cache (idle slots are cleared once copied to the prompt cache)
    n_ctx: int = 8192
    n_batch: int = 2048
    step_tokens: int = DEFAULT_STEP_TOKENS
    cache_ram_mib: int = 8192
    state_bytes_per_token: int = 23_040  # SmolLM2-135M's KV cells per token (f16): what --cache-ram holds


@dataclass
class Replica:
    env: simpy.Environment
    index: int
    cost: Cost
    cores: Cores
    config: ReplicaConfig = field(default_factory=ReplicaConfig)
    held: HeldBlocks | None = None  # what its KV events would tell a kv_aware router (kept only for that policy)

    def __post_init__(self) -> None:
        self.slots = [Slot(i, self.config.n_ctx) for i in range(self.config.n_slots)]
        self.memory = TokenMemory(self.slots)
        self.cache = PromptCache(self.config.cache_ram_mib, self.config.n_ctx) if self.config.cache_ram_mib else None
        if self.cache is not None and self.cache.limit_bytes:
            self.cache.limit_bytes //= self.config.state_bytes_per_token  # one byte per token in TokenMemory
        self.waiting: deque[SimRequest] = deque()
        self.jobs: dict[int, SimJob] = {}  # by slot id
        self.work = self.env.event()
        self.steps = 0
        self.env.process(self.loop())

    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)
        if not self.work.triggered:
            self.work.succeed()

    def loop(self) -> Generator[simpy.Event, Any, None]:
        """Wait for work, then step, again (``Engine.loop``): admit, plan one batch, let its time pass, commit it."""
        while True:
            if not self.waiting and not self.jobs:
                self.work = self.env.event()
                yield self.work
            self.admit()
            plan = self.plan()
            self.cores.busy += 1
            yield self.env.timeout(self.step_seconds(plan) * self.cores.slowdown())
            self.cores.busy -= 1
            self.commit(plan)
            self.steps += 1

    def admit(self) -> None:
        """Waiting requests into idle slots, first come first served (``Engine.admit`` with llama-server's policy)."""
        while self.waiting and (slot := choose_slot(self.idle_slots(), PARAMS, self.waiting[0].prompt)) is not None:
            request = self.waiting.popleft()
            if self.cache is not None and swaps_prompt(slot, request.prompt, PARAMS):
                slot.save_prompt(self.cache, self.memory)
                slot.load_prompt(self.cache, self.memory, request.prompt)
                self.cache.update()
            request.n_cached, _ = slot.reuse(self.memory, request.prompt, True, 0)
            self.jobs[slot.id] = SimJob(request, slot, request.n_cached)
            self.save_idle_slots()
        if self.held is not None:
            self.held.sync(self.slots, self.cache)

    def idle_slots(self) -> list[Slot]:
        """(A simulated job is not a ``Slot.job``: the model keeps its jobs in ``jobs``, by slot.)"""
        return [slot for slot in self.slots if slot.id not in self.jobs]

    def save_idle_slots(self) -> None:
        """Idle slots to the prompt cache, and cleared on a unified KV cache (``Engine.save_idle_slots``)."""
        if self.cache is None:
            return
        for slot in self.idle_slots():
            if slot.save_prompt(self.cache, self.memory):
                self.cache.update()
            if self.config.kv_unified:
                slot.clear_prompt(self.memory)

    def plan(self) -> list[tuple[SimJob, int]]:
        """Each stream's token, then prompt chunks in arrival order within the step's budget (``build_batch``)."""
        streams = [(job, 1) for job in self.jobs.values() if job.is_generating]
        reading = sorted((job for job in self.jobs.values() if not job.is_generating), key=lambda job: job.request.id)
        room = (self.config.step_tokens if streams else self.config.n_batch) - len(streams)
        chunks = []
        for job in reading:
            if room <= 0:
                break
            n = min(room, len(job.request.prompt) - job.n_prompt_done)
            chunks.append((job, n))
            room -= n
        return streams + chunks

    def step_seconds(self, plan: list[tuple[SimJob, int]]) -> float:
        """The calibrated cost of the batch, plus the prompt-cache copies made while admitting its requests."""
        n_streams = sum(1 for job, _ in plan if job.is_generating)
        n_prompt = sum(n for job, n in plan) - n_streams
        context = sum(pairs(n, job.slot.n_past) for job, n in plan) / 1000
        copied, self.memory.copied = self.memory.copied, 0
        return self.cost(n_prompt, n_streams, context) + self.cost.state_per_token * copied

    def commit(self, plan: list[tuple[SimJob, int]]) -> None:
        """The batch is in the KV cache; every job that read its last prompt token, or decoded, samples one token."""
        for job, n in plan:
            request = job.request
            if job.is_generating:
                job.slot.append(request.answer[job.n_output - 1 : job.n_output])
            else:
                job.slot.append(request.prompt[job.n_prompt_done : job.n_prompt_done + n])
                job.n_prompt_done += n
                if not job.is_generating:
                    continue
                request.t_first = self.env.now
                request.on_first(request)
            job.n_output += 1
            if job.n_output >= len(request.answer):
                self.finish(job)
        if self.held is not None:
            self.held.sync(self.slots, self.cache)

    def finish(self, job: SimJob) -> None:
        """The answer is complete: the slot keeps its KV cache for the next request (``Engine.finish``)."""
        del self.jobs[job.slot.id]
        job.slot.t_last_used = self.env.now
        job.request.t_end = self.env.now
        job.request.on_done(job.request)

    @property
    def load(self) -> int:
        """Requests waiting or running here."""
        return len(self.waiting) + len(self.jobs)
