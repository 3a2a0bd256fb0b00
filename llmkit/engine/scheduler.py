"""The scheduler: which request runs on which slot, and what each step reads (~ the part of llama-server's
server context that keeps the queue, the slots and the prompt cache, and decides: ``process_single_task``,
``get_available_slot``, the batch building of ``update_slots``). It runs no model: it works over a ``KVMemory``
(``llama.Context``, or the fleet simulation's token counts), and the engine runs what it plans (nano-vllm's split:
the scheduler plans, the runner decodes, the scheduler commits).

    scheduler.add(request)          a request waits (in arrival order; the policy orders them)
    scheduler.admit()               waiting requests into slots, as the ``Policy`` says: ``Admission``s, each launched
    plan = scheduler.plan(n, drafts)   the next step's batch (``build_batch``, pure), which the engine decodes ...
    scheduler.commit(plan)          ... and then commits: the tokens are in the slots' cells now
    scheduler.end(request, result)  every request ends here, from a slot or from the queue

The decisions are pure functions over the queue and the slots, each testable alone: ``admission``, ``swaps_prompt``
(the prompt cache's update of get_available_slot), ``build_batch``; the policy's own in ``llmkit.engine.policy``;
``kv_share``'s (llmkit's own) in ``llmkit.engine.sharing``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from llmkit.engine.config import EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.memory import KVMemory
from llmkit.engine.policy import SIMILARITY_THRESHOLD, LlamaServerPolicy, Policy, Running
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import End, KVState, Outcome, Request, RequestParams
from llmkit.engine.sharing import frees_cells, prefix_donor, resident_for, to_keep, waits_for_cells
from llmkit.engine.slot import Slot
from llmkit.engine.steps import Counters
from llmkit.engine.tokens import common_prefix
from llmkit.timings import Timings

log = logging.getLogger("llmkit.engine")
KEEP_THRESHOLD = 0.5  # get_available_slot: a slot about to lose over half of what it holds goes to the prompt cache first
MIN_SHARED = 32  # kv_share: tokens of a prefix being read that are worth waiting for rather than reading them too


class Admission(NamedTuple):
    """A waiting request and the slot it gets; with ``preempt``, the job on that slot leaves it first."""

    request: Request
    slot: Slot
    preempt: bool = False


def admission(
    waiting: Sequence[Request], slots: Sequence[Slot], policy: Policy, tokens: Callable[[Request], list[int]], resident: Sequence[Slot] = ()
) -> Admission | None:
    """The next request to start, in the policy's order: the first that gets an idle slot; else the first that may
    take a busy one (llama-server: process_single_task, get_available_slot; it never preempts). None: all wait.
    ``tokens(request)``: what the request needs in its slot's KV cache; ``resident``: the prefixes kept beside the
    slots (kv_share), which the order sees."""
    ordered = policy.order(waiting, [*slots, *resident])
    for request in ordered:
        if (slot := policy.choose_slot(slots, request, tokens(request))) is not None:
            return Admission(request, slot)
    for request in ordered:
        if (slot := policy.victim(slots, request)) is not None:
            return Admission(request, slot, preempt=True)
    return None


def swaps_prompt(slot: Slot, tokens: list[int], params: RequestParams) -> bool:
    """Whether the chosen slot's prompt goes to the prompt cache and the best cached one comes back.

    llama-server's ``update_cache`` in ``get_available_slot``: yes when the slot would keep
    under half of what it holds (``f_keep < 0.5``), which covers a slot chosen as least
    recently used (its prompt is not the request's) and one named by ``id_slot`` that
    shares little with the prompt (a named slot "still goes through cache update logic";
    an empty one does not: its f_keep is 0/0); no when the prompt is similar and keeps at
    least half. (And no without ``cache_prompt``: the request would throw the restored
    prompt away.)
    """
    if not params.cache_prompt:
        return False
    lcp = common_prefix(slot.cache_tokens, tokens)
    if lcp / len(tokens) > SIMILARITY_THRESHOLD:  # chosen by similarity (Slot.similarity)
        return lcp / len(slot.cache_tokens) < KEEP_THRESHOLD
    return params.id_slot is None or bool(slot.cache_tokens)  # least recently used, or named and not similar


@dataclass(frozen=True)
class Chunk:
    """What one job puts in a step's batch: ``tokens`` at positions ``pos``, ``pos + 1``, ... of its slot.

    ``i_logits``: where in the batch its last token is, if the step samples from it (-1: it does not,
    a prompt chunk that is not the prompt's end). A stream's chunk is the token it sampled last step,
    then its ``draft`` if it speculates: the step samples at each of those (``logit_rows``).
    """

    slot: Slot
    job: Job
    tokens: list[int]
    pos: int
    i_logits: int
    is_prompt: bool  # prompt tokens (else the token sampled last step, and its draft)

    @property
    def draft(self) -> list[int]:
        """The tokens guessed to follow a stream's sampled token (speculation; empty: none)."""
        return [] if self.is_prompt else self.tokens[1:]

    @property
    def logit_rows(self) -> range:
        """The batch rows the step samples from, in order: the last token's, and with a draft every one's."""
        return range(self.i_logits - len(self.draft), self.i_logits + 1) if self.i_logits >= 0 else range(0)


def build_batch(
    busy: Sequence[Running],
    capacity: int,
    budget: int = 0,
    drafts: Mapping[int, list[int]] | None = None,
    prompt_order: Callable[[Sequence[Running]], list[Running]] | None = None,
) -> list[Chunk]:
    """Plan one ``llama_decode``: what each busy slot puts in the batch, in order. Changes nothing.

    Mirrors the batch building in llama-server's ``pre_decode`` (called by ``update_slots``):
    1. every generating slot adds the token it sampled last step (and its draft, if it speculates:
       ``drafts``, by slot id, from ``Engine.propose_drafts``);
    2. slots still reading their prompt add prompt tokens while the step has
       room (a long prompt continues next step: chunked prefill), in the policy's
       ``prompt_order`` (llama-server's: slot order; llmkit's default: oldest request first,
       so a request is never overtaken by a later one that landed in a lower slot);
    of a prompt, only the very last token asks for logits, since only there do we sample.

    ``budget`` caps the tokens of a step that carries running streams (0: the batch's ``capacity``,
    llama-server's ``n_batch``): stall-free batching (Sarathi-Serve; vLLM's chunked prefill), a burst
    of long prompts read a chunk per step while the streams keep getting a token every step. A step
    with no running stream keeps no one waiting: its prompts fill the batch.
    """
    plan, n_tokens = [], 0
    for slot, job in busy:
        if job.is_generating:
            draft = (drafts or {}).get(slot.id, [])
            n_tokens += 1 + len(draft)
            plan.append(Chunk(slot, job, [job.last_token, *draft], slot.n_past, n_tokens - 1, False))
    n_drafted = n_tokens - len(plan)  # a draft does not count against the budget: the stream's own tokens, checked in bulk
    limit = min(budget + n_drafted if budget else capacity, capacity) if plan else capacity
    for slot, job in (prompt_order or LlamaServerPolicy().prompt_order)([Running(s, j) for s, j in busy if not j.is_generating]):
        room = limit - n_tokens
        if room <= 0:
            break
        tokens = job.prompt_left[:room]
        last = job.n_prompt_done + len(tokens) == len(job.context)
        n_tokens += len(tokens)
        plan.append(Chunk(slot, job, tokens, slot.n_past, n_tokens - 1 if last else -1, True))
    return plan


class Started(NamedTuple):
    """A job that ``admit`` put on a slot; ``handed``: tokens another engine generated for it (disaggregated prefill),
    which the engine delivers before the job goes on (``Engine.go_on_from``)."""

    slot: Slot
    job: Job
    handed: tuple[int, ...] = ()


class Scheduler:
    """The queue, the slots and the prompt cache of one engine, and every decision about them (see the module).

    ``start_job(request, n_keep, n_moved)`` makes the run of a request on a slot that holds ``n_keep`` of its tokens
    already (the engine's: ``Job.start`` with its model; the simulation's, without one). Only the engine's thread calls it.
    """

    def __init__(self, config: EngineConfig, memory: KVMemory, start_job: Callable[[Request, int, int], Job], counters: Counters):
        self.config, self.memory, self.start_job, self.counters = config, memory, start_job, counters
        self.policy = config.policy  # who goes first, which slot, who makes room (llama-server's rules by default)
        self.slots = [Slot(i, memory.n_ctx_seq) for i in range(config.n_parallel)]
        # kv_share: sequences after the slots' that keep prefixes no slot holds (never given a job; SGLang's radix cache)
        self.resident = [Slot(i, memory.n_ctx_seq) for i in range(config.n_parallel, config.n_seq_max)]
        self.prompt_cache = PromptCache(config.cache_ram_mib, memory.n_ctx, config.cache_choice) if config.cache_ram_mib != 0 else None
        self.waiting: deque[Request] = deque()  # in arrival order (the policy orders them)
        self.suspended: dict[int, Job] = {}  # preempted jobs, by request id: their requests wait again
        self._faults: set[str] = set()  # the kinds of fault the policy showed, each logged once

    def busy(self) -> list[Running]:
        return [Running(slot, slot.job) for slot in self.slots if slot.job is not None]

    @property
    def holders(self) -> list[Slot]:
        """Every sequence that holds KV cells: the slots, then the resident prefixes (``kv_share``)."""
        return [*self.slots, *self.resident]

    def add(self, request: Request) -> None:
        """``request`` waits, at its place of arrival (a preempted one goes back where it was)."""
        later = next((i for i, r in enumerate(self.waiting) if r.id > request.id), len(self.waiting))
        self.waiting.insert(later, request)

    def tokens_of(self, request: Request) -> list[int]:
        """What ``request`` needs in its slot's KV cache: its prompt (after a preemption, its prompt and what it generated)."""
        job = self.suspended.get(request.id)
        return request.prompt if job is None else [*request.prompt, *job.output]

    # --- admission (process_single_task) ----------------------------------------

    def admit(self) -> list[Started]:
        """Move waiting requests into slots, as the policy orders them (process_single_task). A job started in this
        turn is not preempted in it: a policy that would (a ping-pong) waits for the next step."""
        started: list[Started] = []
        while (found := self.next_admission()) is not None:
            if found.preempt and (any(s.slot is found.slot for s in started) or not self.preempted(found)):
                self.add(found.request)
                break
            try:  # building a grammar sampler can fail, or a prompt-cache copy: this request alone fails
                started.append(self.launch(found.slot, found.request))
            except Exception as exc:  # noqa: BLE001
                found.slot.release(self.memory)
                self.drop(found.request, error=exc)
            self.save_idle_slots()
        return started

    def next_admission(self) -> Admission | None:
        """The next request to start and its slot, out of the queue (cancelled requests leave it first)."""
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self.drop(request)
        waiting = list(self.waiting)
        if self.config.kv_share:  # a request whose prefix a slot is reading waits for its cells
            waiting = [r for r in waiting if not waits_for_cells(self.holders, self.tokens_of(r), MIN_SHARED)]
        if (found := self.checked_admission(waiting)) is not None:
            self.waiting.remove(found.request)
        return found

    def checked_admission(self, waiting: list[Request]) -> Admission | None:
        """The policy's choice, checked: if it raises, or names a request that is not waiting, an idle slot to preempt or
        a busy one to fill, the scheduler says so in its log (once per kind of fault) and admits by llama-server's rule."""
        try:
            found = admission(waiting, self.slots, self.policy, self.tokens_of, self.resident)
            if found is None or self._usable(found, waiting):
                return found
            self._policy_fault("chose an unusable slot or request", str(found), "admitting by llama-server's rule")
        except Exception as exc:  # noqa: BLE001 -- a plug-in's bug costs its own decision, never a request
            self._policy_fault("raised while admitting", repr(exc), "admitting by llama-server's rule")
        return admission(waiting, self.slots, LlamaServerPolicy(), self.tokens_of, self.resident)

    def _usable(self, found: Admission, waiting: list[Request]) -> bool:
        """A request that is waiting, and a slot of this engine: idle to fill, busy to preempt."""
        return any(r is found.request for r in waiting) and any(s is found.slot for s in self.slots) and found.slot.is_idle != found.preempt

    def _policy_fault(self, kind: str, detail: str, instead: str) -> None:
        """Say once per kind of fault what the policy did, and what the scheduler does instead."""
        if kind not in self._faults:
            self._faults.add(kind)
            log.warning("scheduling policy %s %s (%s); %s", self.policy.name, kind, detail, instead)

    def hear(self, hook: str, *args: object) -> None:
        """Tell the policy what happened (``observe`` a step, a request ``finished``); its fault is logged, never raised."""
        try:
            getattr(self.policy, hook)(*args)
        except Exception as exc:  # noqa: BLE001 -- as in checked_admission
            self._policy_fault(f"raised in {hook}", repr(exc), "going on")

    def preempted(self, found: Admission) -> bool:
        """Preempt the job on the admission's slot; False (logged): it stays there, and the request waits."""
        try:
            self.preempt(found.slot)
            return True
        except Exception:
            log.exception("preempting slot %d failed; request %d waits", found.slot.id, found.request.id)
            return False

    def preempt(self, slot: Slot) -> None:
        """Take the job off ``slot`` for a request that goes first (llmkit's; llama-server never preempts): its KV cache
        goes to the prompt cache (when the cache takes it; else the job reads it again when it goes on), the job waits
        in ``suspended``, its request in the queue at its place of arrival, its stream paused."""
        job = slot.job
        assert job is not None, "only a busy slot is preempted"
        self.cache_prompt(slot)
        slot.release(self.memory)
        job.request.suspend()
        self.suspended[job.request.id] = job
        self.counters.record_preemption()
        self.add(job.request)

    # --- a request onto its slot (launch_slot_with_task) -------------------------------

    def launch(self, slot: Slot, request: Request) -> Started:
        """Start ``request`` on ``slot``, or go on with its preempted job (llama-server: launch_slot_with_task): the slot
        keeps what it holds of the request's tokens (a prefix, chunks moved into place), its job reads the rest."""
        if request.kv is not None and request.id not in self.suspended and (started := self.launch_from(slot, request, request.kv)):
            return started
        tokens, params = self.tokens_of(request), request.params
        if self.config.kv_share:
            self.keep_resident(slot, tokens)
            if params.cache_prompt:
                self.share_prefix(slot, tokens)
        self.swap_prompt(slot, tokens, request, resuming=request.id in self.suspended)
        n_keep, n_moved = slot.reuse(self.memory, tokens, params.cache_prompt, params.n_cache_reuse)
        job = self.suspended.pop(request.id, None)
        if job is None:
            job = self.start_job(request, n_keep, n_moved)  # may raise: the request fails alone
        else:
            job.resume(n_keep)
        slot.job = job
        request.start(slot.id, job.n_cached)  # a streamed answer can send its status line now
        return Started(slot, job)

    def launch_from(self, slot: Slot, request: Request, kv: KVState) -> Started | None:
        """Start ``request`` on ``slot`` from KV cells another engine read (llmkit's own: disaggregated prefill; llama-server
        has none). The cells replace the slot's (its prompt goes to the prompt cache first); the tokens that engine
        generated are this job's first ones (``Started.handed``). None: this context cannot take the cells, and the
        request reads its prompt here, as any other."""
        self.cache_prompt(slot)
        request.kv = None  # taken (or refused): a later launch, after a preemption, goes on from this engine's cache
        if not slot.load_cells(self.memory, list(kv.tokens), kv.cells):
            log.warning("request %d: the KV cells handed over do not fit this context; it reads its prompt", request.id)
            return None
        job = self.start_job(request, len(kv.tokens), 0)  # may raise: the request fails alone
        slot.job = job
        request.start(slot.id, job.n_cached)
        return Started(slot, job, kv.output)

    def share_prefix(self, slot: Slot, tokens: list[int]) -> None:
        """(kv_share, llmkit's own; llama-server shares cells only between one request's n > 1 children, copy_state_to.)
        If another slot, busy or idle, holds more of ``tokens`` than ``slot`` does, ``slot`` takes those cells
        (``Slot.share_from``: seq_cp on the unified KV cache) instead of reading them; its own prompt goes to the
        prompt cache first, as when a slot is reused."""
        if (found := prefix_donor(self.holders, slot, tokens)) is None:
            return
        self.cache_prompt(slot)  # (an empty slot's: nothing to keep, PromptCache.save declines)
        donor, n = found
        slot.share_from(self.memory, donor, n)
        if donor.is_idle:  # a prefix used is kept longer (least recently used goes first)
            donor.t_last_used = time.perf_counter()
        self.counters.record_share(n)

    def keep_resident(self, slot: Slot, tokens: list[int]) -> None:
        """(kv_share) Before ``slot`` drops tokens no other sequence holds (another prompt starts on it), a resident
        sequence takes their cells (``seq_cp``: no copy), for a later request: SGLang's radix cache keeps every
        computed prefix until it needs the room (``sharing.to_keep``, ``sharing.resident_for``)."""
        if self.resident and to_keep(self.holders, slot, tokens, MIN_SHARED):
            resident = resident_for(self.resident, slot.cache_tokens)
            resident.share_from(self.memory, slot, slot.n_past)
            resident.t_last_used = time.perf_counter()

    def swap_prompt(self, slot: Slot, tokens: list[int], request: Request, *, resuming: bool = False) -> None:
        """Before ``slot`` loses its prompt, copy it to RAM; bring back the cached prompt that serves ``tokens``
        best (llama-server: the prompt-cache update at the end of get_available_slot). A preempted job (``resuming``)
        always looks: its own KV cache went there when it left its slot."""
        if self.prompt_cache is not None and (resuming or swaps_prompt(slot, tokens, request.params)):
            slot.save_prompt(self.prompt_cache, self.memory)
            slot.load_prompt(self.prompt_cache, self.memory, tokens)
            self.prompt_cache.update()

    def cache_prompt(self, slot: Slot) -> None:
        """Copy ``slot``'s prompt to the prompt cache, if there is one and it takes it (server_slot::prompt_save)."""
        if self.prompt_cache is not None and slot.save_prompt(self.prompt_cache, self.memory):
            self.prompt_cache.update()

    def save_idle_slots(self) -> None:
        """Copy every idle slot's prompt to RAM; on a unified KV cache, also free its cells for the
        busy slots (llama-server: --cache-idle-slots, in process_single_task). A copy that fails
        is logged and skipped: it concerns no request."""
        if not self.config.cache_idle_slots or self.prompt_cache is None:
            return
        for slot in self.slots:
            if slot.is_idle:
                try:
                    self.cache_prompt(slot)
                except Exception:  # the cache is an optimisation: losing one copy loses no request (logged with its traceback)
                    log.exception("saving slot %d to the prompt cache failed", slot.id)
                if self.config.kv_unified and not self.config.kv_share:  # shared, its cells stay until the cache needs room
                    slot.clear_prompt(self.memory)

    def clear_idle_slot(self) -> bool:
        """Free the cells of one idle slot that holds some (llama-server: try_clear_idle_slots), when a decode finds the
        KV cache full. Only a unified KV cache gains from it: separate streams do not share cells. With ``kv_share``,
        the resident prefixes are purged too, least recently used first among those that free a cell of their own."""
        idle = [slot for slot in self.holders if slot.is_idle and slot.cache_tokens] if self.config.kv_unified else []
        if not idle:
            return False
        slot = idle[0] if not self.config.kv_share else min(idle, key=lambda s: (not frees_cells(self.holders, s), s.t_last_used))
        log.warning("purging %s %d with %d tokens", "slot" if slot in self.slots else "resident prefix", slot.id, slot.n_past)
        slot.clear_prompt(self.memory)
        return True

    # --- a step's plan (update_slots) --------------------------------------------

    def prepare_slots(self, n_bos: int) -> None:
        """Before the batch: cancelled requests leave their slots; a full slot shifts its context, keeping its first
        ``n_keep`` tokens after the ``n_bos`` the model adds (the start of llama-server's pre_decode)."""
        for slot, job in self.busy():
            if job.request.cancelled:
                self.end(job.request, job.outcome(End.CANCELLED, slot.id, tokens_cached=slot.n_past), slot)
            elif self.config.context_shift and job.is_generating and slot.n_past >= slot.n_ctx:
                params = job.request.params
                slot.shift_context(self.memory, (len(job.request.prompt) if params.n_keep < 0 else params.n_keep) + n_bos)
                job.truncated = True

    def plan(self, capacity: int, drafts: Mapping[int, list[int]]) -> list[Chunk]:
        """The next step's batch, from every busy slot (``build_batch``), prompts in the policy's order."""
        return build_batch(self.busy(), capacity, self.config.step_tokens, drafts, self.prompt_order)

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        """The policy's order of the prompts in a step, checked as admissions are: the same jobs, each once; else arrival."""
        try:
            ordered = self.policy.prompt_order(reading)
            if sorted(slot.id for slot, _ in ordered) == sorted(slot.id for slot, _ in reading):
                return ordered
            self._policy_fault("ordered other prompts than those being read", "", "reading them in arrival order")
        except Exception as exc:  # noqa: BLE001 -- as in checked_admission
            self._policy_fault("raised while ordering prompts", repr(exc), "reading them in arrival order")
        return LlamaServerPolicy().prompt_order(reading)

    @staticmethod
    def commit(plan: list[Chunk]) -> None:
        """The plan was decoded: its tokens are in the KV cache now, so in each slot's ``cache_tokens`` too (a static
        method: a plan carries its slots and jobs, so tests and exercises commit theirs with it)."""
        for chunk in plan:
            chunk.slot.append(chunk.tokens)
            if chunk.is_prompt:
                chunk.job.read(len(chunk.tokens))

    # --- the end of a request -------------------------------------------------------

    def end(self, request: Request, result: Outcome | BaseException, slot: Slot | None = None, *, keep_cache: bool = True) -> None:
        """Every request ends here, with its outcome or the error it failed with: from ``slot``, which is free then (its
        cells kept for the next request unless ``keep_cache`` is False), or from the queue (a preempted one's job ends
        too). The counters and the policy hear it."""
        job = slot.job if slot is not None else self.suspended.pop(request.id, None)
        if job is not None:
            job.sampler.close()
            self.counters.record_finish(result.timings if isinstance(result, Outcome) else job.timings(), ok=isinstance(result, Outcome))
        if slot is not None:
            slot.release(self.memory, keep_cache=keep_cache)
        if isinstance(result, Outcome):
            request.finish(result)
        else:
            log.warning("request %d failed: %s", request.id, result)
            self.counters.record_failure()
            request.fail(result)
        self.hear("finished", request, result)

    def drop(self, request: Request, error: BaseException | None = None) -> None:
        """A request leaves the queue without a slot: cancelled (``error`` None) or failed."""
        job = self.suspended.get(request.id)
        if error is not None:
            return self.end(request, error)
        cancelled = (
            job.outcome(End.CANCELLED, None, tokens_cached=0) if job else Outcome(End.CANCELLED, (), len(request.prompt), 0, Timings())
        )
        self.end(request, cancelled)
