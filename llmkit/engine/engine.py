"""The slot engine: one thread, one ``llama_decode`` per step, many requests at once.

    engine = Engine()                                  # default model, EngineConfig(): 4 slots
    a = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
    b = engine.complete("The capital of France is", max_tokens=8, temperature=0)
    for piece in a: print(piece.text, end="")          # or: async for piece in a
    b.result(), b.timings, engine.status()

    engine = Engine(start=False)                       # no thread: step it by hand and look between steps
    r = engine.complete("Once upon a time", max_tokens=4)
    while not r.done: print(engine.step())             # a StepRecord: what the batch held

Read it in the order llama-server runs (``llmkit.course.upstream.MAP`` pairs each
method with its C++ and says what differs):

- ``loop`` ~ ``server_queue::start_loop``: wait for work, ``step``, again;
  ``step`` is one turn: ``admit``, then ``update_slots``, then (with ``kv_events`` on, llmkit's
  own) it tells what the slots and the prompt cache now hold, and publishes its ``status``
  if a reader asked for it;
- ``admit`` ~ ``process_single_task``: waiting requests into slots, as the scheduling
  policy says (``scheduler.admission``; llama-server's policy by default:
  ``choose_slot`` ~ ``get_available_slot``), ``preempt``ing a running job if the
  policy gives a busy slot; ``launch`` ~ ``launch_slot_with_task``: ``swap_prompt``
  (~ the prompt-cache update of get_available_slot), the slot keeps what it can of the
  prompt (``Slot.reuse``), the request's run starts: a ``Job``;
- ``update_slots`` ~ ``update_slots``: ``propose_drafts`` if the engine speculates
  (``llmkit.engine.speculative``), plan ONE batch from every job
  (``scheduler.build_batch`` ~ the batch building of ``pre_decode``), ``decode``
  it, ``commit`` it to the slots, then for each job that asked for logits
  ``sample`` (~ ``post_decode``; with a draft, its verification: the tokens the
  model did not confirm leave the KV cache) and ``process_token`` (~ ``process_token``),
  which ``deliver``s text or ``finish``es the request (``fail`` when it
  cannot go on); then it ``wake``s the readers of what it delivered.

Requests join and leave between steps: that is continuous batching.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from os import PathLike
from typing import Any

from llmkit import models
from llmkit.engine.config import EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.kv_events import KVEventTracker
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import ContextSizeError, End, EngineError, KVState, Outcome, Request, RequestParams, TokenLogprob
from llmkit.engine.scheduler import (
    Admission,
    Chunk,
    LlamaServerPolicy,
    Running,
    admission,
    build_batch,
    prefix_donor,
    swaps_prompt,
    waits_for_cells,
)
from llmkit.engine.slot import Slot
from llmkit.engine.speculative import SpecType, make_drafter
from llmkit.engine.status import Counters, EngineStatus, Share, SlotStatus, StepRecord, Waiting
from llmkit.llama import Batch, Context, DecodeError, KVCacheFullError, Model
from llmkit.timings import Timings

log = logging.getLogger("llmkit.engine")
STATUS_TAIL = 80  # tokens of each slot's end that a status carries (a picture of the slot shows them as text)
MIN_SHARED = 32  # kv_share: tokens of a prefix being read that are worth waiting for rather than reading them too


class Engine:
    """Continuous batching over the slots of one llama_context, as ``config`` sets them (``EngineConfig``).

    ``start=False``: no thread; the caller runs the loop's turns with ``step()`` and can
    look at everything between two of them (``start()`` hands the loop to a thread later).
    (Greedy answers alone and batched: where two tokens are nearly tied, the batch's shape
    can tip the choice, with either KV layout; the concurrency chapter counts it: see the README.)
    """

    def __init__(self, model: Model | str | PathLike[str] | None = None, config: EngineConfig | None = None, *, start: bool = True):
        config = (config or EngineConfig()).resolved()
        self._owns_model = not isinstance(model, Model)
        self.model = model if isinstance(model, Model) else Model(models.resolve_model(model))
        try:
            self.ctx = Context(
                self.model, n_ctx=config.n_ctx, n_batch=config.n_batch, n_seq_max=config.n_parallel,
                n_threads=config.n_threads, kv_unified=bool(config.kv_unified),
            )  # fmt: skip
        except BaseException:
            self._close_model()
            raise
        # llama-server turns both off when cells cannot move
        self.config = replace(
            config, cache_reuse=config.cache_reuse * self.ctx.can_shift, context_shift=config.context_shift and self.ctx.can_shift
        )
        if config.speculative.type is not SpecType.NONE and not self.ctx.can_shift:
            log.warning("speculative decoding is off: this model's memory cannot drop a rejected draft")
            self.config = replace(self.config, speculative=replace(config.speculative, type=SpecType.NONE))
        self.drafter = make_drafter(self.config.speculative)  # None: no speculation (--spec-type none)
        self.policy = self.config.policy  # who goes first, which slot, who makes room (llama-server's rules by default)
        self.prompt_cache = PromptCache(config.cache_ram_mib, self.ctx.n_ctx) if config.cache_ram_mib != 0 else None
        self.slots = [Slot(i, self.ctx.n_ctx_seq) for i in range(config.n_parallel)]
        self.batch = Batch(self.ctx.n_batch)
        # what the slots and the prompt cache hold, told at each step's end (None: off); readers subscribe to its batches
        self.kv_events = KVEventTracker(config.kv_block_size) if config.kv_events else None
        self.waiting: deque[Request] = deque()  # in arrival order (the policy orders them)
        self.suspended: dict[int, Job] = {}  # preempted jobs, by request id: their requests wait again
        self.counters = Counters()
        self._faults: set[str] = set()  # the kinds of fault the policy showed, each logged once
        self.steps: deque[StepRecord] = deque(maxlen=10_000)  # the last steps, for plots
        self.n_steps = 0  # turns of the loop so far
        self._lock = threading.Lock()  # guards waiting, _closing and the published status
        self._work = threading.Condition(self._lock)  # the loop waits on it for work
        self._published = threading.Condition(self._lock)  # status readers wait on it for the next snapshot
        self._closing = self._status_asked = False
        self._status = self._snapshot()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @property
    def n_ctx_slot(self) -> int:
        return self.ctx.n_ctx_seq

    def start(self) -> None:
        """Hand the loop to the engine's own thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.loop, name="llmkit-engine", daemon=True)
            self._thread.start()

    # --- submitting ----------------------------------------------------------

    def submit(self, prompt: list[int], params: RequestParams | None = None, kv: KVState | None = None) -> Request:
        """Queue a tokenized prompt; returns at once with a ``Request`` to iterate. With ``kv``, KV cells another engine
        read for it (disaggregated prefill: ``launch_from``): its tokens must be the prompt, then its output but the last."""
        params = params or RequestParams()
        if not prompt:
            raise ValueError("the prompt is empty")
        if kv is not None and (not kv.output or list(kv.tokens) != [*prompt, *kv.output[:-1]]):
            raise ValueError("the KV state handed over is not this prompt's, or has no token to go on from")
        if len(prompt) >= self.n_ctx_slot:
            raise ContextSizeError(len(prompt), self.n_ctx_slot)
        if params.id_slot is not None and not 0 <= params.id_slot < len(self.slots):
            raise ValueError(f"id_slot must be between 0 and {len(self.slots) - 1}")
        if params.n_cache_reuse is None or not self.ctx.can_shift:
            params = replace(params, n_cache_reuse=self.config.cache_reuse)
        request = Request(prompt, params, kv)
        request.on_cancel = self._wake
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self.waiting.append(request)
            self._work.notify()
        return request

    def complete(self, text: str, **options: Any) -> Request:
        """Plain-text completion. ``options``: ``RequestParams.of``'s (max_tokens, temperature, cache_prompt, ...)."""
        return self.submit(self.model.tokenize(text), RequestParams.of(**options))

    def chat(self, messages: list[dict], **options: Any) -> Request:
        """Chat completion: ``messages`` rendered with the model's own chat template; ``options`` as ``complete``."""
        return self.submit(self.model.tokenize_chat(messages), RequestParams.of(**options))

    # --- what it tells -----------------------------------------------------------

    def status(self) -> EngineStatus:
        """The engine at the end of a turn of its loop: slots, queue, counters and prompt cache, as values.

        While the engine's thread runs, the reader asks, and the thread publishes a snapshot at the end of its
        current turn (at once if it has nothing to do): one step's state, never a step half done. So it waits up to
        a step: never call it on an event loop (the server waits in a worker thread, ``ServerState.status``, as
        llama-server's HTTP threads wait for its METRICS task). With no thread (stepped by hand, or closed) it is
        taken now.
        """
        thread = self._thread
        with self._lock:
            if thread is None or thread is threading.current_thread() or not thread.is_alive():
                return self._snapshot()
            seen, self._status_asked = self._status, True
            self._work.notify()
            self._published.wait_for(lambda: self._status is not seen or self._closing)
            return self._status

    def _snapshot(self) -> EngineStatus:
        """Taken where no step runs: on the engine's thread between two steps, or with no thread (under the lock)."""
        cache = self.prompt_cache.to_dict() if self.prompt_cache is not None else None
        slots = tuple(SlotStatus.of(slot, n_tail=STATUS_TAIL) for slot in self.slots)
        waiting = tuple(Waiting(r.id, len(r.prompt), r.params.priority) for r in self.waiting)
        return EngineStatus(self.config, slots, waiting, self.counters.copy(), cache, self.n_steps, time.perf_counter())

    def _publish(self) -> None:
        """(Engine thread, under the lock.) A reader asked for the status since the last one: take it now."""
        if self._status_asked:
            self._status, self._status_asked = self._snapshot(), False
            self._published.notify_all()

    # --- the loop ----------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            self._work.notify()

    def _has_work(self) -> bool:
        return self._closing or any(not s.is_idle for s in self.slots) or bool(self.waiting)

    def loop(self) -> None:
        """Wait for work (answering status readers meanwhile), step, again, until closed (server_queue::start_loop)."""
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._has_work() or self._status_asked)
                self._publish()
                if self._closing:
                    return
                if not self._has_work():
                    continue
            self.step()

    def step(self) -> StepRecord | None:
        """One turn of the loop: waiting requests into slots, then one batch (None: nothing to decode).

        An exception here is a bug: it is logged, the requests running fail, and the loop goes on.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("the engine's thread runs its loop: to step by hand, create it with Engine(..., start=False)")
        try:
            self.admit()
            record = self.update_slots()
        except Exception:
            log.exception("engine step failed")
            self._fail_busy(EngineError("internal engine error (see the server log)"))
            record = None
        if self.kv_events is not None:
            self.kv_events.collect(self.slots, self.prompt_cache)
        with self._lock:
            self.n_steps += 1
            self._publish()
        return record

    def admit(self) -> None:
        """Move waiting requests into slots, as the policy orders them (process_single_task). A job started in this
        turn is not preempted in it: a policy that would (a ping-pong) waits for the next step."""
        started: set[int] = set()
        while (found := self._next_admission()) is not None:
            if found.preempt and found.slot.id in started:
                self._requeue(found.request)
                return
            started.add(found.slot.id)
            if found.preempt:
                try:
                    self.preempt(found.slot)
                except Exception:  # the job stays on its slot; the request waits again, and tries at the next step
                    log.exception("preempting slot %d failed; request %d waits", found.slot.id, found.request.id)
                    self._requeue(found.request)
                    return
            try:  # outside the lock: building a grammar sampler can take a while
                self.launch(found.slot, found.request)
            except Exception as exc:  # noqa: BLE001 -- a bad sampler (a grammar) or a failed prompt-cache copy fails this request alone
                found.slot.release(self.ctx)
                self._drop(found.request, error=exc)
            self.save_idle_slots()

    def _next_admission(self) -> Admission | None:
        """The next request to start and its slot. The policy decides on a snapshot of the queue, outside the lock that
        ``submit`` takes on the server's event loop, so a slow policy delays no request's arrival."""
        with self._lock:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                self._drop(request)
            waiting = list(self.waiting)
        if self.config.kv_share:  # a request whose prefix a slot is reading waits for its cells
            waiting = [r for r in waiting if not waits_for_cells(self.slots, self.tokens_of(r), MIN_SHARED)]
        found = self._checked_admission(waiting)
        if found is not None:
            with self._lock:
                self.waiting.remove(found.request)
        return found

    def _checked_admission(self, waiting: list[Request]) -> Admission | None:
        """The policy's choice, checked: if it raises, or names a request that is not waiting, an idle slot to preempt or
        a busy one to fill, the engine says so in its log (once per kind of fault) and admits by llama-server's rule."""
        try:
            found = admission(waiting, self.slots, self.policy, self.tokens_of)
            if found is None or self._usable(found, waiting):
                return found
            self._policy_fault("chose an unusable slot or request", str(found), "admitting by llama-server's rule")
        except Exception as exc:  # noqa: BLE001 -- a plug-in's bug costs its own decision, never a request
            self._policy_fault("raised while admitting", repr(exc), "admitting by llama-server's rule")
        return admission(waiting, self.slots, LlamaServerPolicy(), self.tokens_of)

    def _prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        """The policy's order of the prompts in a step, checked as admissions are: the same jobs, each once; else arrival."""
        try:
            ordered = self.policy.prompt_order(reading)
            if sorted(slot.id for slot, _ in ordered) == sorted(slot.id for slot, _ in reading):
                return ordered
            self._policy_fault("ordered other prompts than those being read", "", "reading them in arrival order")
        except Exception as exc:  # noqa: BLE001 -- as in _checked_admission
            self._policy_fault("raised while ordering prompts", repr(exc), "reading them in arrival order")
        return LlamaServerPolicy().prompt_order(reading)

    def _policy_fault(self, kind: str, detail: str, instead: str) -> None:
        """Say once per kind of fault what the policy did, and what the engine does instead."""
        if kind not in self._faults:
            self._faults.add(kind)
            log.warning("scheduling policy %s %s (%s); %s", self.policy.name, kind, detail, instead)

    def _usable(self, found: Admission, waiting: list[Request]) -> bool:
        """A request that is waiting, and a slot of this engine: idle to fill, busy to preempt."""
        return any(r is found.request for r in waiting) and any(s is found.slot for s in self.slots) and found.slot.is_idle != found.preempt

    def _requeue(self, request: Request) -> None:
        """``request`` back in the queue at its place of arrival."""
        with self._lock:
            later = next((i for i, r in enumerate(self.waiting) if r.id > request.id), len(self.waiting))
            self.waiting.insert(later, request)

    def tokens_of(self, request: Request) -> list[int]:
        """What ``request`` needs in its slot's KV cache: its prompt (after a preemption, its prompt and what it generated)."""
        job = self.suspended.get(request.id)
        return request.prompt if job is None else [*request.prompt, *job.output]

    def launch(self, slot: Slot, request: Request) -> None:
        """Start ``request`` on ``slot``, or go on with its preempted job (llama-server: launch_slot_with_task): the slot
        keeps what it holds of the request's tokens (a prefix, chunks moved into place), its job reads the rest."""
        if request.kv is not None and request.id not in self.suspended:
            return self.launch_from(slot, request, request.kv)
        tokens, params = self.tokens_of(request), request.params
        if self.config.kv_share and params.cache_prompt:
            self.share_prefix(slot, tokens)
        self.swap_prompt(slot, tokens, request, resuming=request.id in self.suspended)
        n_keep, n_moved = slot.reuse(self.ctx, tokens, params.cache_prompt, params.n_cache_reuse)
        job = self.suspended.pop(request.id, None)
        if job is None:
            job = Job.start(request, self.model, n_keep, n_moved)  # may raise: the request fails alone
        else:
            job.resume(n_keep)
        slot.job = job
        request.start(slot.id, job.n_cached)  # a streamed answer can send its status line now

    def share_prefix(self, slot: Slot, tokens: list[int]) -> None:
        """(kv_share, llmkit's own; llama-server shares cells only between one request's n > 1 children, copy_state_to.)
        If another slot, busy or idle, holds more of ``tokens`` than ``slot`` does, ``slot`` takes those cells
        (``Slot.share_from``: seq_cp on the unified KV cache) instead of reading them; its own prompt goes to the
        prompt cache first, as when a slot is reused."""
        if (found := prefix_donor(self.slots, slot, tokens)) is None:
            return
        if self.prompt_cache is not None and slot.cache_tokens and slot.save_prompt(self.prompt_cache, self.ctx):
            self.prompt_cache.update()
        donor, n = found
        slot.share_from(self.ctx, donor, n)
        self.counters.record_share(n)

    def launch_from(self, slot: Slot, request: Request, kv: KVState) -> None:
        """Start ``request`` on ``slot`` from KV cells another engine read (llmkit's own: disaggregated prefill; llama-server
        has none). The cells replace the slot's (its prompt goes to the prompt cache first), the tokens that engine
        generated are this job's first ones, and it goes on from them as a preempted job does (``Job.resume``). Cells
        this context cannot take: the request reads its prompt here, as any other."""
        if self.prompt_cache is not None and slot.save_prompt(self.prompt_cache, self.ctx):
            self.prompt_cache.update()
        request.kv = None  # taken (or refused): a later launch, after a preemption, goes on from this engine's cache
        if not slot.load_cells(self.ctx, list(kv.tokens), kv.cells):
            log.warning("request %d: the KV cells handed over do not fit this context; it reads its prompt", request.id)
            return self.launch(slot, request)
        job = Job.start(request, self.model, len(kv.tokens), 0)  # may raise: the request fails alone
        slot.job = job
        request.start(slot.id, job.n_cached)
        for token in kv.output:
            self.process_token(slot, job, token, None)
            if request.done:
                return
        job.resume(len(kv.tokens))
        request.wake()

    def swap_prompt(self, slot: Slot, tokens: list[int], request: Request, *, resuming: bool = False) -> None:
        """Before ``slot`` loses its prompt, copy it to RAM; bring back the cached prompt that serves ``tokens``
        best (llama-server: the prompt-cache update at the end of get_available_slot). A preempted job (``resuming``)
        always looks: its own KV cache went there when it left its slot."""
        if self.prompt_cache is not None and (resuming or swaps_prompt(slot, tokens, request.params)):
            slot.save_prompt(self.prompt_cache, self.ctx)
            slot.load_prompt(self.prompt_cache, self.ctx, tokens)
            self.prompt_cache.update()

    def preempt(self, slot: Slot) -> None:
        """Take the job off ``slot`` for a request that goes first (llmkit's; llama-server never preempts): its KV cache
        goes to the prompt cache (when the cache takes it; else the job reads it again when it goes on), the job waits
        in ``suspended``, its request in the queue at its place of arrival, its stream paused."""
        job = slot.job
        assert job is not None, "only a busy slot is preempted"
        if self.prompt_cache is not None and slot.save_prompt(self.prompt_cache, self.ctx):
            self.prompt_cache.update()
        slot.release(self.ctx)
        job.request.suspend()
        self.suspended[job.request.id] = job
        self.counters.record_preemption()
        self._requeue(job.request)

    def save_idle_slots(self) -> None:
        """Copy every idle slot's prompt to RAM; on a unified KV cache, also free its cells for the
        busy slots (llama-server: --cache-idle-slots, in process_single_task). A copy that fails
        is logged and skipped: it concerns no request."""
        if not self.config.cache_idle_slots or self.prompt_cache is None:
            return
        for slot in self.slots:
            if slot.is_idle:
                try:
                    if slot.save_prompt(self.prompt_cache, self.ctx):
                        self.prompt_cache.update()
                except Exception:  # the cache is an optimisation: losing one copy loses no request (logged with its traceback)
                    log.exception("saving slot %d to the prompt cache failed", slot.id)
                if self.config.kv_unified and not self.config.kv_share:  # shared, its cells stay until the cache needs room
                    slot.clear_prompt(self.ctx)

    def update_slots(self) -> StepRecord | None:
        """One batch: plan it from every job, decode it, commit it, sample each job that asked (update_slots)."""
        t0 = time.perf_counter()
        self.prepare_slots()
        busy = [(slot, slot.job) for slot in self.slots if slot.job is not None]
        plan = build_batch(busy, self.batch.capacity, self.config.step_tokens, self.propose_drafts(busy), self._prompt_order)
        if not plan:
            return None
        self.fill_batch(plan)
        t_decode = time.perf_counter()
        if not self.decode(plan):
            return None
        decode_seconds = time.perf_counter() - t_decode
        self.commit(plan)
        sampling = [chunk for chunk in plan if chunk.i_logits >= 0]
        accepted = {chunk.slot.id: self.sample(chunk) for chunk in sampling}
        for chunk in sampling:  # after every sampler: consumers' event loops run during the next decode
            chunk.job.request.wake()
        return self.record(plan, accepted, t0, decode_seconds)

    def prepare_slots(self) -> None:
        """Before the batch: cancelled requests leave their slots; a full slot shifts its context
        (the start of llama-server's pre_decode)."""
        for slot in self.slots:
            if (job := slot.job) is None:
                continue
            if job.request.cancelled:
                self.finish(slot, job, End.CANCELLED)
            elif self.config.context_shift and job.is_generating and slot.n_past >= slot.n_ctx:
                params = job.request.params
                n_keep = len(job.request.prompt) if params.n_keep < 0 else params.n_keep
                slot.shift_context(self.ctx, n_keep + self.model.add_bos)
                job.truncated = True

    def propose_drafts(self, busy: list[Running]) -> dict[int, list[int]]:
        """Each stream guesses the tokens after the one it sampled, by slot id; ``build_batch`` puts the guess behind it
        (llama-server: the drafting in update_slots, ``common_speculative_draft``). A draft stays within
        the slot's context, the request's ``max_tokens``, its share of the batch and its draft window (``--spec-slow-start``)."""
        if self.drafter is None:
            return {}
        streams = [(slot, job) for slot, job in busy if job.is_generating]
        share = self.batch.capacity // max(len(streams), 1) - 1
        drafts = {}
        for slot, job in streams:
            params = job.request.params
            wanted = self.config.speculative.n_max if params.n_draft_max is None else params.n_draft_max
            n_max = min(wanted, job.draft_window, share, slot.n_ctx - slot.n_past - 2)
            if params.max_tokens > 0:
                n_max = min(n_max, params.max_tokens - len(job.output) - 1)
            if n_max > 0:
                drafts[slot.id] = self.drafter.draft(slot.id, slot.cache_tokens, job.last_token, n_max)
        return drafts

    def decode(self, plan: list[Chunk]) -> bool:
        """``llama_decode`` the plan; when the KV cache is full, clear idle slots one by one and retry
        (llama-server: try_clear_idle_slots). If it still fails, the plan's requests fail, and their
        slots keep exactly what earlier steps committed."""
        while True:
            try:
                self.ctx.decode(self.batch)
                return True
            except KVCacheFullError as exc:
                if self.clear_idle_slot():
                    continue
                error: DecodeError = exc
            except DecodeError as exc:
                error = exc
            for chunk in plan:
                self.ctx.seq_rm(chunk.slot.id, chunk.pos, -1)  # cells a failed decode may have written
                self.fail(chunk.slot, chunk.job, EngineError(str(error)))
            return False

    def fill_batch(self, plan: list[Chunk]) -> None:
        """Write the plan into llama.cpp's batch: logits only where the step samples."""
        self.batch.clear()
        for chunk in plan:
            first_logits = len(chunk.tokens) - len(chunk.logit_rows)  # the last token's, or with a draft every one's
            for k, token in enumerate(chunk.tokens):
                self.batch.add(token, chunk.pos + k, chunk.slot.id, logits=k >= first_logits)

    def commit(self, plan: list[Chunk]) -> None:
        """The decode succeeded: its tokens are in the KV cache now, so in each slot's ``cache_tokens`` too. A job whose
        prompt is now all in starts speculating from it (llama-server: common_speculative_begin)."""
        for chunk in plan:
            chunk.slot.append(chunk.tokens)
            if chunk.is_prompt:
                chunk.job.read(len(chunk.tokens))
                if chunk.job.is_generating and self.drafter is not None:
                    self.drafter.begin(chunk.slot.id, chunk.slot.cache_tokens)
                    chunk.job.draft_window = self.config.speculative.first_window

    def record(self, plan: list[Chunk], accepted: dict[int, int], t0: float, decode_seconds: float) -> StepRecord:
        batch = tuple(Share(c.slot.id, len(c.tokens), c.is_prompt, c.i_logits >= 0, len(c.draft), accepted.get(c.slot.id, 0)) for c in plan)
        n_prompt = sum(share.n_tokens for share in batch if share.is_prompt)
        n_generated = sum(share.n_tokens for share in batch if not share.is_prompt)
        step = StepRecord(t0, time.perf_counter() - t0, decode_seconds, n_prompt, n_generated, len(plan), batch)
        self.counters.record_step(step, max((c.slot.n_past for c in plan), default=0))
        self.steps.append(step)
        return step

    def clear_idle_slot(self) -> bool:
        """Free the cells of one idle slot that holds some (llama-server: try_clear_idle_slots).
        Only a unified KV cache gains from it: separate streams do not share cells."""
        idle = [slot for slot in self.slots if slot.is_idle and slot.cache_tokens] if self.config.kv_unified else []
        if not idle:
            return False
        slot = min(idle, key=lambda s: s.t_last_used) if self.config.kv_share else idle[0]  # shared: least recently used
        log.warning("purging slot %d with %d tokens", slot.id, slot.n_past)
        slot.clear_prompt(self.ctx)
        return True

    def sample(self, chunk: Chunk) -> int:
        """A token for the job from its logits in this batch, with its logprobs if asked, handed to
        ``process_token`` (llama-server: post_decode's common_sampler_sample).

        With a draft, sample at each of its rows in turn while the token sampled equals the draft's
        (llama-server: common_sampler_sample_and_accept_n): every draft token confirmed is a token
        gained, the first one that differs is the step's own. Returns how many draft tokens were accepted.
        """
        slot, job, draft = chunk.slot, chunk.job, chunk.draft
        n_probs = job.request.params.n_probs
        sampled: list[tuple[int, TokenLogprob | None]] = []
        try:
            for k, row in enumerate(chunk.logit_rows):
                token = job.sampler.sample(self.ctx, row)
                sampled.append((token, TokenLogprob(token, *self.ctx.logprobs(row, token, n_probs)) if n_probs else None))
                if k == len(draft) or token != draft[k] or self.model.is_eog(token):
                    break
        except Exception as exc:  # noqa: BLE001 -- a sampler that fails ends its own request, not the engine
            self.fail(slot, job, EngineError(f"sampling failed: {exc}"))
            return 0
        n_accepted = len(sampled) - 1
        if draft:
            self.accept_draft(slot, job, chunk, n_accepted)
        for token, logprobs in sampled:
            self.process_token(slot, job, token, logprobs)
            if job.request.done:
                break
        return n_accepted

    def accept_draft(self, slot: Slot, job: Job, chunk: Chunk, n_accepted: int) -> None:
        """Keep the draft's first ``n_accepted`` tokens in the KV cache: the rest leave it (llama-server: the
        speculative accept in post_decode, ``keep_first`` and ``seq_rm``)."""
        slot.truncate(self.ctx, chunk.pos + 1 + n_accepted)
        job.accept_draft(len(chunk.draft), n_accepted)
        self.counters.record_draft(len(chunk.draft), n_accepted)
        job.draft_window = self.config.speculative.next_window(n_accepted)
        if self.drafter is not None:
            self.drafter.accept(slot.id, len(chunk.draft), n_accepted)

    def process_token(self, slot: Slot, job: Job, token: int, logprobs: TokenLogprob | None) -> None:
        """Check a sampled token, then deliver it or finish the request (llama-server: process_token)."""
        if job.request.params.max_tokens == 0:  # the prompt only, nothing generated (server-schema.cpp's n_predict: 0)
            self.finish(slot, job, End.LIMIT)
        elif self.model.is_eog(token):
            self.finish(slot, job, End.EOS)
        else:
            self.deliver(job, job.push(token, logprobs))
            self.check_end(slot, job)

    def check_end(self, slot: Slot, job: Job) -> None:
        """After a token: a stop string, max_tokens or a full slot end the request."""
        if job.stops.stopped:
            self.finish(slot, job, End.WORD)
        elif len(job.output) == job.request.params.max_tokens or (slot.n_past >= slot.n_ctx and not self.config.context_shift):
            job.truncated |= slot.n_past >= slot.n_ctx
            self.finish(slot, job, End.LIMIT)

    def deliver(self, job: Job, text: str) -> None:
        """Send text with the tokens (and logprobs) it came from; held-back tokens wait for their text."""
        if text:
            job.request.emit(job.take(text))

    def finish(self, slot: Slot, job: Job, end: End) -> None:
        """End the job's request: flush held-back text, write its outcome (once), free the slot."""
        if end is not End.CANCELLED and not job.stops.stopped:
            self.deliver(job, job.flush())
        outcome = job.outcome(end, slot.id, tokens_cached=slot.n_past)
        if job.request.params.hand_off and end is not End.CANCELLED:  # disaggregated prefill: the cells go to a decode worker
            outcome = replace(outcome, kv=KVState(tuple(slot.cache_tokens), outcome.output, self.ctx.seq_state(slot.id)))
        self._leave(slot, job, outcome.timings, ok=True)
        job.request.finish(outcome)

    def fail(self, slot: Slot, job: Job, error: BaseException, *, keep_cache: bool = True) -> None:
        """The job cannot go on: its request ends with ``error``, the slot is free."""
        self._leave(slot, job, job.timings(), ok=False, keep_cache=keep_cache)
        self._fail(job.request, error)

    def _leave(self, slot: Slot, job: Job, timings: Timings, *, ok: bool, keep_cache: bool = True) -> None:
        self.counters.record_finish(timings, ok=ok)
        job.sampler.close()
        slot.release(self.ctx, keep_cache=keep_cache)

    def _fail(self, request: Request, error: BaseException) -> None:
        log.warning("request %d failed: %s", request.id, error)
        self.counters.record_failure()
        request.fail(error)

    def _drop(self, request: Request, error: BaseException | None = None) -> None:
        """A request leaves the queue without a slot: cancelled (``error`` None) or failed. A preempted one's job ends too."""
        job = self.suspended.pop(request.id, None)
        if job is not None:
            job.sampler.close()
        if error is not None:
            self._fail(request, error)
        elif job is not None:
            outcome = job.outcome(End.CANCELLED, None, tokens_cached=0)
            self.counters.record_finish(outcome.timings, ok=True)
            request.finish(outcome)
        else:
            request.finish(Outcome(End.CANCELLED, (), len(request.prompt), 0, Timings()))

    def _fail_busy(self, error: BaseException) -> None:
        for slot in self.slots:
            if slot.job is not None:
                self.fail(slot, slot.job, error, keep_cache=False)

    # --- shutdown --------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop, end every request still in flight, free llama.cpp's memory."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._work.notify()
            self._published.notify_all()
        if self._thread is not None:
            self._thread.join()
        stopped = EngineError("the engine was stopped")
        self._fail_busy(stopped)
        while self.waiting:
            self._drop(self.waiting.popleft(), error=stopped)
        self.batch.close()
        self.ctx.close()
        self._close_model()

    def _close_model(self) -> None:
        if self._owns_model:
            self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
