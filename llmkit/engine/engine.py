"""The slot engine: one thread, one ``llama_decode`` per step, many requests at once.

    engine = Engine()                                  # default model, EngineConfig(): 4 slots
    a = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
    b = engine.complete("The capital of France is", max_tokens=8, temperature=0)
    for piece in a: print(piece.text, end="")          # or: async for piece in a
    b.result(), b.timings, engine.status()

    engine = Engine(start=False)                       # no thread: step it by hand and look between steps
    r = engine.complete("Once upon a time", max_tokens=4)
    while not r.done: print(engine.step())             # a StepRecord: what the batch held

The ``Scheduler`` (``llmkit.engine.scheduler``) keeps the queue, the slots and the prompt cache and decides who runs
where and what a step reads; the engine runs the model (nano-vllm's split). In llama-server's order
(``llmkit.course.upstream.MAP`` pairs each method with its C++ and says what differs):

- ``step``, one turn of ``server_queue::start_loop`` (``loop`` waits for work between two): ``admit``, then
  ``update_slots``; then the KV events (with ``kv_events`` on, llmkit's own), and the ``status`` if a reader asked;
- ``admit`` ~ ``process_single_task``: new requests join the scheduler's queue; ``Scheduler.admit`` moves waiting ones
  into slots as the scheduling policy says (``get_available_slot`` by default; ``launch`` ~ ``launch_slot_with_task``);
- ``update_slots`` ~ ``update_slots``: ``propose_drafts`` if the engine speculates; the scheduler plans ONE batch from
  every job (``build_batch`` ~ ``pre_decode``); ``decode``; ``commit``; then for each job that asked for logits
  ``sample`` (~ ``post_decode``, a draft's verification included) and ``process_token``, which ``deliver``s text or
  ends the request (``finish``, or ``fail``: ``Scheduler.end`` frees the slot); then it ``wake``s the readers.

Requests join and leave between steps: that is continuous batching.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from functools import partial
from os import PathLike
from typing import Any

from llmkit import models
from llmkit.engine.config import EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.kv_events import KVEventTracker
from llmkit.engine.policy import Running
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import ContextSizeError, End, EngineError, KVState, Request, RequestParams, TokenLogprob
from llmkit.engine.scheduler import Chunk, Scheduler, Started
from llmkit.engine.slot import Slot
from llmkit.engine.speculative import Checked, SpecType, longest_draft, make_drafter
from llmkit.engine.status import EngineStatus
from llmkit.engine.steps import Counters, Share, StepRecord
from llmkit.llama import Batch, Context, DecodeError, KVCacheFullError, Model

log = logging.getLogger("llmkit.engine")


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
                self.model, n_ctx=config.n_ctx, n_batch=config.n_batch, n_seq_max=config.n_seq_max,
                n_threads=config.n_threads, kv_unified=bool(config.kv_unified),
            )  # fmt: skip
        except BaseException:
            self._close_model()
            raise
        # llama-server turns both off when cells cannot move
        self.config = replace(
            config, cache_reuse=config.cache_reuse * self.ctx.can_shift, context_shift=config.context_shift and self.ctx.can_shift
        )
        if config.speculates and not self.ctx.can_shift:
            log.warning("speculative decoding is off: this model's memory cannot drop a rejected draft")
            self.config = replace(self.config, speculative=replace(config.speculative, type=SpecType.NONE), drafter=None)
        own = self.config.drafter  # yours, checked; else --spec-type's (None: no speculation)
        self.drafter = Checked(own, self.model.n_vocab) if own is not None else make_drafter(self.config.speculative)
        self.counters = Counters()
        start_job = partial(Job.start, self.model, sampler=config.sampler, stop_matcher=config.stop_matcher)
        self.scheduler = Scheduler(self.config, self.ctx, start_job, self.counters)
        self.batch = Batch(self.ctx.n_batch)
        # what the slots and the prompt cache hold, told at each step's end (None: off); readers subscribe to its batches
        self.kv_events = KVEventTracker(config.kv_block_size, shares=config.kv_share) if config.kv_events else None
        self.arrivals: deque[Request] = deque()  # submitted since the last step (the scheduler's queue takes them)
        self.steps: deque[StepRecord] = deque(maxlen=10_000)  # the last steps, for plots
        self.n_steps = 0  # turns of the loop so far
        self._lock = threading.Lock()  # guards arrivals, _closing and the published status
        self._work = threading.Condition(self._lock)  # the loop waits on it for work
        self._published = threading.Condition(self._lock)  # status readers wait on it for the next snapshot
        self._closing = self._status_asked = False
        self._status = self._snapshot()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # What the scheduler holds, as the engine's (a notebook looks at ``engine.slots`` between two steps)

    @property
    def slots(self) -> list[Slot]:
        return self.scheduler.slots

    @property
    def prompt_cache(self) -> PromptCache | None:
        return self.scheduler.prompt_cache

    @property
    def n_ctx_slot(self) -> int:
        return self.ctx.n_ctx_seq

    # --- submitting ----------------------------------------------------------

    def submit(self, prompt: list[int], params: RequestParams | None = None, kv: KVState | None = None) -> Request:
        """Queue a tokenized prompt; returns at once with a ``Request`` to iterate. With ``kv``, KV cells another engine
        read for it (disaggregated prefill: ``Scheduler.launch_from``): its tokens must be the prompt, then its output
        but the last."""
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
            self.arrivals.append(request)
            self._work.notify()
        return request

    def complete(self, text: str, **options: Any) -> Request:
        """Plain-text completion. ``options``: ``RequestParams.of``'s (max_tokens, temperature, cache_prompt, ...)."""
        return self.submit(self.model.tokenize(text), RequestParams.of(**options))

    def chat(self, messages: list[dict], **options: Any) -> Request:
        """Chat completion: ``messages`` rendered with the model's own chat template; ``options`` as ``complete``."""
        return self.submit(self.model.tokenize_chat(messages), RequestParams.of(**options))

    # --- the step ----------------------------------------------------------------

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
            self.kv_events.collect(self.scheduler.holders, self.prompt_cache)
        with self._lock:
            self.n_steps += 1
            self._publish()
        return record

    def admit(self) -> None:
        """The requests submitted since the last step join the queue, and the scheduler moves waiting ones into slots
        (process_single_task: ``Scheduler.admit``). A job handed over with its first tokens delivers them now."""
        with self._lock:
            arrivals, self.arrivals = self.arrivals, deque()
        for request in arrivals:
            self.scheduler.add(request)
        for started in self.scheduler.admit():
            if started.handed:
                self.go_on_from(started)

    def go_on_from(self, started: Started) -> None:
        """A job whose prompt another engine read (disaggregated prefill): the tokens it generated there are this job's
        first ones, delivered as if sampled here; then it goes on as a preempted job does (``Job.resume``)."""
        slot, job = started.slot, started.job
        n_cells = slot.n_past
        for token in started.handed:
            self.process_token(slot, job, token, None)
            if job.request.done:
                return
        job.resume(n_cells)
        job.request.wake()

    def update_slots(self) -> StepRecord | None:
        """One batch: plan it from every job, decode it, commit it, sample each job that asked (update_slots)."""
        t0 = time.perf_counter()
        self.scheduler.prepare_slots(self.model.add_bos)
        plan = self.scheduler.plan(self.batch.capacity, self.propose_drafts(self.scheduler.busy()))
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
        record = self.record(plan, accepted, t0, decode_seconds)
        self.scheduler.hear("observe", record)
        return record

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
            wanted = longest_draft(self.drafter, self.config.speculative) if params.n_draft_max is None else params.n_draft_max
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
                if self.scheduler.clear_idle_slot():
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
        """The decode succeeded: the scheduler commits its tokens to the slots (``Scheduler.commit``). A job whose prompt
        is now all in starts speculating from it (llama-server: common_speculative_begin)."""
        self.scheduler.commit(plan)
        for chunk in plan:
            if chunk.is_prompt and chunk.job.is_generating and self.drafter is not None:
                self.drafter.begin(chunk.slot.id, chunk.slot.cache_tokens)
                chunk.job.draft_window = self.config.speculative.next_window(0, longest_draft(self.drafter, self.config.speculative))

    def record(self, plan: list[Chunk], accepted: dict[int, int], t0: float, decode_seconds: float) -> StepRecord:
        batch = tuple(Share(c.slot.id, len(c.tokens), c.is_prompt, c.i_logits >= 0, len(c.draft), accepted.get(c.slot.id, 0)) for c in plan)
        n_prompt = sum(share.n_tokens for share in batch if share.is_prompt)
        n_generated = sum(share.n_tokens for share in batch if not share.is_prompt)
        step = StepRecord(t0, time.perf_counter() - t0, decode_seconds, n_prompt, n_generated, len(plan), batch)
        self.counters.record_step(step, max((c.slot.n_past for c in plan), default=0))
        self.steps.append(step)
        return step

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
                token = job.sample(self.ctx, row, self.model.n_vocab)
                sampled.append((token, TokenLogprob(token, *self.ctx.logprobs(row, token, n_probs)) if n_probs else None))
                if k == len(draft) or token != draft[k] or self.model.is_eog(token):
                    break
            n_accepted = len(sampled) - 1
            if draft:
                self.accept_draft(slot, job, chunk, n_accepted)
            for token, logprobs in sampled:
                self.process_token(slot, job, token, logprobs)
                if job.request.done:
                    break
        except Exception as exc:  # noqa: BLE001 -- a sampler or stop matcher that fails (yours, say) ends its own request only
            if not job.request.done:
                self.fail(slot, job, EngineError(f"sampling failed: {exc}"))
            return 0
        return n_accepted

    def accept_draft(self, slot: Slot, job: Job, chunk: Chunk, n_accepted: int) -> None:
        """Keep the draft's first ``n_accepted`` tokens in the KV cache: the rest leave it (llama-server: the
        speculative accept in post_decode, ``keep_first`` and ``seq_rm``)."""
        slot.truncate(self.ctx, chunk.pos + 1 + n_accepted)
        job.accept_draft(len(chunk.draft), n_accepted)
        self.counters.record_draft(len(chunk.draft), n_accepted)
        job.draft_window = self.config.speculative.next_window(n_accepted, longest_draft(self.drafter, self.config.speculative))
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
        self.scheduler.end(job.request, outcome, slot)

    def fail(self, slot: Slot, job: Job, error: BaseException, *, keep_cache: bool = True) -> None:
        """The job cannot go on: its request ends with ``error``, the slot is free."""
        self.scheduler.end(job.request, error, slot, keep_cache=keep_cache)

    def _fail_busy(self, error: BaseException) -> None:
        for slot, job in self.scheduler.busy():
            self.fail(slot, job, error, keep_cache=False)

    # --- the thread and what it tells ----------------------------------------------

    def start(self) -> None:
        """Hand the loop to the engine's own thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.loop, name="llmkit-engine", daemon=True)
            self._thread.start()

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

    def _wake(self) -> None:
        with self._lock:
            self._work.notify()

    def _has_work(self) -> bool:
        return self._closing or bool(self.arrivals) or bool(self.scheduler.waiting) or any(not s.is_idle for s in self.slots)

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
        waiting = [*self.scheduler.waiting, *self.arrivals]
        return EngineStatus.of(self.config, self.slots, waiting, self.counters, self.prompt_cache, self.n_steps, self.scheduler.resident)

    def _publish(self) -> None:
        """(Engine thread, under the lock.) A reader asked for the status since the last one: take it now."""
        if self._status_asked:
            self._status, self._status_asked = self._snapshot(), False
            self._published.notify_all()

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
        for request in [*self.scheduler.waiting, *self.arrivals]:
            self.scheduler.drop(request, error=stopped)
        self.scheduler.waiting.clear()
        self.arrivals.clear()
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
