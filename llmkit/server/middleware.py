"""What runs before and after every route (~ llama-server's server-http.cpp middlewares).

``Gate`` is llama-server's pre-routing handler plus a body limit: while the
model loads every path answers 503; with an API key every path but
``/health`` needs it (``Authorization: Bearer <key>`` or ``X-Api-Key``); a
body over the limit is refused with 413 before any route sees it. A refusal
speaks the dialect of the route that was asked (``errors.dialect_of``).
``AccessLog`` writes one line per request once its response is complete:

    POST /v1/chat/completions 200 prompt=31 cached=24 generated=16 0.412s

(the routes that read tokens, generation's and the embeddings', add their counts with ``log_usage``).

Both are plain ASGI middlewares: they wrap a streamed response without
buffering it and do not get in the way of the disconnect that cancels it.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Sequence

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmkit.server.errors import ApiError, dialect_of

log = logging.getLogger("llmkit.server")

PUBLIC_PATHS = {"/health", "/v1/health"}


class Gate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        not_ready: Callable[[], ApiError | None],
        api_key: str | None,
        max_body_size: int,
        routes: Sequence[BaseRoute] = (),
    ):
        self.app = app
        self.not_ready = not_ready  # the 503 "Loading model" answer while loading, else None
        self.api_key = api_key
        self.max_body_size = max_body_size
        self.routes = routes  # the app's: a refusal speaks the dialect of the route that was asked (errors.dialect_of)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        try:
            if (error := self.not_ready()) is not None:
                raise error
            if self.api_key and scope["path"] not in PUBLIC_PATHS and not self.authorized(headers):
                raise ApiError(401, "Invalid API Key")
            body = await self.read_body(headers, receive)
        except ApiError as exc:
            return await exc.response(dialect_of(scope, self.routes))(scope, receive, send)
        await self.app(scope, replay(body, receive), send)

    def authorized(self, headers: Headers) -> bool:
        key = headers.get("authorization") or headers.get("x-api-key") or ""
        key = key.removeprefix("Bearer ")
        return self.api_key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())

    async def read_body(self, headers: Headers, receive: Receive) -> bytes:
        """The whole body, refused (413) as soon as it is known to be too big."""
        too_big = ApiError(413, f"Request body larger than {self.max_body_size} bytes")
        if int(headers.get("content-length") or 0) > self.max_body_size:
            raise too_big
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # http.disconnect: the route will see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_size:
                raise too_big
            more = message.get("more_body", False)
        return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body already read, then the real messages (the disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> Message:
        return pending.pop() if pending else await receive()

    return receive_again


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 0
        state = scope.setdefault("state", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500  # the outermost error middleware answers it, after us
            raise
        finally:
            tokens = ""
            if (usage := state.get("usage")) is not None:  # set by the routes that read tokens (log_usage)
                tokens = " prompt={} cached={} generated={}".format(*usage)
            log.info("%s %s %s%s %.3fs", scope["method"], scope["path"], status or "-", tokens, time.perf_counter() - t0)


def log_usage(http_request: Request, n_prompt: int, n_cached: int, n_output: int) -> None:
    """Add a request's token counts to what ``AccessLog`` prints for this HTTP request (several prompts: their sums)."""
    before = getattr(http_request.state, "usage", (0, 0, 0))
    http_request.state.usage = tuple(a + b for a, b in zip(before, (n_prompt, n_cached, n_output), strict=True))
