"""HTTP routes of the sequential translation server (the tutorial's server in Python).

    GET  /health              {"status": "ok"}
    POST /translate           {"text", "target_lang"} -> {"translation": ...}
    POST /translate/stream    same body -> SSE: data: "<token>" ... data: [DONE]
    GET  /models              the catalog, with downloaded / selected
    POST /models/select       {"model": name} -> SSE: downloading / loading / ready | error
    GET  /                    the web UI (static files)

Errors are ``{"error": "<message>"}`` with a 4xx/5xx status, as in the tutorial.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmkit import models
from llmkit.sequential.translator import PromptTooLong, Translator
from llmkit.text import is_unicode

log = logging.getLogger("llmkit.sequential")
STATIC = Path(__file__).parent / "static"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def sse(data: Any) -> str:
    """One server-sent event; strings stay JSON strings so newlines survive."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def body_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("Invalid JSON") from None
    except RecursionError:  # Python's parser recurses once per level of [ or {
        raise BadRequest("Invalid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("'text' is required")
    return body


async def translation_request(request: Request) -> tuple[str, str]:
    body = await body_object(request)
    text, lang = body.get("text"), body.get("target_lang", "ja")
    if not isinstance(text, str) or not text:
        raise BadRequest("'text' is required")
    if not isinstance(lang, str) or not lang.strip():
        raise BadRequest("'target_lang' must be a non-empty string, such as \"ja\"")
    for name, value in (("text", text), ("target_lang", lang)):
        if not is_unicode(value):
            raise BadRequest(f"'{name}' is not valid Unicode (it holds a lone surrogate)")
    return text, lang


async def iterate_in_thread(items: Generator[Any, None, None]) -> AsyncIterator[Any]:
    """Drive a blocking iterator from async code, one ``next()`` per worker-thread hop.

    Whatever ends the stream (the end, an error, or the client going away,
    which cancels this task), ``items.close()`` runs: the translator's
    ``finally`` frees the sampler and its lock right away.
    """
    done = object()
    try:
        while (item := await run_in_threadpool(next, items, done)) is not done:
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(items.close)


def create_app(translator: Translator) -> FastAPI:
    app = FastAPI(title="llmkit sequential translation server")
    app.state.translator = translator
    swap_lock = threading.Lock()  # one model download/load at a time

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error(str(exc), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        # Starlette would answer 500 anyway and keep serving; we only give it a JSON body.
        log.error("handler failed", exc_info=exc)
        return error(str(exc) or type(exc).__name__, 500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/translate")
    async def translate(request: Request) -> dict:
        text, lang = await translation_request(request)
        try:
            return {"translation": await run_in_threadpool(translator.translate, text, lang)}
        except PromptTooLong as exc:
            raise BadRequest(str(exc)) from None

    @app.post("/translate/stream")
    async def translate_stream(request: Request) -> StreamingResponse:
        text, lang = await translation_request(request)

        async def events() -> AsyncIterator[str]:
            try:
                async for piece in iterate_in_thread(translator.stream(text, lang)):
                    yield sse(piece)
                yield "data: [DONE]\n\n"
            except Exception as exc:  # status 200 is already sent: report in-band
                log.exception("stream failed")
                yield sse({"error": str(exc) or type(exc).__name__})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/models")
    async def list_models() -> dict:
        current = translator.model_path.resolve()
        return {
            "models": [
                {
                    "name": e.name,
                    "params": e.params,
                    "size": e.size,
                    "downloaded": models.is_downloaded(e),
                    "selected": models.entry_path(e).resolve() == current,
                }
                for e in models.CATALOG
            ]
        }

    @app.post("/models/select")
    async def select_model(request: Request) -> StreamingResponse:
        body = await body_object(request)
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise BadRequest("'model' is required")
        entry = models.find_entry(name)
        if entry is None:
            raise BadRequest("Unknown model", 404)
        return StreamingResponse(
            iterate_in_thread(select_events(entry)), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def select_events(entry: models.CatalogEntry) -> Generator[str, None, None]:
        """Download (if needed) and load ``entry``, as a stream of status events."""
        with swap_lock:
            try:
                if not models.is_downloaded(entry):
                    for percent in download_progress(entry):
                        yield sse({"status": "downloading", "progress": percent})
                yield sse({"status": "loading"})
                translator.swap_model(models.entry_path(entry))
                yield sse({"status": "ready"})
            except Exception as exc:  # noqa: BLE001 -- any failure is told to the client in the stream
                log.warning("model %s not selected: %s", entry.name, exc)
                yield sse({"status": "error", "message": str(exc)})

    @app.get("/", include_in_schema=False)
    async def web_ui() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def download_progress(entry: models.CatalogEntry) -> Iterator[int]:
    """Run ``models.download`` in a thread and yield its integer percents as they come."""
    updates: queue.Queue = queue.Queue()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            models.download(entry, updates.put)
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller below
            failure.append(exc)
        finally:
            updates.put(None)

    threading.Thread(target=run, daemon=True).start()
    while (percent := updates.get()) is not None:
        yield percent
    if failure:
        raise failure[0]
