"""One request: what it asks (``RequestParams``), how it ends (``End``), and its state from submission to its
last token (~ llama-server's ``task_params``, ``stop_type`` and ``server_task`` + its result reader).

The engine thread is the only writer: it fills in the status, timings and
pieces, and ``emit``s events. The consumer (a thread, an
asyncio task, an HTTP handler) only reads them, by iterating the request:

    for piece in request:          # or: async for piece in request
        print(piece.text, end="")
    request.finish_reason, request.timings

Leaving the loop early (``break``, an exception, a closed connection)
cancels the request; the engine frees its slot at the next step.

An asyncio consumer is woken once per engine step (``wake``), after every
slot of the step has sampled, not at each ``emit``: its event loop then runs
while ``llama_decode`` (which releases the GIL) computes the next step,
instead of taking the GIL from the engine between two slots' samplers.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from llmkit.llama import SamplingParams

_ids = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"  # in the queue: every slot is busy
    PROMPT = "prompt"  # in a slot, its prompt being evaluated
    GENERATING = "generating"
    DONE = "done"


class End(enum.Enum):
    """Why a request ended: its OpenAI ``finish_reason`` and llama-server's ``stop_type`` (``enum stop_type``)."""

    EOS = ("stop", "eos")  # the model wrote an end-of-generation token
    WORD = ("stop", "word")  # a stop string
    LIMIT = ("length", "limit")  # max_tokens, or a full context
    CANCELLED = ("cancelled", "none")  # the client left

    def __init__(self, finish_reason: str, stop_type: str):
        self.finish_reason = finish_reason
        self.stop_type = stop_type


@dataclass(frozen=True)
class RequestParams:
    """What a request asks of the engine, beside its prompt (~ llama-server's ``task_params``, sampling nested).

    ``RequestParams.of(max_tokens=8, temperature=0)`` takes both levels' fields flat, as a request body does.
    """

    max_tokens: int = -1  # -1: until end of generation or the context is full (llama-server: n_predict)
    stop: tuple[str, ...] = ()  # stop strings (antiprompt)
    cache_prompt: bool = True  # start from the slot's cached prefix
    id_slot: int | None = None  # this slot, or wait for it
    n_probs: int = 0  # > 0: report logprobs with this many alternatives
    n_keep: int = 0  # prompt tokens a context shift keeps (-1: the whole prompt)
    n_cache_reuse: int | None = None  # move cached chunks of at least this many tokens into place (None: the engine's)
    n_draft_max: int | None = None  # speculation: at most this many draft tokens a step (None: the engine's; 0: none)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @classmethod
    def of(cls, **options: Any) -> RequestParams:
        """From flat options: ``RequestParams`` fields, and ``SamplingParams`` fields (``temperature``, ...)."""
        own = {f.name for f in fields(cls)} - {"sampling"}
        mine = {k: v for k, v in options.items() if k in own}
        if "stop" in mine:
            mine["stop"] = tuple(mine["stop"])
        return cls(**mine, sampling=SamplingParams(**{k: v for k, v in options.items() if k not in own}))

    def to_dict(self) -> dict:
        """One flat dict, as llama-server's ``task_params::to_json`` (the grammar only as whether there is one)."""
        sampling = {f.name: getattr(self.sampling, f.name) for f in fields(self.sampling) if f.name != "grammar"}
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sampling"}
        return own | {"stop": list(self.stop)} | sampling | {"has_grammar": self.sampling.grammar is not None}


class EngineError(RuntimeError):
    """A request failed inside the engine (only that request)."""


class ContextSizeError(ValueError):
    """The prompt does not fit a slot's context (llama-server: exceed_context_size_error)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens)")
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


@dataclass
class Timings:
    """llama-server's per-request ``timings`` object."""

    cache_n: int = 0  # prompt tokens reused from the slot's KV cache (from the prefix and moved chunks)
    n_cache_reuse: int = 0  # llmkit's own: of those, tokens of chunks moved into place (--cache-reuse)
    prompt_n: int = 0  # prompt tokens evaluated
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0  # tokens drafted by speculation (llama-server reports these two only when it drafted)
    draft_n_accepted: int = 0  # of which the model sampled too: each one a token without a step of its own

    def to_dict(self) -> dict:
        def per(n: int, ms: float) -> tuple[float, float]:
            return (ms / n if n else 0.0, 1e3 * n / ms if ms > 0 else 0.0)

        prompt_per_token_ms, prompt_per_second = per(self.prompt_n, self.prompt_ms)
        # over decode steps, as llama-server: the first token comes from the prompt's last step, not a step of its own
        predicted_per_token_ms, predicted_per_second = per(max(self.predicted_n - 1, 0), self.predicted_ms)
        return {
            "cache_n": self.cache_n,
            "n_cache_reuse": self.n_cache_reuse,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
        } | ({"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {})


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), best first


@dataclass
class Piece:
    """A run of text ready to send: whole UTF-8 characters, no part of a stop string."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


_END: Any = object()  # the end marker: travels in the queue of pieces, is never yielded


class Request:
    def __init__(self, prompt: list[int], params: RequestParams | None = None):
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params or RequestParams()

        self.status = Status.WAITING
        self.slot_id: int | None = None  # the slot it got (llama-server: slot.id)
        self.output: list[int] = []
        self.text_parts: list[str] = []
        self.end: End | None = None  # how it ended (None: not yet, or failed: ``error``)
        self.stopping_word = ""  # the stop string that ended it
        self.truncated = False  # it filled its slot's context
        self.n_cached = 0  # tokens in its slot's KV cache when it ended (llama-server: tokens_cached)
        self.error: BaseException | None = None
        self.timings = Timings()
        self.t_submit = time.perf_counter()
        self.t_start = self.t_first = 0.0

        self._cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None  # set by the engine: wakes its loop
        self._events: deque[Piece] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # --- engine side -------------------------------------------------------
    # The request writes its own status and timings; the engine calls these at each phase.

    def start(self, slot_id: int, n_cached: int, n_moved: int) -> None:
        """It got a slot that holds its first ``n_cached`` tokens (``n_moved`` of them moved into place)."""
        self.slot_id, self.status, self.t_start = slot_id, Status.PROMPT, time.perf_counter()
        self.timings.cache_n, self.timings.n_cache_reuse = n_cached, n_moved
        self.timings.prompt_n = len(self.prompt) - n_cached

    def first_token(self) -> None:
        """Its first token was sampled: the prompt phase ends here."""
        self.status, self.t_first = Status.GENERATING, time.perf_counter()
        self.timings.prompt_ms = (self.t_first - self.t_start) * 1e3

    def end_timings(self) -> None:
        """It leaves its slot: the generation phase ends here."""
        now = time.perf_counter()
        self.timings.predicted_n = len(self.output)
        self.timings.predicted_ms = (now - self.t_first) * 1e3 if self.t_first else 0.0
        if not self.t_first:
            self.timings.prompt_ms = (now - self.t_start) * 1e3

    def emit(self, piece: Piece) -> None:
        """Queue a piece; an asyncio consumer sees it at the next ``wake``."""
        self.text_parts.append(piece.text)
        self._push(piece)

    def finish(self, end: End | None, error: BaseException | None = None) -> None:
        """It ended (``end``), or failed (``error``): the readers see the end after the pieces queued before it."""
        self.end, self.error = end, error
        self.status = Status.DONE
        self._push(_END)
        self.wake()

    def _push(self, item: Piece) -> None:
        with self._cond:
            self._events.append(item)
            self._cond.notify_all()  # a consumer thread reads at once

    def wake(self) -> None:
        """Wake an asyncio consumer to read what was queued (the engine: once per step, after sampling)."""
        with self._cond:
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:  # set together by __aiter__
            loop.call_soon_threadsafe(wake.set)

    # --- consumer side -----------------------------------------------------

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's: "stop", "length" or "cancelled" (None while it runs, or when it failed)."""
        return self.end.finish_reason if self.end is not None else None

    @property
    def stop_type(self) -> str:
        """llama-server's (its native /completion answer reports it): "eos", "word", "limit" or "none"."""
        return self.end.stop_type if self.end is not None else "none"

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self.status is Status.DONE

    def cancel(self) -> None:
        """Ask the engine to drop this request; harmless once it is done."""
        if not self.done:
            self._cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def _take(self) -> Piece:
        item = self._events.popleft()
        if item is _END:
            self._events.appendleft(_END)  # stay ended for any later reader
        return item

    def __iter__(self) -> Iterator[Piece]:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._events)
                    item = self._take()
                if item is _END:
                    break
                yield item
        finally:
            self.cancel()
        if self.error is not None:
            raise self.error

    def _listen(self) -> asyncio.Event:
        """This asyncio task is the reader now: ``wake`` sets the event returned, on its loop."""
        with self._cond:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            return self._wake

    async def started(self) -> None:
        """Wait until the request holds a slot (or ended before it got one: its error is raised here).

        A streamed answer sends its status line then, before the prompt is read (llama-server:
        the empty "begin" result of pre_decode). A reader that leaves while it waits cancels it.
        """
        wake = self._listen()
        try:
            while True:
                wake.clear()
                if self.status is not Status.WAITING:
                    break
                await wake.wait()
        except BaseException:
            self.cancel()
            raise
        if self.slot_id is None and self.error is not None:  # it never started
            raise self.error

    async def pieces(self, silence: float | None = None) -> AsyncGenerator[Piece | None, None]:
        """The pieces as they come; with ``silence`` (seconds), also None each time that long passes
        without one: a streamed answer sends a ping then (llama-server: --sse-ping-interval)."""
        wake = self._listen()
        try:
            while True:
                with self._cond:
                    item = self._take() if self._events else None
                    if item is None:
                        wake.clear()
                if item is _END:
                    break
                if item is not None:
                    yield item
                    continue
                try:
                    async with asyncio.timeout(silence):
                        await wake.wait()
                except TimeoutError:
                    yield None
        finally:
            self.cancel()
        if self.error is not None:
            raise self.error

    def __aiter__(self) -> AsyncGenerator[Piece, None]:
        return self.pieces()  # type: ignore[return-value]  # with no silence given, never None

    def result(self) -> str:
        """Block until done; the whole text (raises the engine's error, if any)."""
        for _ in self:
            pass
        return self.text
