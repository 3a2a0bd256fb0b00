"""What the engine tells about itself: a frozen snapshot of its state (the totals and steps: ``steps``).

``Engine.status()`` returns an ``EngineStatus``: values, not live objects, taken by the engine's own
thread at the end of a turn of its loop, so the server's ``/slots``, ``/metrics`` and ``/props`` and a
notebook's picture read one step's state, never a step half done. (llama-server reads the same state on
its queue's worker thread while the loop decodes; its readers wait in their HTTP threads, as the server's
routes here wait in a worker thread, off the event loop.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from llmkit.engine.config import EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import Request
from llmkit.engine.slot import Slot
from llmkit.engine.steps import Counters

STATUS_TAIL = 80  # tokens of each slot's end that a status carries (a picture of the slot shows them as text)


@dataclass(frozen=True)
class JobStatus:
    """The request running on a slot, as ``GET /slots`` shows it (llama-server's names)."""

    id_task: int
    status: str  # "prompt" | "generating"
    n_prompt_tokens: int
    n_prompt_tokens_cache: int  # reused from the slot's KV cache
    n_prompt_tokens_processed: int  # evaluated so far
    n_decoded: int  # tokens generated so far
    params: dict  # RequestParams.to_dict()
    draft_n: int  # speculation: tokens drafted so far ...
    draft_n_accepted: int  # ... and accepted

    @classmethod
    def of(cls, job: Job) -> JobStatus:
        r = job.request
        status = "generating" if job.is_generating else "prompt"
        n_read = min(job.n_prompt_done, len(r.prompt)) - job.n_cached
        params = r.params.to_dict()
        return cls(r.id, status, len(r.prompt), job.n_cached, n_read, len(job.output), params, job.draft_n, job.draft_n_accepted)


@dataclass(frozen=True)
class SlotStatus:
    id: int
    n_ctx: int  # this slot's share of the context
    n_cached: int  # tokens in its KV cache
    n_restored: int  # prompts brought back from the prompt cache
    job: JobStatus | None  # None: idle
    tail: tuple[int, ...] = ()  # the last tokens of its KV cache, and with a job the last it generated (for a picture)
    n_shared: int = 0  # of n_cached, cells another sequence holds too (kv_share)

    @classmethod
    def of(cls, slot: Slot, n_tail: int = 0, holders: Counter[int] | None = None) -> SlotStatus:
        """``holders``: how many sequences hold each cell (``Cells.holders``), to count this slot's shared cells."""
        job = slot.job
        tail = (job.output if job is not None and job.output else slot.cache_tokens)[-n_tail:] if n_tail else []
        status = JobStatus.of(job) if job is not None else None
        n_shared = sum(holders[cell] > 1 for cell in slot.cells) if holders is not None else 0
        return cls(slot.id, slot.n_ctx, slot.n_past, slot.n_restored, status, tuple(tail), n_shared)


class Waiting(NamedTuple):
    """A request in the queue."""

    id: int
    n_prompt: int
    priority: int


class Cells(NamedTuple):
    """The KV cells the sequences hold (the slots, and with ``kv_share`` the resident prefixes), each counted once
    however many hold it (``kv_share``: a prefix's cells are shared, so N requests on one prefix hold one prefix and N
    suffixes)."""

    used: int = 0  # cells some sequence holds
    shared: int = 0  # of them, held by two sequences or more
    idle: int = 0  # of them, held by idle slots and resident prefixes alone: resident for a later request, needed by none running

    @staticmethod
    def holders(slots: Sequence[Slot]) -> Counter[int]:
        """How many sequences hold each cell."""
        return Counter(cell for slot in slots for cell in set(slot.cells))

    @classmethod
    def of(cls, slots: Sequence[Slot], holders: Counter[int]) -> Cells:
        running = {cell for slot in slots if slot.job is not None for cell in slot.cells}
        return cls(len(holders), sum(n > 1 for n in holders.values()), len(holders.keys() - running))


@dataclass(frozen=True)
class EngineStatus:
    """The engine at the end of one turn of its loop, published by its thread (``Engine.status``)."""

    config: EngineConfig  # the settings in effect
    slots: tuple[SlotStatus, ...]
    waiting: tuple[Waiting, ...]  # requests queued for a slot, in arrival order
    counters: Counters  # a copy
    prompt_cache: dict | None  # PromptCache.to_dict(), None when off
    step: int = 0  # turns of the loop so far (Engine.n_steps)
    t: float = 0.0  # time.perf_counter() when it was taken
    cells: Cells = field(default_factory=Cells)  # the KV cells the slots hold

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        slots: Sequence[Slot],
        waiting: Sequence[Request],
        counters: Counters,
        cache: PromptCache | None,
        step: int,
        resident: Sequence[Slot] = (),
    ) -> EngineStatus:
        """Taken from the engine's live objects, as values (by its thread, between two steps); ``resident``: the
        sequences that keep prefixes beside the slots (``kv_share``), counted in the cells."""
        holders = Cells.holders([*slots, *resident])
        return cls(
            config, tuple(SlotStatus.of(slot, STATUS_TAIL, holders) for slot in slots),
            tuple(Waiting(r.id, len(r.prompt), r.params.priority) for r in waiting), counters.copy(),
            cache.to_dict() if cache is not None else None, step, time.perf_counter(), Cells.of(slots, holders),
        )  # fmt: skip

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    @property
    def n_busy(self) -> int:
        return sum(s.job is not None for s in self.slots)

    @property
    def n_ctx_slot(self) -> int:
        return self.slots[0].n_ctx
