"""Every error the slot server answers, in one shape (~ llama-server's format_error_response, server-common.cpp).

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}
    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}     (Anthropic's routes)

Routes raise ``ApiError``; FastAPI's own exceptions (bad JSON, wrong field
types, unknown routes) and anything unexpected are turned into the same
shape by the handlers installed here, so no response is ever a traceback or
an HTML page. ``off_loop`` runs a route's blocking work on the input
(tokenizing, templating, grammar checks) in a worker thread and turns the
input's faults into 400s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

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
ANTHROPIC_PATHS = ("/v1/messages",)  # and what is under it (/v1/messages/count_tokens)


def speaks_anthropic(path: str) -> bool:
    """Is ``path`` an Anthropic route, whose errors come in Anthropic's shape?"""
    return path.startswith(ANTHROPIC_PATHS)


class ApiError(Exception):
    """An error answer: HTTP status, message, llama-server's error type, and any extra fields."""

    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.extra = extra

    @classmethod
    def context_size(cls, exc: ContextSizeError) -> ApiError:
        return cls(400, str(exc), "exceed_context_size_error", n_prompt_tokens=exc.n_prompt_tokens, n_ctx=exc.n_ctx)

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": str(self), "type": self.type, **self.extra}}

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer, in the shape of the API that ``path`` belongs to."""
        return JSONResponse(self.anthropic_body() if speaks_anthropic(path) else self.body(), status_code=self.status)


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


async def off_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker thread; bad input becomes a 400."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except ContextSizeError as exc:
        raise ApiError.context_size(exc) from None
    except UnicodeEncodeError:
        raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate)") from None
    except (ValueError, TemplateError) as exc:
        raise ApiError(400, str(exc)) from None


def install(app: FastAPI) -> None:
    """Register the handlers that give every failure the error shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI and llama-server answer 400 (and llama-server 500 for bad JSON).
        return ApiError(400, describe_validation_errors(list(exc.errors()))).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = "File Not Found" if exc.status_code == 404 else str(exc.detail)  # llama-server's 404 text
        return ApiError(exc.status_code, message).response(request.url.path)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return ApiError(500, str(exc)).response(request.url.path)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's outermost middleware calls this, sends our JSON, then re-raises
        # so that uvicorn logs the traceback; the server keeps serving.
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return ApiError(500, f"Internal server error: {type(exc).__name__}: {exc}").response(request.url.path)
