"""Routes of the slot server (~ llama-server's route table in server.cpp, handlers in server-context.cpp).

    POST /v1/chat/completions, /chat/completions    OpenAI chat, whole or streamed (SSE)
    POST /v1/completions                            OpenAI text completion, whole or streamed
    POST /completion, /completions                  llama-server's own completion (prompt as text and/or token ids)
    POST /v1/embeddings                             mean-pooled, L2-normalised vectors (OpenAI's shape)
    POST /embedding, /embeddings                    the same vectors in llama-server's own shape
    GET  /v1/models, /models                        the one loaded model (and /v1/models/{id})
    GET  /health, /v1/health                        {"status": "ok"} (503 while the model loads)
    GET  /props                                     server settings and defaults
    POST /tokenize, /detokenize, /apply-template
    GET  /slots                                     per-slot state (501 with --no-slots)
    GET  /metrics                                   Prometheus text (501 without --metrics)

The paths are llama-server's: without ``/v1``, ``/completions`` and
``/embeddings`` are its own dialect, not OpenAI's. Chat, text and native
completions differ only in how the prompt is made and how the answer is
shaped (``sse.Formatter``, ``sse.NativeFormatter``); all go through
``generate``: submit to the engine, then collect the pieces or stream them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

import llmkit
from llmkit.engine import ContextSizeError, Engine
from llmkit.engine.grammar import check_grammar
from llmkit.llama import Model, SamplingParams
from llmkit.server import errors, metrics, sse
from llmkit.server.embeddings import Embedder
from llmkit.server.errors import ApiError
from llmkit.server.middleware import AccessLog, Gate
from llmkit.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerationRequest,
    NativeCompletionRequest,
    NativeEmbeddingRequest,
    TokenizeRequest,
    check_tokens,
    sampling_params,
)

log = logging.getLogger("llmkit.server")

SYSTEM_FINGERPRINT = f"llmkit-{llmkit.__version__}-llama-cpp-python-{llama_cpp.__version__}"


@dataclass
class Settings:
    """Server-wide settings (the CLI flags that are not the engine's)."""

    alias: str | None = None  # the model name clients see (default: the GGUF file name)
    api_key: str | None = None
    n_predict: int = -1  # default max_tokens; -1: until end of generation or the slot's context is full
    temperature: float = 0.8
    seed: int | None = None
    metrics: bool = False
    slots: bool = True
    max_body_size: int = 10 * 2**20
    n_threads: int | None = None  # for the embedding context

    def sampling_defaults(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed, max_tokens=self.n_predict)


def create_app(engine: Engine | Callable[[], Engine], settings: Settings | None = None) -> FastAPI:
    """The app over a running ``engine``, or over a loader called in a thread at start-up.

    With a loader the app owns the engine (closes it on shutdown) and answers
    503 "Loading model" until the loader returns, as llama-server does.
    """
    settings = settings or Settings()
    loader = engine if callable(engine) else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.get_running_loop().run_in_executor(None, load, loader) if loader else None
        try:
            yield
        finally:
            if loading is not None:
                await loading
            if app.state.embedder is not None:
                app.state.embedder.close()
            if loader and app.state.engine is not None:
                app.state.engine.close()

    def load(loader: Callable[[], Engine]) -> None:
        try:
            ready(loader())
        except Exception as exc:
            log.exception("the model failed to load")
            app.state.load_error = exc

    def ready(engine: Engine) -> None:
        app.state.embedder = Embedder(engine.model, n_threads=settings.n_threads)
        app.state.engine = engine
        log.info("model %s ready: %d slots of %d tokens", model_name(), len(engine.slots), engine.n_ctx_slot)

    def not_ready() -> ApiError | None:
        if app.state.load_error is not None:
            return ApiError(500, f"The model failed to load: {app.state.load_error}")
        return None if app.state.engine is not None else ApiError(503, "Loading model")

    def the_engine() -> Engine:
        return app.state.engine  # never None in a route: the gate answers 503 until it is set

    def model_name() -> str:
        return settings.alias or the_engine().model.path.name

    app = FastAPI(title="llmkit slot server", lifespan=lifespan, openapi_url=None)
    app.state.settings = settings
    app.state.engine = app.state.embedder = app.state.load_error = None
    if loader is None:
        ready(engine)
    errors.install(app)
    app.add_middleware(Gate, not_ready=not_ready, api_key=settings.api_key, max_body_size=settings.max_body_size)
    app.add_middleware(AccessLog)  # added last: outermost, so it logs the gate's answers too
    registry = metrics.registry(the_engine)

    def route(method: str, *paths: str) -> Callable:
        """Register one handler under each of llama-server's paths for it (server.cpp lists its aliases one by one)."""

        def register(handler: Callable) -> Callable:
            for path in paths:
                app.add_api_route(path, handler, methods=[method])
            return handler

        return register

    # --- health, models, props -------------------------------------------------

    @route("GET", "/health", "/v1/health")
    async def health() -> dict:
        return {"status": "ok"}

    def model_info() -> dict:
        engine = the_engine()
        m = engine.model
        meta = {"n_vocab": m.n_vocab, "n_ctx": engine.n_ctx_slot, "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd,
                "n_params": m.n_params(), "size": m.path.stat().st_size}  # fmt: skip
        return {"id": model_name(), "object": "model", "created": int(time.time()), "owned_by": "llamacpp", "meta": meta}

    @route("GET", "/v1/models", "/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_info()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != model_name():
            raise ApiError(404, f"Model not found: {model_id}")
        return model_info()

    @app.get("/props")
    async def props() -> dict:
        engine = the_engine()
        defaults = {k: v for k, v in dataclasses.asdict(settings.sampling_defaults()).items() if k != "grammar"}
        return {
            "default_generation_settings": {"n_ctx": engine.n_ctx_slot, "params": defaults},
            "total_slots": len(engine.slots),
            "model_alias": model_name(),
            "model_path": str(engine.model.path),
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": settings.slots,
            "endpoint_metrics": settings.metrics,
            "chat_template": engine.model.meta("tokenizer.chat_template") or "",
            "build_info": SYSTEM_FINGERPRINT,
            "step_tokens": engine.step_tokens,  # llmkit's own: the per-step token budget (0: none, as llama-server)
        }

    # --- monitoring --------------------------------------------------------------

    @app.get("/slots")
    async def slots() -> list[dict]:
        if not settings.slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`")
        return [slot.to_dict() for slot in the_engine().slots]

    @app.get("/metrics")
    async def prometheus() -> Response:
        if not settings.metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        content, media_type = metrics.render(registry)
        return Response(content, media_type=media_type)

    # --- tokens ----------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        model = the_engine().model
        tokens = await off_loop(model.tokenize, body.content, add_special=body.add_special, parse_special=body.parse_special)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": text_or_bytes(model.token_to_piece(t))} for t in tokens]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        model = the_engine().model
        return {"content": model.detokenize(check_tokens(body.tokens, model.n_vocab, "tokens"))}

    @app.post("/apply-template")
    async def apply_template(body: ChatCompletionRequest) -> dict:
        """The chat prompt as text, nothing generated (llama-server: post_apply_template)."""
        messages = [m.to_template() for m in body.messages]
        return {"prompt": await off_loop(the_engine().model.apply_chat_template, messages)}

    # --- embeddings ------------------------------------------------------------------

    async def embed(body: EmbeddingRequest, http_request: Request) -> list[np.ndarray]:
        embedder: Embedder = app.state.embedder
        prompts = await off_loop(embedder.tokenize, body.texts)
        vectors = await run_in_threadpool(embedder.embed, prompts)
        http_request.state.n_prompt_tokens = sum(map(len, prompts))
        return vectors

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, http_request: Request) -> dict:
        vectors = await embed(body, http_request)
        n_tokens = http_request.state.n_prompt_tokens
        return {
            "object": "list",
            "model": model_name(),
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    @route("POST", "/embedding", "/embeddings")
    async def embeddings_native(body: NativeEmbeddingRequest, http_request: Request) -> list[dict]:
        """llama-server's own shape (handle_embeddings_impl, non-OAI): one vector per input, in a list of one."""
        vectors = await embed(body, http_request)
        return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]

    # --- completions -------------------------------------------------------------------

    def openai_formatter(body: GenerationRequest, *, chat: bool) -> sse.Formatter:
        return sse.Formatter(chat, model_name(), SYSTEM_FINGERPRINT, body.n_top_logprobs(), the_engine().model.token_to_piece)

    @route("POST", "/v1/chat/completions", "/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Any:
        messages = [m.to_template() for m in body.messages]
        prompt = await off_loop(the_engine().model.tokenize_chat, messages)
        return await generate(http_request, body, prompt, openai_formatter(body, chat=True))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request) -> Any:
        model = the_engine().model
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            tokens = await off_loop(model.tokenize, prompt)
        else:
            tokens = check_tokens(prompt, model.n_vocab, "prompt")
        return await generate(http_request, body, tokens, openai_formatter(body, chat=False))

    @route("POST", "/completion", "/completions")
    async def completion(body: NativeCompletionRequest, http_request: Request) -> Any:
        """llama-server's own completion (post_completions): its request fields, its answer (``sse.NativeFormatter``)."""
        model = the_engine().model
        tokens = check_tokens(await off_loop(tokenize_mixed, model, body.prompt), model.n_vocab, "prompt")
        prompt_text = b"".join(model.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")
        fmt = sse.NativeFormatter(model_name(), prompt_text, body.n_top_logprobs(), model.token_to_piece, body.return_tokens, body.stream)
        return await generate(http_request, body, tokens, fmt)

    async def generate(http_request: Request, body: GenerationRequest, prompt: list[int], fmt: sse.Formatter | sse.NativeFormatter) -> Any:
        """Submit the prompt; answer with the whole completion, or stream it."""
        engine = the_engine()
        n_top = body.n_top_logprobs()
        # a schema's conversion and a grammar's check are CPU work: off the event loop; bad ones are a 400 here
        params = await off_loop(sampling_params, body, settings.sampling_defaults())
        if params.grammar is not None:
            await off_loop(check_grammar, params.grammar, engine.model)
        try:
            request = engine.submit(
                prompt,
                params,
                cache_prompt=body.cache_prompt,
                id_slot=None if body.id_slot < 0 else body.id_slot,
                n_probs=0 if n_top is None else max(n_top, 1),  # the engine computes logprobs only when n_probs > 0
            )
        except ContextSizeError as exc:
            raise ApiError.context_size(exc) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        http_request.state.engine_request = request  # for the access log
        pieces = aiter(request)
        if not body.stream:
            return fmt.response(request, [piece async for piece in pieces])

        first = await anext(pieces, None)  # an error before the first token is an ordinary HTTP error

        async def events() -> AsyncIterator[str]:
            piece = first
            try:
                for chunk in fmt.opening():
                    yield sse.event(chunk)
                while piece is not None:
                    yield sse.event(fmt.chunk(request, piece))
                    piece = await anext(pieces, None)
                for chunk in fmt.closing(request, body.include_usage):
                    yield sse.event(chunk)
                if fmt.done:
                    yield fmt.done
            except Exception as exc:  # noqa: BLE001 -- the 200 is already sent: report in the stream, and end it
                log.warning("stream of request %d failed: %s", request.id, exc)
                yield sse.event(ApiError(500, str(exc) or type(exc).__name__).body())
            finally:
                await pieces.aclose()

        # On a client disconnect Starlette cancels ``events`` and then runs the background
        # task: ``cancel`` frees the slot at the engine's next step (a no-op once finished).
        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(request.cancel),
        )

    return app


async def off_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Tokenizing (and chat templating) in a worker thread; bad input becomes a 400."""
    try:
        return await run_in_threadpool(fn, *args, **kwargs)
    except ContextSizeError as exc:
        raise ApiError.context_size(exc) from None
    except UnicodeEncodeError:
        raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate)") from None
    except (ValueError, TemplateError) as exc:
        raise ApiError(400, str(exc)) from None


def tokenize_mixed(model: Model, prompt: str | list[int | str]) -> list[int]:
    """A native prompt's tokens (llama-server's tokenize_mixed): strings tokenized, ids kept; BOS only if it starts with a string."""
    if isinstance(prompt, str):
        return model.tokenize(prompt)
    return [t for i, part in enumerate(prompt) for t in (model.tokenize(part, add_special=i == 0) if isinstance(part, str) else [part])]


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding as JSON numbers, or as base64 of little-endian float32 (OpenAI's two formats)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def text_or_bytes(raw: bytes) -> str | list[int]:
    """A token's piece for /tokenize: text if it is whole UTF-8, else its bytes (as llama-server)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)

