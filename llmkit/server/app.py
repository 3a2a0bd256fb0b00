"""The slot server's app: its state, middlewares, error handlers and routes, wired together
(~ llama-server's route table in server.cpp and init_routes in server-context.cpp).

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

from llmkit.server import embeddings, errors, handoff, info, kv_publisher, worker
from llmkit.server.dialects import ROUTERS
from llmkit.server.middleware import AccessLog, Gate
from llmkit.server.state import ServerState, ServingEngine, Settings

__all__ = ["Settings", "create_app"]


def create_app(engine: ServingEngine | Callable[[], ServingEngine], settings: Settings | None = None) -> FastAPI:
    """The app over a running ``engine``, or over a loader called in a thread at start-up.

    With a loader the app owns the engine (closes it on shutdown) and answers
    503 "Loading model" until the loader returns, as llama-server does.
    """
    state = ServerState(settings or Settings())
    loader = engine if callable(engine) else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.get_running_loop().run_in_executor(None, state.load, loader) if loader else None
        try:
            yield
        finally:
            if loading is not None:
                await loading
            state.close(engine_too=loader is not None)

    app = FastAPI(title="llmkit slot server", lifespan=lifespan, openapi_url=None)
    app.state.server = state
    if not callable(engine):
        state.ready(engine)
    errors.install(app)
    routers = (info.router, embeddings.router, *ROUTERS, worker.router, kv_publisher.router, handoff.router)
    settings = state.settings
    routes = [route for router in routers for route in router.routes]  # the gate answers in the dialect of the route asked
    app.add_middleware(Gate, not_ready=state.not_ready, api_key=settings.api_key, max_body_size=settings.max_body_size, routes=routes)
    app.add_middleware(AccessLog)  # added last: outermost, so it logs the gate's answers too
    for router in routers:
        app.include_router(router)
    return app
