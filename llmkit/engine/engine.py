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
  ``step`` is one turn: ``admit``, then ``update_slots``;
- ``admit`` ~ ``process_single_task``: waiting requests into idle slots
  (``scheduler.choose_slot`` ~ ``get_available_slot``, ``swap_prompt`` ~ its
  prompt-cache update, ``Slot.start`` ~ ``launch_slot_with_task``: a ``Job``);
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
from dataclasses import replace
from os import PathLike

import numpy as np

from llmkit import models
from llmkit.engine.config import EngineConfig
from llmkit.engine.job import Job
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import ContextSizeError, End, EngineError, Request, RequestParams, Status, TokenLogprob
from llmkit.engine.scheduler import Chunk, build_batch, choose_slot, swaps_prompt
from llmkit.engine.slot import Slot
from llmkit.engine.speculative import make_drafter
from llmkit.engine.status import Counters, EngineStatus, Share, SlotStatus, StepRecord
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
        if config.speculative.type != "none" and not self.ctx.can_shift:
            log.warning("speculative decoding is off: this model's memory cannot drop a rejected draft")
            self.config = replace(self.config, speculative=replace(config.speculative, type="none"))
        self.drafter = make_drafter(self.config.speculative)  # None: no speculation (--spec-type none)
        self.prompt_cache = PromptCache(config.cache_ram_mib, self.ctx.n_ctx) if config.cache_ram_mib != 0 else None
        self.slots = [Slot(i, self.ctx.n_ctx_seq) for i in range(config.n_parallel)]
        self.batch = Batch(self.ctx.n_batch)
        self.waiting: deque[Request] = deque()
        self.counters = Counters()
        self.steps: deque[StepRecord] = deque(maxlen=10_000)  # the last steps, for plots
        self._cond = threading.Condition()
        self._closing = False
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

    def submit(self, prompt: list[int], params: RequestParams | None = None) -> Request:
        """Queue a tokenized prompt; returns at once with a ``Request`` to iterate."""
        params = params or RequestParams()
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.n_ctx_slot:
            raise ContextSizeError(len(prompt), self.n_ctx_slot)
        if params.id_slot is not None and not 0 <= params.id_slot < len(self.slots):
            raise ValueError(f"id_slot must be between 0 and {len(self.slots) - 1}")
        if params.n_cache_reuse is None or not self.ctx.can_shift:
            params = replace(params, n_cache_reuse=self.config.cache_reuse)
        request = Request(prompt, params)
        request.on_cancel = self._wake
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self.waiting.append(request)
            self._cond.notify()
        return request

    def complete(self, text: str, **options) -> Request:
        """Plain-text completion. ``options``: ``RequestParams.of``'s (max_tokens, temperature, cache_prompt, ...)."""
        return self.submit(self.model.tokenize(text), RequestParams.of(**options))

    def chat(self, messages: list[dict], **options) -> Request:
        """Chat completion: ``messages`` rendered with the model's own chat template; ``options`` as ``complete``."""
        return self.submit(self.model.tokenize_chat(messages), RequestParams.of(**options))

    # --- what it tells -----------------------------------------------------------

    def status(self) -> EngineStatus:
        """A frozen snapshot of the slots, the queue, the counters and the prompt cache.

        Between two steps it is exact. From another thread while the loop runs (the server's
        routes), each slot's job is read once: one that ends meanwhile shows in the next snapshot.
        """
        cache = self.prompt_cache.to_dict() if self.prompt_cache is not None else None
        slots = tuple(SlotStatus.of(slot) for slot in self.slots)
        return EngineStatus(self.config, slots, len(self.waiting), self.counters.copy(), cache)

    # --- the loop ----------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _has_work(self) -> bool:
        return self._closing or any(not s.is_idle for s in self.slots) or bool(self.waiting)

    def _wait_for_work(self) -> bool:
        with self._cond:
            self._cond.wait_for(self._has_work)
            return not self._closing

    def loop(self) -> None:
        while self._wait_for_work():
            self.step()

    def step(self) -> StepRecord | None:
        """One turn of the loop: waiting requests into idle slots, then one batch (None: nothing to decode).

        An exception here is a bug: it is logged, the requests running fail, and the loop goes on.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("the engine's thread runs its loop: to step by hand, create it with Engine(..., start=False)")
        try:
            self.admit()
            return self.update_slots()
        except Exception:
            log.exception("engine step failed")
            self._fail_busy(EngineError("internal engine error (see the server log)"))
            return None

    def admit(self) -> None:
        """Move queued requests into idle slots, first come first served (process_single_task)."""
        while (admission := self._next_admission()) is not None:
            slot, request = admission
            try:  # outside the lock: building a grammar sampler can take a while
                self.swap_prompt(slot, request)
                slot.start(request, self.ctx, self.model)
                request.wake()  # a streamed answer can send its status line now (llama-server: the begin result)
            except Exception as exc:  # noqa: BLE001 -- a bad sampler (a grammar) or a failed prompt-cache copy fails this request alone
                slot.release(self.ctx)
                self._fail(request, exc)
            self.save_idle_slots()

    def swap_prompt(self, slot: Slot, request: Request) -> None:
        """Before ``slot`` loses its prompt, copy it to RAM; bring back the cached prompt that serves
        ``request`` best (llama-server: the prompt-cache update at the end of get_available_slot)."""
        if self.prompt_cache is not None and swaps_prompt(slot, request):
            slot.save_prompt(self.prompt_cache, self.ctx)
            slot.load_prompt(self.prompt_cache, self.ctx, request.prompt)
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
                    if slot.save_prompt(self.prompt_cache, self.ctx):
                        self.prompt_cache.update()
                except Exception:  # the cache is an optimisation: losing one copy loses no request (logged with its traceback)
                    log.exception("saving slot %d to the prompt cache failed", slot.id)
                if self.config.kv_unified:
                    slot.clear_prompt(self.ctx)

    def _next_admission(self) -> tuple[Slot, Request] | None:
        with self._cond:
            for request in list(self.waiting):
                if request.cancelled:
                    self.waiting.remove(request)
                    request.finish(End.CANCELLED)
                elif (slot := choose_slot(self.slots, request)) is not None:
                    self.waiting.remove(request)
                    return slot, request
        return None

    def update_slots(self) -> StepRecord | None:
        """One batch: plan it from every job, decode it, commit it, sample each job that asked (update_slots)."""
        t0 = time.perf_counter()
        self.prepare_slots()
        self.propose_drafts()
        plan = build_batch(self.slots, self.batch.capacity, self.config.step_tokens)
        if not plan:
            return None
        self.fill_batch(plan)
        t_decode = time.perf_counter()
        if not self.decode(plan):
            return None
        decode_seconds = time.perf_counter() - t_decode
        self.commit(plan)
        sampling = [chunk for chunk in plan if chunk.i_logits >= 0]
        accepted = {chunk.job.slot.id: self.sample(chunk) for chunk in sampling}
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
                self.finish(job, End.CANCELLED)
            elif self.config.context_shift and job.is_generating and slot.n_past >= slot.n_ctx:
                slot.shift_context(self.ctx, self.model.add_bos)

    def propose_drafts(self) -> None:
        """Each stream guesses the tokens after the one it sampled; ``build_batch`` puts the guess behind it
        (llama-server: the drafting in update_slots, ``common_speculative_draft``). A draft stays within
        the slot's context, the request's ``max_tokens``, its share of the batch and its draft window (``--spec-slow-start``)."""
        if self.drafter is None:
            return
        streams = [slot.job for slot in self.slots if slot.job is not None and slot.job.is_generating]
        share = self.batch.capacity // max(len(streams), 1) - 1
        for job in streams:
            slot, params = job.slot, job.request.params
            wanted = self.config.speculative.n_max if params.n_draft_max is None else params.n_draft_max
            n_max = min(wanted, job.draft_window, share, slot.n_ctx - slot.n_past - 2)
            if params.max_tokens > 0:
                n_max = min(n_max, params.max_tokens - len(job.request.output) - 1)
            job.draft = self.drafter.draft(slot.id, slot.cache_tokens, job.last_token, n_max) if n_max > 0 else []

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
                self.ctx.seq_rm(chunk.job.slot.id, chunk.pos, -1)  # cells a failed decode may have written
                self.fail(chunk.job, EngineError(str(error)))
            return False

    def fill_batch(self, plan: list[Chunk]) -> None:
        """Write the plan into llama.cpp's batch: logits only where the step samples."""
        self.batch.clear()
        for chunk in plan:
            first_logits = len(chunk.tokens) - len(chunk.logit_rows)  # the last token's, or with a draft every one's
            for k, token in enumerate(chunk.tokens):
                self.batch.add(token, chunk.pos + k, chunk.job.slot.id, logits=k >= first_logits)

    def commit(self, plan: list[Chunk]) -> None:
        """The decode succeeded: its tokens are in the KV cache now, so in ``cache_tokens`` too."""
        for chunk in plan:
            chunk.job.slot.cache_tokens.extend(chunk.tokens)
            if chunk.is_prompt:
                chunk.job.n_prompt_done += len(chunk.tokens)

    def record(self, plan: list[Chunk], accepted: dict[int, int], t0: float, decode_seconds: float) -> StepRecord:
        batch = tuple(
            Share(c.job.slot.id, len(c.tokens), c.is_prompt, c.i_logits >= 0, len(c.draft), accepted.get(c.job.slot.id, 0)) for c in plan
        )
        n_prompt = sum(share.n_tokens for share in batch if share.is_prompt)
        n_generated = sum(share.n_tokens for share in batch if not share.is_prompt)
        step = StepRecord(t0, time.perf_counter() - t0, decode_seconds, n_prompt, n_generated, len(plan), batch)
        self.counters.record_step(step)
        self.steps.append(step)
        return step

    def clear_idle_slot(self) -> bool:
        """Free the cells of one idle slot that holds some (llama-server: try_clear_idle_slots).
        Only a unified KV cache gains from it: separate streams do not share cells."""
        for slot in self.slots if self.config.kv_unified else ():
            if slot.is_idle and slot.cache_tokens:
                log.warning("purging slot %d with %d tokens", slot.id, slot.n_past)
                slot.clear_prompt(self.ctx)
                return True
        return False

    def sample(self, chunk: Chunk) -> int:
        """A token for the job from its logits in this batch, with its logprobs if asked, handed to
        ``process_token`` (llama-server: post_decode's common_sampler_sample).

        With a draft, sample at each of its rows in turn while the token sampled equals the draft's
        (llama-server: common_sampler_sample_and_accept_n): every draft token confirmed is a token
        gained, the first one that differs is the step's own. Returns how many draft tokens were accepted.
        """
        job, draft = chunk.job, chunk.draft
        n_probs = job.request.params.n_probs
        sampled: list[tuple[int, TokenLogprob | None]] = []
        try:
            for k, row in enumerate(chunk.logit_rows):
                token = job.sampler.sample(self.ctx, row)
                sampled.append((token, self._logprobs(row, token, n_probs) if n_probs else None))
                if k == len(draft) or token != draft[k] or self.model.is_eog(token):
                    break
        except Exception as exc:  # noqa: BLE001 -- a sampler that fails ends its own request, not the engine
            self.fail(job, EngineError(f"sampling failed: {exc}"))
            return 0
        n_accepted = len(sampled) - 1
        if draft:
            self.accept_draft(job, chunk, n_accepted)
        for token, logprobs in sampled:
            self.process_token(job, token, logprobs)
            if job.request.done:
                break
        return n_accepted

    def accept_draft(self, job: Job, chunk: Chunk, n_accepted: int) -> None:
        """Keep the draft's first ``n_accepted`` tokens in the KV cache: the rest leave it (llama-server: the
        speculative accept in update_slots, ``keep_first`` and ``seq_rm``)."""
        job.slot.truncate(self.ctx, chunk.pos + 1 + n_accepted)
        job.draft = []
        timings = job.request.timings
        timings.draft_n += len(chunk.draft)
        timings.draft_n_accepted += n_accepted
        self.counters.record_draft(len(chunk.draft), n_accepted)
        job.draft_window = self.config.speculative.next_window(n_accepted)
        if self.drafter is not None:
            self.drafter.accept(job.slot.id, len(chunk.draft), n_accepted)

    def process_token(self, job: Job, token: int, logprobs: TokenLogprob | None) -> None:
        """Check a sampled token, then deliver it or finish the request (llama-server: process_token)."""
        request = job.request
        if request.status is Status.PROMPT:
            request.first_token()
            if self.drafter is not None:
                self.drafter.begin(job.slot.id, job.slot.cache_tokens)
                job.draft_window = self.config.speculative.first_window
        if request.params.max_tokens == 0:  # prompt only (llama-server's n_predict = 0)
            self.finish(job, End.LIMIT)
        elif self.model.is_eog(token):
            self.finish(job, End.EOS)
        else:
            self.deliver(job, job.push(token, logprobs))
            self.check_end(job)

    def check_end(self, job: Job) -> None:
        """After a token: a stop string, max_tokens or a full slot end the request."""
        request, slot = job.request, job.slot
        if job.stops.stopped:
            request.stopping_word = job.stops.word
            self.finish(job, End.WORD)
        elif len(request.output) == request.params.max_tokens or (slot.n_past >= slot.n_ctx and not self.config.context_shift):
            request.truncated |= slot.n_past >= slot.n_ctx
            self.finish(job, End.LIMIT)

    def deliver(self, job: Job, text: str) -> None:
        """Send text with the tokens (and logprobs) it came from; held-back tokens wait for their text."""
        if text:
            job.request.emit(job.take(text))

    def finish(self, job: Job, end: End) -> None:
        """End the job's request: flush held-back text, close its timings, free the slot."""
        if end is not End.CANCELLED and not job.stops.stopped:
            self.deliver(job, job.flush())
        self._leave(job, ok=True)
        job.request.finish(end)

    def fail(self, job: Job, error: BaseException, *, keep_cache: bool = True) -> None:
        """The job cannot go on: its request ends with ``error``, the slot is free."""
        self._leave(job, ok=False, keep_cache=keep_cache)
        self._fail(job.request, error)

    def _leave(self, job: Job, *, ok: bool, keep_cache: bool = True) -> None:
        job.request.n_cached = job.slot.n_past
        job.request.end_timings()
        self.counters.record_finish(job.request.timings, ok=ok)
        job.slot.release(self.ctx, keep_cache=keep_cache)

    def _fail(self, request: Request, error: BaseException) -> None:
        log.warning("request %d failed: %s", request.id, error)
        self.counters.record_failure()
        request.finish(None, error)

    def _fail_busy(self, error: BaseException) -> None:
        for slot in self.slots:
            if slot.job is not None:
                self.fail(slot.job, error, keep_cache=False)

    def _logprobs(self, i: int, token: int, n_probs: int) -> TokenLogprob:
        logits = np.ctypeslib.as_array(self.ctx.logits(i))
        shifted = logits - logits.max()
        logp = shifted - np.log(np.exp(shifted).sum())
        top = np.argpartition(-logp, n_probs)[:n_probs]
        top = top[np.argsort(-logp[top])]
        return TokenLogprob(token, float(logp[token]), [(int(t), float(logp[t])) for t in top])

    # --- shutdown --------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop, end every request still in flight, free llama.cpp's memory."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        stopped = EngineError("the engine was stopped")
        self._fail_busy(stopped)
        while self.waiting:
            self._fail(self.waiting.popleft(), stopped)
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
