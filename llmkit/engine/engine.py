"""The slot engine: one thread, one ``llama_decode`` per step, many requests at once.

    engine = Engine()                                  # default model, 4 slots
    a = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
    b = engine.complete("The capital of France is", max_tokens=8, temperature=0)
    for piece in a: print(piece.text, end="")          # or: async for piece in a
    b.result(), b.timings, engine.counters

Read it in the order llama-server runs (``llmkit.upstream.MAP`` pairs each
method with its C++ and says what differs):

- ``loop`` ~ ``server_queue::start_loop``: wait for work, admit, step, again;
- ``admit`` ~ ``process_single_task``: waiting requests into idle slots
  (``scheduler.choose_slot`` ~ ``get_available_slot``, ``swap_prompt`` ~ its
  prompt-cache update, ``Slot.start`` ~ ``launch_slot_with_task``);
- ``step`` ~ ``update_slots``: build ONE batch from every busy slot
  (``scheduler.build_batch`` ~ the batch building of ``pre_decode``), decode
  it, then for each slot that asked for logits ``sample`` (~ ``post_decode``)
  and ``process_token`` (~ ``process_token``), which ``deliver``s text or
  ``finish``es the request; then it ``wake``s the readers of what it delivered.

Requests join and leave between steps: that is continuous batching.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from os import PathLike

import numpy as np

from llmkit import models
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import (
    ContextSizeError,
    EngineError,
    Request,
    Status,
    Timings,
    TokenLogprob,
)
from llmkit.engine.scheduler import build_batch, choose_slot, swaps_prompt
from llmkit.engine.slot import Slot
from llmkit.llama import Batch, Context, DecodeError, KVCacheFullError, Model, SamplingParams

log = logging.getLogger("llmkit.engine")

# Tokens per step, by default (chosen by measurement on 2 CPU cores: see README, "Stall-free batching"):
# a step that reads a prompt chunk costs about as much as its tokens, so this bounds the pause that a burst
# of long prompts puts between two tokens of a running stream.
DEFAULT_STEP_TOKENS = 128
AUTO_PARALLEL = 4  # slots of n_parallel=-1 (auto), as llama-server's -np -1
SUBMIT_OPTIONS = ("cache_prompt", "id_slot", "n_probs", "n_keep", "n_cache_reuse")  # submit's, not the sampler's


@dataclass
class Counters:
    """Engine-wide totals since start (what ``/metrics`` exposes, llama-server's names)."""

    prompt_tokens_total: int = 0  # prompt tokens evaluated (cache hits not included)
    prompt_seconds_total: float = 0.0
    prompt_tokens_cached_total: int = 0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0  # summed over decodes: / n_decode_total = busy slots per decode
    n_tokens_decoded_total: int = 0  # batch sizes summed over decodes
    batch_prompt_tokens_total: int = 0  # of which prompt tokens ...
    batch_generated_tokens_total: int = 0  # ... and tokens sampled the step before (one per generating slot)
    decode_seconds_total: float = 0.0  # time inside llama_decode
    step_seconds_total: float = 0.0  # whole steps: decode + Python bookkeeping
    requests_finished_total: int = 0
    requests_failed_total: int = 0

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def record_finish(self, t: Timings, *, ok: bool) -> None:
        """A request left its slot: add its timings (llama-server: metrics_on_prediction)."""
        self.prompt_tokens_total += t.prompt_n
        self.prompt_seconds_total += t.prompt_ms / 1e3
        self.prompt_tokens_cached_total += t.cache_n
        self.tokens_predicted_total += t.predicted_n
        self.tokens_predicted_seconds_total += t.predicted_ms / 1e3
        self.requests_finished_total += ok

    def record_failure(self) -> None:
        self.requests_failed_total += 1

    def record_step(self, step: StepRecord) -> None:
        self.n_decode_total += 1
        self.n_busy_slots_total += step.n_slots
        self.n_tokens_decoded_total += step.n_prompt + step.n_generated
        self.batch_prompt_tokens_total += step.n_prompt
        self.batch_generated_tokens_total += step.n_generated
        self.decode_seconds_total += step.decode_seconds
        self.step_seconds_total += step.seconds


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when, how long, and what its batch held (``Engine.steps`` keeps the last ones)."""

    t: float  # time.perf_counter() at the start of the step
    seconds: float  # the whole step
    decode_seconds: float  # of which inside llama_decode
    n_prompt: int  # prompt tokens in the batch
    n_generated: int  # tokens of generating slots in the batch
    n_slots: int  # slots with a token in the batch


class Engine:
    """Continuous batching over ``n_parallel`` slots of one llama_context.

    ``n_ctx`` is the TOTAL context, as llama-server's ``-c``. As llama-server,
    ``n_parallel=-1`` (auto) means 4 slots on a unified KV cache: each slot may
    use all of ``n_ctx``, and idle slots are cleared when it runs out. An explicit
    ``n_parallel`` gives each slot ``n_ctx // n_parallel`` tokens in its own KV
    stream (``kv_unified=False``). (Greedy outputs alone and batched: the same in
    the concurrency chapter's measurement, but where two tokens are nearly tied
    the batch's shape can still tip the choice: see the README.)

    ``step_tokens`` is the token budget of one step (``scheduler.build_batch``):
    running streams first, then prompt chunks. 0 puts up to ``n_batch`` prompt
    tokens in a step, as llama-server does, and running streams wait for it.

    The KV cache, as llama-server (the caching chapter shows each):
    ``cache_ram_mib`` bounds the host-RAM prompt cache (``--cache-ram``; 0: off,
    -1: no limit in bytes); ``cache_idle_slots`` copies idle slots to it when a
    request starts; ``cache_reuse`` > 0 moves cached chunks of at least that many
    tokens into place (``--cache-reuse``); ``context_shift`` lets a generation go
    past a full slot by dropping tokens after ``n_keep`` (``--context-shift``).
    """

    def __init__(
        self,
        model: Model | str | PathLike[str] | None = None,
        *,
        n_parallel: int = -1,
        n_ctx: int = 8192,
        n_batch: int = 2048,
        n_threads: int | None = None,
        kv_unified: bool | None = None,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        cache_ram_mib: int = 8192,
        cache_idle_slots: bool = True,
        cache_reuse: int = 0,
        context_shift: bool = False,
    ):
        if n_parallel == 0 or n_parallel < -1:
            raise ValueError(f"n_parallel must be -1 (auto) or at least 1, not {n_parallel}")
        if kv_unified is None:
            kv_unified = n_parallel == -1  # llama-server: auto is 4 slots on a unified KV cache
        n_parallel = AUTO_PARALLEL if n_parallel == -1 else n_parallel
        if step_tokens and step_tokens < 2 * n_parallel:  # room for every running stream and a prompt chunk
            raise ValueError(f"step_tokens must be 0 (no budget) or at least 2 x n_parallel = {2 * n_parallel}, not {step_tokens}")
        self.step_tokens = step_tokens
        self._owns_model = not isinstance(model, Model)
        self.model = model if isinstance(model, Model) else Model(models.resolve_model(model))
        try:
            self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_parallel, n_threads=n_threads, kv_unified=kv_unified)
        except BaseException:
            self._close_model()
            raise
        self.kv_unified = kv_unified
        self.n_ctx_slot = self.ctx.n_ctx_seq
        self.prompt_cache = PromptCache(cache_ram_mib, self.ctx.n_ctx) if cache_ram_mib != 0 else None
        self.cache_idle_slots = cache_idle_slots and self.prompt_cache is not None
        self.cache_reuse = cache_reuse if self.ctx.can_shift else 0  # llama-server turns both off when cells cannot move
        self.context_shift = context_shift and self.ctx.can_shift
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_parallel)]
        self.batch = Batch(self.ctx.n_batch)
        self.waiting: deque[Request] = deque()
        self.counters = Counters()
        self.steps: deque[StepRecord] = deque(maxlen=10_000)  # the last steps, for plots
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self.loop, name="llmkit-engine", daemon=True)
        self._thread.start()

    # --- submitting ----------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        cache_prompt: bool = True,
        id_slot: int | None = None,
        n_probs: int = 0,
        n_keep: int = 0,
        n_cache_reuse: int | None = None,
    ) -> Request:
        """Queue a tokenized prompt; returns at once with a ``Request`` to iterate.

        ``n_keep``: prompt tokens a context shift keeps (-1: all of them); ``n_cache_reuse``:
        this request's ``cache_reuse`` (None: the engine's).
        """
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.n_ctx_slot:
            raise ContextSizeError(len(prompt), self.n_ctx_slot)
        if id_slot is not None and not 0 <= id_slot < len(self.slots):
            raise ValueError(f"id_slot must be between 0 and {len(self.slots) - 1}")
        n_cache_reuse = self.cache_reuse if n_cache_reuse is None or not self.ctx.can_shift else n_cache_reuse
        request = Request(
            prompt, params, cache_prompt=cache_prompt, id_slot=id_slot, n_probs=n_probs, n_keep=n_keep, n_cache_reuse=n_cache_reuse
        )
        request.on_cancel = self._wake
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is closed")
            self.waiting.append(request)
            self._cond.notify()
        return request

    def complete(self, text: str, **kwargs) -> Request:
        """Plain-text completion. ``kwargs``: ``submit``'s options and ``SamplingParams`` fields (max_tokens, ...)."""
        return self._submit_with(self.model.tokenize(text), kwargs)

    def chat(self, messages: list[dict], **kwargs) -> Request:
        """Chat completion: ``messages`` rendered with the model's own chat template; ``kwargs`` as ``complete``."""
        return self._submit_with(self.model.tokenize_chat(messages), kwargs)

    def _submit_with(self, prompt: list[int], kwargs: dict) -> Request:
        options = {k: kwargs.pop(k) for k in SUBMIT_OPTIONS if k in kwargs}
        return self.submit(prompt, SamplingParams(**kwargs), **options)

    # --- state for /slots and /metrics ---------------------------------------

    @property
    def n_busy(self) -> int:
        return sum(not s.is_idle for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return len(self.waiting)

    # --- the loop ----------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _has_work(self) -> bool:
        return self._closing or self.n_busy > 0 or bool(self.waiting)

    def loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._closing:
                    return
            self.admit()
            try:
                self.step()
            except Exception:  # a bug here must not kill the thread silently
                log.exception("engine step failed")
                self._fail_busy(EngineError("internal engine error (see the server log)"))

    def admit(self) -> None:
        """Move queued requests into idle slots, first come first served (process_single_task)."""
        while (admission := self._next_admission()) is not None:
            slot, request = admission
            try:  # outside the lock: building a grammar sampler can take a while
                self.swap_prompt(slot, request)
                slot.start(request, self.ctx, self.model)
            except Exception as exc:  # noqa: BLE001 -- a bad sampler (say, a grammar) fails this request alone
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
        busy slots (llama-server: --cache-idle-slots, in process_single_task)."""
        if not self.cache_idle_slots or self.prompt_cache is None:  # (no prompt cache: cache_idle_slots is off)
            return
        for slot in self.slots:
            if slot.is_idle:
                if slot.save_prompt(self.prompt_cache, self.ctx):
                    self.prompt_cache.update()
                if self.kv_unified:
                    slot.clear_prompt(self.ctx)

    def _next_admission(self) -> tuple[Slot, Request] | None:
        with self._cond:
            for request in list(self.waiting):
                if request.cancelled:
                    self.waiting.remove(request)
                    request.finish("cancelled")
                elif (slot := choose_slot(self.slots, request)) is not None:
                    self.waiting.remove(request)
                    return slot, request
        return None

    def step(self) -> None:
        """One iteration: prepare the slots, build one batch, decode it, sample each slot that asked."""
        t0 = time.perf_counter()
        self.prepare_slots()
        in_batch = build_batch(self.slots, self.batch, self.step_tokens)
        n_generated = sum(slot.is_generating for slot in in_batch)
        t_decode = time.perf_counter()
        if not in_batch or not self.decode(in_batch):
            return
        t_sample = time.perf_counter()
        sampling = [slot for slot in in_batch if slot.i_batch >= 0]
        for slot in sampling:
            if (sampled := self.sample(slot)) is not None:
                self.process_token(slot, *sampled)
        for slot in sampling:  # after every sampler: consumers' event loops run during the next decode
            if slot.request is not None:
                slot.request.wake()
        n_prompt = self.batch.n_tokens - n_generated
        self.record(StepRecord(t0, time.perf_counter() - t0, t_sample - t_decode, n_prompt, n_generated, len(in_batch)))

    def prepare_slots(self) -> None:
        """Before the batch: cancelled requests leave their slots; a full slot shifts its context
        (the start of llama-server's pre_decode)."""
        for slot in self.slots:
            if slot.request is not None and slot.request.cancelled:
                self.finish(slot, "cancelled")
            elif self.context_shift and slot.is_generating and slot.n_past >= slot.n_ctx:
                slot.shift_context(self.ctx, self.model.add_bos)

    def record(self, step: StepRecord) -> None:
        self.counters.record_step(step)
        self.steps.append(step)

    def decode(self, in_batch: list[Slot]) -> bool:
        """``llama_decode`` the batch; when the KV cache is full, clear idle slots one by one and retry
        (llama-server: try_clear_idle_slots). If it still fails, the batch's requests fail."""
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
            for slot in in_batch:
                self.finish(slot, None, EngineError(str(error)), keep_cache=False)
            return False

    def clear_idle_slot(self) -> bool:
        """Free the cells of one idle slot that holds some (llama-server: try_clear_idle_slots).
        Only a unified KV cache gains from it: separate streams do not share cells."""
        for slot in self.slots if self.kv_unified else ():
            if slot.is_idle and slot.cache_tokens:
                log.warning("purging slot %d with %d tokens", slot.id, slot.n_past)
                slot.clear_prompt(self.ctx)
                return True
        return False

    def sample(self, slot: Slot) -> tuple[int, TokenLogprob | None] | None:
        """A token for ``slot`` from its logits in this batch (llama-server: post_decode's
        common_sampler_sample), with its logprobs if asked; None if sampling failed the request."""
        try:
            token = slot.tools.sampler.sample(self.ctx, slot.i_batch)
            n_probs = slot.request.n_probs
            return token, self._logprobs(slot.i_batch, token, n_probs) if n_probs else None
        except Exception as exc:  # noqa: BLE001 -- a sampler that fails ends its own request, not the engine
            self.finish(slot, None, EngineError(f"sampling failed: {exc}"))
            return None

    def process_token(self, slot: Slot, token: int, logprobs: TokenLogprob | None) -> None:
        """Check a sampled token, then deliver it or finish the request (llama-server: process_token)."""
        request, params = slot.request, slot.request.params
        if request.status is Status.PROMPT:
            request.first_token()
        if params.max_tokens == 0:  # prompt only (llama-server's n_predict = 0)
            self.finish(slot, "length", stop_type="limit")
            return
        if self.model.is_eog(token):
            self.finish(slot, "stop", stop_type="eos")
            return
        request.output.append(token)
        slot.last_token = token
        self.deliver(slot, slot.tools.push(token, logprobs))
        if slot.tools.stops.stopped:
            request.stopping_word = slot.tools.stops.word
            self.finish(slot, "stop", stop_type="word")
        elif len(request.output) == params.max_tokens or (slot.n_past >= slot.n_ctx and not self.context_shift):
            request.truncated |= slot.n_past >= slot.n_ctx
            self.finish(slot, "length", stop_type="limit")

    def deliver(self, slot: Slot, text: str) -> None:
        """Send text with the tokens (and logprobs) it came from; held-back tokens wait for their text."""
        if text:
            slot.request.emit(slot.tools.take(text))

    def finish(
        self, slot: Slot, reason: str | None, error: BaseException | None = None, *, keep_cache: bool = True, stop_type: str = "none"
    ) -> None:
        """End the slot's request: flush held-back text, close its timings, free the slot."""
        request = slot.request
        request.stop_type, request.n_cached = stop_type, slot.n_past
        if error is None and reason != "cancelled" and not slot.tools.stops.stopped:
            self.deliver(slot, slot.tools.flush())
        request.end_timings()
        self.counters.record_finish(request.timings, ok=error is None)
        slot.release(self.ctx, keep_cache=keep_cache and error is None)
        if error is not None:
            self._fail(request, error)  # type: ignore[arg-type]  # a busy slot's request (see pyproject.toml's mypy override)
        else:
            request.finish(reason)

    def _fail(self, request: Request, error: BaseException) -> None:
        log.warning("request %d failed: %s", request.id, error)
        self.counters.record_failure()
        request.finish(None, error)

    def _fail_busy(self, error: BaseException) -> None:
        for slot in self.slots:
            if slot.request is not None:
                self.finish(slot, None, error, keep_cache=False)

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
