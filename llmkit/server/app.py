"""The slot server's app: its state, features, middlewares, error handlers and routes, wired together
(~ llama-server's route table in server.cpp and init_routes in server-context.cpp). The composition root: it builds
each feature's object (the embedder, the kept hand-offs, the KV publisher, the metrics registry), starts them once the
engine is ready and stops them on shutdown; each feature's routes read their own through its dependency.

The routes live by role (llama-server's paths: without ``/v1``, ``/completions`` and
``/embeddings`` are its own dialect, not OpenAI's):

    dialects     POST /v1/chat/completions, /v1/completions, /completion, /v1/responses, /v1/messages ...
    embeddings   POST /v1/embeddings, /embedding, /embeddings
    info         GET /health, /v1/models, /props, /slots, /metrics; POST /tokenize, /detokenize, /apply-template
    worker       POST /v1/chat/completions/render, /v1/responses/render                   (what a router asks first)
    kv_publisher GET /get_server_info, /kv_event_sources; the KV events over ZMQ        (what kv_aware routing reads)
    handoff      GET /kv_handoff/{id}: a prefill worker's KV cells for its decode worker  (disaggregated prefill)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from llmkit.server import embeddings, errors, handoff, info, kv_publisher, metrics, worker
from llmkit.server.dialects import ROUTERS
from llmkit.server.middleware import AccessLog, Gate
from llmkit.server.state import ServerState, ServingEngine, Settings

__all__ = ["Settings", "create_app"]

Lifespan = Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]


def create_app(engine: ServingEngine | Callable[[], ServingEngine], settings: Settings | None = None) -> FastAPI:
    """The app over a running ``engine``, or over a loader called in a thread at start-up.

    With a loader the app owns the engine (closes it on shutdown) and answers
    503 "Loading model" until the loader returns, as llama-server does.
    """
    state = ServerState(settings or Settings())
    loader = engine if callable(engine) else None
    app = FastAPI(title="llmkit slot server", lifespan=lifespan(loader), openapi_url=None)
    app.state.server = state
    app.state.handoffs = handoff.Handoffs()  # a prefill worker's KV cells, kept for its decode workers
    app.state.metrics = metrics.registry(lambda: state.last_status)  # renders the snapshot /metrics waited for
    app.state.embedder = app.state.kv_publisher = None  # made once the engine is ready (start)
    if not callable(engine):
        start(app, engine)
    errors.install(app)
    routers = (info.router, embeddings.router, *ROUTERS, worker.router, kv_publisher.router, handoff.router)
    settings = state.settings
    routes = [route for router in routers for route in router.routes]  # the gate answers in the dialect of the route asked
    app.add_middleware(Gate, not_ready=state.not_ready, api_key=settings.api_key, max_body_size=settings.max_body_size, routes=routes)
    app.add_middleware(AccessLog)  # added last: outermost, so it logs the gate's answers too
    for router in routers:
        app.include_router(router)
    return app


def start(app: FastAPI, engine: ServingEngine) -> None:
    """The features that stand on the engine, then the engine served (the gate lets requests in)."""
    state: ServerState = app.state.server
    app.state.kv_publisher = kv_publisher.start(engine, state.settings.kv_events)
    app.state.embedder = embeddings.Embedder(engine.model, n_threads=state.settings.n_threads)
    state.ready(engine)


def stop(app: FastAPI, *, engine_too: bool) -> None:
    """The features closed, and the engine if the app loaded it."""
    for feature in (app.state.kv_publisher, app.state.embedder):
        if feature is not None:
            feature.close()
    if engine_too:
        app.state.server.close()


def lifespan(loader: Callable[[], ServingEngine] | None) -> Lifespan:
    """Start-up loads the engine in a worker thread (with a loader); shutdown waits for the load, then stops."""

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        state: ServerState = app.state.server
        loading = None
        if loader is not None:
            loading = asyncio.get_running_loop().run_in_executor(None, state.load, lambda: start(app, loader()))
        try:
            yield
        finally:
            if loading is not None:
                await loading
            stop(app, engine_too=loader is not None)

    return run
