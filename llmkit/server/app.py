"""The slot server's app: its state, middlewares, error handlers and routes, wired together
(~ llama-server's route table in server.cpp and init_routes in server-context.cpp).

The routes live by role (llama-server's paths: without ``/v1``,
``/completions`` and ``/embeddings`` are its own dialect, not OpenAI's):

    generation   POST /v1/chat/completions, /v1/completions, /completion ...   (chat, text, native)
    responses    POST /v1/responses, /v1/responses/input_tokens                 (OpenAI Responses)
    messages     POST /v1/messages, /v1/messages/count_tokens                   (Anthropic Messages)
    embeddings   POST /v1/embeddings, /embedding, /embeddings
    info         GET /health, /v1/models, /props, /slots, /metrics; POST /tokenize, /detokenize, /apply-template
    worker       POST /v1/chat/completions/render, /v1/responses/render                   (what a router asks first)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from llmkit.server import embeddings, errors, generation, info, messages, responses, worker
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
    app.add_middleware(Gate, not_ready=state.not_ready, api_key=state.settings.api_key, max_body_size=state.settings.max_body_size)
    app.add_middleware(AccessLog)  # added last: outermost, so it logs the gate's answers too
    for routes in (info.router, embeddings.router, generation.router, responses.router, messages.router, worker.router):
        app.include_router(routes)
    return app
