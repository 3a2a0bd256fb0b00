"""Every error the slot server answers, in the shape of the API that was asked (~ llama-server's format_error_response,
server-common.cpp).

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}           llama-server's (OpenAI's)
    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}       Anthropic's

Which shape is decided once, by the router: each dialect's ``APIRouter`` declares its ``Dialect``
(``APIRouter(dependencies=[Depends(ANTHROPIC)])``), every route it holds carries it, and ``dialect_of``
reads it off the route that serves a request (``LLAMA_SERVER`` where no route does). The handlers
installed here, the gate before the routes (``middleware.Gate``) and a stream's error event after the
200 (each dialect's ``WireFormat.error``) all write ``dialect.body(exc)``.

Routes raise ``ApiError``; FastAPI's own exceptions (bad JSON, wrong field
types, unknown routes), the engine's (``ContextSizeError``, ``EngineError``) and
anything unexpected are turned into the same shape by the handlers, so no
response is ever a traceback or an HTML page. ``off_loop`` runs a route's
blocking work on the input (tokenizing, templating, grammar checks) in a
worker thread and turns the input's faults into 400s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from llmkit.engine import ContextSizeError, EngineError

log = logging.getLogger("llmkit.server")

# llama-server's error types by HTTP status (error_type in server-common.h)
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


# Anthropic's error types by HTTP status (its Messages API answers {"type": "error", "error": {"type", "message"}})
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error answer: HTTP status, message, llama-server's error type, and any extra fields."""

    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.extra = extra

    def response(self, dialect: Dialect) -> JSONResponse:
        """The answer, in ``dialect``'s shape."""
        return JSONResponse(dialect.body(self), status_code=self.status)


class Dialect:
    """Which API a route speaks, as far as its errors go: llama-server's (OpenAI's) shape, or ``Anthropic``'s.

    An instance is a FastAPI dependency that returns itself: a router declares its dialect with
    ``APIRouter(dependencies=[Depends(dialect)])``, and each of its routes carries it (``dialect_of``)."""

    def __call__(self) -> Dialect:
        return self

    def body(self, exc: ApiError) -> dict:
        return {"error": {"code": exc.status, "message": str(exc), "type": exc.type, **exc.extra}}


class Anthropic(Dialect):
    def body(self, exc: ApiError) -> dict:
        kind = ANTHROPIC_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": str(exc)}}


LLAMA_SERVER, ANTHROPIC = Dialect(), Anthropic()


def dialect_of(scope: Scope, routes: Iterable[BaseRoute] = ()) -> Dialect:
    """The dialect a request's route declares: the route that served it (``scope["route"]``), else the one of
    ``routes`` that matches it (before routing: ``middleware.Gate``); ``LLAMA_SERVER`` for a path no route serves."""
    route = scope.get("route") or next((r for r in routes if r.matches(scope)[0] is Match.FULL), None)
    declared = (d.dependency for d in getattr(route, "dependencies", ()))
    return next((d for d in declared if isinstance(d, Dialect)), LLAMA_SERVER)


def describe_validation_errors(errors: list[dict]) -> str:
    """One readable message naming each bad field: ``'temperature': Input should be ...``.

    pydantic reports a union that fails as one error per member (``stop.str``,
    ``stop.list[str]``); the common prefix of a field's error locations is
    the field itself, which is what the client needs to see.
    """
    if any(e["type"] == "json_invalid" for e in errors):
        e = errors[0]
        return f"Invalid JSON: {e.get('ctx', {}).get('error', e['msg'])} (at character {e['loc'][-1]})"
    by_field: dict[tuple, list[dict]] = {}
    for e in errors:
        loc = tuple(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"])
        by_field.setdefault(loc[:1], []).append({**e, "loc": loc})
    parts = []
    for group in by_field.values():
        locs = [e["loc"] for e in group]
        n = 0
        while all(len(loc) > n and loc[n] == locs[0][n] for loc in locs):
            n += 1
        field = ".".join(map(str, locs[0][:n])) or "body"
        if field == "body" and group[0]["type"] in ("model_attributes_type", "dict_type"):
            # a JSON array or string, or a body FastAPI did not parse (say, curl -d without -H)
            parts.append("'body': must be a JSON object, sent with Content-Type: application/json")
        else:
            parts.append(f"'{field}': {group[0]['msg']}")
    return "Invalid request: " + "; ".join(parts)


def invalid(exc: ValidationError, names: Mapping[str, str]) -> ApiError:
    """A converted request that fails its own model's checks (a Responses or Messages body as a chat request), as the
    client's 400: each error under the client's field, ``names`` mapping the converted request's top-level fields to
    the client's where they differ (deeper places are the converted request's, not the client's: left out)."""
    errors = [{**e, "loc": (names.get(str(e["loc"][0]), str(e["loc"][0])),) if e["loc"] else ()} for e in exc.errors()]
    return ApiError(400, describe_validation_errors(errors))


async def off_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker thread; bad input becomes a 400 (a ``ContextSizeError`` passes: its handler)."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except ContextSizeError:
        raise
    except UnicodeEncodeError:
        raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate)") from None
    except (ValueError, TemplateError) as exc:
        raise ApiError(400, str(exc)) from None


def http_message(exc: StarletteHTTPException) -> str:
    """A Starlette or FastAPI refusal in words: llama-server's 404 text; for a body FastAPI could not parse, why (its
    own words, "There was an error parsing the body", do not say: not UTF-8, nested too deeply, a number too long)."""
    if exc.status_code == 404:
        return "File Not Found"
    cause = exc.__cause__
    if exc.status_code == 400 and cause is not None:
        return f"Invalid JSON: {type(cause).__name__}: {cause}"
    return str(exc.detail)


def install(app: FastAPI) -> None:
    """Register the handlers that give every failure the error shape of the route's dialect."""

    def answer(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(dialect_of(request.scope))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI and llama-server answer 400 (and llama-server 500 for bad JSON).
        return answer(request, ApiError(400, describe_validation_errors(list(exc.errors()))))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, ApiError(exc.status_code, http_message(exc)))

    @app.exception_handler(ContextSizeError)  # the prompt does not fit (engine.submit, or the embedder's own context)
    async def context_size(request: Request, exc: ContextSizeError) -> JSONResponse:
        return answer(request, ApiError(400, str(exc), "exceed_context_size_error", n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx))

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return answer(request, ApiError(500, str(exc)))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost middleware calls this, sends our JSON, then re-raises
        # so that uvicorn logs the traceback; the server keeps serving.
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return answer(request, ApiError(500, f"Internal server error: {type(exc).__name__}: {exc}"))
