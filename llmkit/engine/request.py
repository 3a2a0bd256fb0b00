"""One request: what it asks (``RequestParams``), how it ended (``Outcome``, ``End``), and the channel from the engine
thread to its reader (~ llama-server's ``task_params``, ``stop_type``, and ``server_task`` + its result reader).

The engine thread is the only writer: it starts the request on a slot, ``emit``s pieces of text, and ends it
once, with ``finish(outcome)`` or ``fail(error)``. The consumer (a thread, an asyncio task, an HTTP handler)
only reads, by iterating the request:

    for piece in request:          # or: async for piece in request
        print(piece.text, end="")
    request.outcome.end, request.outcome.timings

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
import mmap
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from llmkit.grammar.sampler import Grammar
from llmkit.sampling import LLAMA_DEFAULT_SEED, SamplingParams
from llmkit.timings import Timings

_ids = itertools.count(1)


class Status(enum.Enum):
    WAITING = "waiting"  # in the queue: every slot is busy (or it was preempted and waits to go on)
    RUNNING = "running"  # on a slot
    DONE = "done"


class End(enum.Enum):
    """Why a request ended (llama-server: ``enum stop_type``). Each API names it in its own words (its table)."""

    EOS = enum.auto()  # the model wrote an end-of-generation token
    WORD = enum.auto()  # a stop string
    LIMIT = enum.auto()  # max_tokens, or a full context
    CANCELLED = enum.auto()  # the client left


@dataclass(frozen=True)
class KVState:
    """A sequence's KV cells, as one engine hands them to another to go on from (disaggregated prefill and decode:
    llmkit's own, through vLLM's ``kv_transfer_params``; llama-server has none).

    ``cells`` hold ``tokens`` (``Context.seq_state``: llama_state_seq_get_data); ``output`` are the tokens that engine
    generated, the last one not yet in the cells: ``tokens`` is the prompt, then the output but its last token. An
    engine given it (``Engine.submit(..., kv=)``) starts the request from those cells and those tokens, as a preempted
    job goes on from the KV cache it left (``Job.resume``).
    """

    tokens: tuple[int, ...]
    output: tuple[int, ...]
    cells: mmap.mmap | bytearray


@dataclass(frozen=True)
class Outcome:
    """How a request ended: written once, by the engine, when its job leaves the slot (``Engine.finish``)."""

    end: End
    output: tuple[int, ...]  # every token generated, a stop string's included (llama-server's ``tokens``)
    n_prompt: int  # prompt tokens ...
    n_cached: int  # ... of which reused from the KV cache (``timings.cache_n``)
    timings: Timings
    stopping_word: str = ""  # the stop string that ended it (End.WORD)
    truncated: bool = False  # it filled its slot's context (and went on past it by a context shift, or ended)
    id_slot: int | None = None  # the slot it ended on (None: it never had one)
    tokens_cached: int = 0  # tokens in that slot's KV cache when it ended (llama-server: tokens_cached)
    t_start: float = 0.0  # time.perf_counter() when it got a slot (0: never) ...
    t_first: float = 0.0  # ... its first token (0: none) ...
    t_end: float = 0.0  # ... and when it left its slot: where the request sits on a timeline (Request.t_submit)
    kv: KVState | None = None  # with ``RequestParams.hand_off``: its slot's KV cells when it ended

    @property
    def n_output(self) -> int:
        return len(self.output)


# llama-server's task_params::to_json (server-task.cpp), the keys llmkit has, in its order
TO_JSON = ("seed", "temperature", "top_k", "top_p", "min_p", "repeat_last_n", "repeat_penalty", "presence_penalty",
           "frequency_penalty", "stop", "max_tokens", "n_predict", "n_keep", "ignore_eos", "stream", "n_probs", "grammar")  # fmt: skip


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
    stream: bool = False  # the client reads the answer as it comes (the engine streams every request alike: shown in /slots)
    priority: int = 0  # llmkit's (vLLM's field): lower goes first under the priority policy, and may preempt
    tenant: str = ""  # llmkit's: who the request is for (the fair-share policy shares the slots among tenants)
    hand_off: bool = False  # llmkit's (disaggregated prefill): its slot's KV cells go into its outcome (Outcome.kv)
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
        """Every field, flat and in JSON's types, as llama-server's ``task_params::to_json``: its names in its order
        (``TO_JSON``), then llmkit's own in the dataclasses' order. The one serializer of a request's settings:
        ``/props``' defaults, ``/slots``, the native answer's ``generation_settings``."""
        s = self.sampling
        flat = {f.name: getattr(s, f.name) for f in fields(s)} | {f.name: getattr(self, f.name) for f in fields(self)}
        flat |= {  # JSON's types, llama-server's values
            "seed": LLAMA_DEFAULT_SEED if s.seed is None else s.seed,
            "stop": list(self.stop),
            "n_predict": self.max_tokens,  # twice, as there
            "grammar": s.grammar.text if isinstance(s.grammar, Grammar) else s.grammar or "",
        }
        del flat["sampling"]
        return {name: flat.pop(name) for name in TO_JSON} | flat


class EngineError(RuntimeError):
    """A request failed inside the engine (only that request)."""


class ContextSizeError(ValueError):
    """The prompt does not fit a slot's context (llama-server: exceed_context_size_error)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens)")
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


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
    """One request's inputs, where it runs, how it ended, and the channel its pieces travel through."""

    def __init__(self, prompt: list[int], params: RequestParams | None = None, kv: KVState | None = None):
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params or RequestParams()
        self.kv = kv  # KV cells another engine read for it, to start from (None: it reads its prompt here)
        self.t_submit = time.perf_counter()

        self.status = Status.WAITING
        self.id_slot: int | None = None  # the slot it runs on (llama-server: slot.id; None while it waits)
        self.n_cached = 0  # prompt tokens its slot held when it started (llama-server: n_prompt_tokens_cache)
        self.outcome: Outcome | None = None  # how it ended (None: not yet, or it failed: ``error``)
        self.error: BaseException | None = None
        self.text_parts: list[str] = []  # what was emitted, for ``text``

        self._cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None  # set by the engine: wakes its loop
        self._events: deque[Piece] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # --- engine side: the engine thread calls these ------------------------------

    def start(self, id_slot: int, n_cached: int) -> None:
        """It got slot ``id_slot``, which holds its prompt's first ``n_cached`` tokens (or got a slot again, after a
        preemption): a streamed answer can send its status line."""
        self.id_slot, self.n_cached, self.status = id_slot, n_cached, Status.RUNNING
        self.wake()

    def suspend(self) -> None:
        """It lost its slot to a request that goes first (preemption): back in the queue, its stream paused."""
        self.id_slot, self.status = None, Status.WAITING

    def emit(self, piece: Piece) -> None:
        """Queue a piece; an asyncio consumer sees it at the next ``wake``."""
        self.text_parts.append(piece.text)
        self._push(piece)

    def finish(self, outcome: Outcome) -> None:
        """It ended: the readers see the end after the pieces queued before it."""
        self.outcome = outcome
        self._close()

    def fail(self, error: BaseException) -> None:
        """It cannot go on: the readers get ``error`` after the pieces queued before it."""
        self.error = error
        self._close()

    def _close(self) -> None:
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
        if loop is not None and wake is not None:  # set together by _listen
            loop.call_soon_threadsafe(wake.set)

    # --- consumer side -----------------------------------------------------

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

    def _leave(self) -> None:
        """The reader stops reading: the request is cancelled if it still runs; its error, if any, is raised."""
        self.cancel()
        if self.error is not None:
            raise self.error

    def __iter__(self) -> Iterator[Piece]:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._events)
                    item = self._take()
                if item is _END:
                    break
                yield item
        except BaseException:
            self.cancel()
            raise
        self._leave()

    def _listen(self) -> asyncio.Event:
        """This asyncio task is the reader now: ``wake`` sets the event returned, on its loop."""
        with self._cond:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            return self._wake

    async def started(self) -> None:
        """Wait until the request holds a slot (or ended before it got one: its error is raised here).

        A streamed answer sends its status line then, before the prompt is read (llmkit's rule; llama-server
        sends it when ``pre_decode`` first reaches the slot with room in the batch: its "begin" result).
        A reader that leaves while it waits cancels it.
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
        if self.id_slot is None and self.error is not None:  # it never started
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
        except BaseException:
            self.cancel()
            raise
        self._leave()

    def __aiter__(self) -> AsyncGenerator[Piece, None]:
        return self.pieces()  # type: ignore[return-value]  # with no silence given, never None

    def result(self) -> str:
        """Block until done; the whole text (raises the engine's error, if any)."""
        for _ in self:
            pass
        return self.text
