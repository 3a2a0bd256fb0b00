"""What every route of the slot server reads: the settings, the engine, the model's name.

``ServingEngine`` is the engine as the routes see it, a ``typing.Protocol``: its
model, ``submit``, a frozen ``status()`` snapshot and ``close``; nothing else of
the engine is reached from an HTTP thread. ``status()`` waits for the engine's step to end, so a route never
calls it on the event loop: ``ServerState.status()`` waits in a worker thread, one wait for every reader that
asks meanwhile (llama-server waits in its HTTP thread pool, never in the thread that serves streams). ``llmkit.engine.Engine`` is one, the
scripted engine of tests/test_server_app.py another. ``ServerState`` is created once per app (``app.state.server``); a
route asks for it with a ``state: State`` parameter (a FastAPI dependency).

The features (embeddings, handoff, kv_publisher, metrics) each own their object and its dependency; ``app.py``
builds, starts and stops them. This module imports none of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Protocol, runtime_checkable

import llama_cpp
from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

import llmkit
from llmkit.engine import EngineStatus, KVState, RequestParams
from llmkit.engine import Request as EngineRequest
from llmkit.engine.kv_events import KVEventTracker
from llmkit.llama import Model
from llmkit.server.errors import ApiError

log = logging.getLogger("llmkit.server")

SYSTEM_FINGERPRINT = f"llmkit-{llmkit.__version__}-llama-cpp-python-{llama_cpp.__version__}"


@dataclass
class Settings:
    """Server-wide settings (the CLI flags that are not the engine's)."""

    alias: str | None = None  # the model name clients see (default: the GGUF file name)
    api_key: str | None = None
    defaults: RequestParams = field(default_factory=RequestParams)  # what a body leaves out (-n, --temp, --seed)
    metrics: bool = False
    slots: bool = True
    max_body_size: int = 10 * 2**20
    n_threads: int | None = None  # for the embedding context
    sse_ping_interval: int = 30  # seconds of silence before a stream gets a ping (<= 0: never), as llama-server's
    kv_events: str | None = None  # llmkit's --kv-events: the ZMQ endpoint of the engine's KV events (llmkit.server.kv_publisher)
    pd_peers: frozenset[tuple[str, int]] = frozenset()  # llmkit's --pd-peers: the prefill workers a decode worker takes KV cells from


@runtime_checkable
class ServingEngine(Protocol):
    """What the routes ask of the engine: its model, ``submit``, a ``status()`` snapshot (``/slots``, ``/metrics``,
    ``/props``), ``close``; and its KV events, for ``--kv-events`` (None: an engine that makes none)."""

    @property
    def model(self) -> Model: ...

    @property
    def kv_events(self) -> KVEventTracker | None: ...

    def submit(self, prompt: list[int], params: RequestParams | None = None, kv: KVState | None = None) -> EngineRequest: ...

    def status(self) -> EngineStatus: ...

    def close(self) -> None: ...


@dataclass
class ServerState:
    """One app's settings and engine (once loaded), or why it failed to load."""

    settings: Settings
    loaded: ServingEngine | None = None
    load_error: Exception | None = None
    t_start: int = field(default_factory=lambda: int(time.time()))  # when the server started, Unix seconds
    n_ctx_slot: int = 0  # each slot's context, read once when the engine is ready (it never changes)
    last_status: EngineStatus | None = None  # the engine's last snapshot a route waited for (what /metrics renders)
    _asking: asyncio.Future[EngineStatus] | None = field(default=None, init=False, repr=False)

    async def status(self) -> EngineStatus:
        """The engine's status at the end of its current step, waited for off the event loop.

        Readers that ask while a wait is under way share it (a burst of scrapes holds one worker thread, not one
        each), and a reader that goes away does not cancel the others' wait."""
        if self._asking is None:
            self._asking = asyncio.ensure_future(run_in_threadpool(self.engine.status))
            self._asking.add_done_callback(self._asked)
        self.last_status = await asyncio.shield(self._asking)
        return self.last_status

    def _asked(self, _: asyncio.Future[EngineStatus]) -> None:
        self._asking = None

    @property
    def engine(self) -> ServingEngine:
        """The engine; never None in a route: the gate answers 503 until it is loaded."""
        assert self.loaded is not None, "a route ran before the model was loaded"
        return self.loaded

    @property
    def model_name(self) -> str:
        return self.settings.alias or self.engine.model.path.name

    def ready(self, engine: ServingEngine) -> None:
        """Serve ``engine`` from now on (the gate lets requests in)."""
        self.loaded = engine
        status = self.last_status = engine.status()
        self.n_ctx_slot = status.n_ctx_slot
        log.info("model %s ready: %d slots of %d tokens", self.model_name, len(status.slots), status.n_ctx_slot)

    def load(self, loader: Callable[[], object]) -> None:
        """Call ``loader`` (in a worker thread, at start-up; it makes the engine ready); a failure is kept, and answered
        as a 500 from then on."""
        try:
            loader()
        except Exception as exc:
            log.exception("the model failed to load")
            self.load_error = exc

    def not_ready(self) -> ApiError | None:
        """The answer to every request while the model is not there (``middleware.Gate``), else None."""
        if self.load_error is not None:
            return ApiError(500, f"The model failed to load: {self.load_error}")
        return None if self.loaded is not None else ApiError(503, "Loading model")

    def close(self) -> None:
        if self.loaded is not None:
            self.loaded.close()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
