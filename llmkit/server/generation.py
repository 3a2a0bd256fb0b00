"""The generation routes: chat, text and native completions (~ llama-server's post_chat_completions,
post_completions and handle_completions_impl in server-context.cpp).

    POST /v1/chat/completions, /chat/completions    OpenAI chat, whole or streamed (SSE)
    POST /v1/completions                            OpenAI text completion, whole or streamed
    POST /completion, /completions                  llama-server's own completion (prompt as text and/or token ids)

The three differ only in how the prompt is made and how the answer is shaped
(``sse.Formatter``, ``sse.NativeFormatter``); all go through ``generate``:
submit to the engine, then collect the pieces or stream them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from llmkit.engine import ContextSizeError, grammar
from llmkit.llama import Model, SamplingParams
from llmkit.server import sse
from llmkit.server.errors import ApiError, off_loop
from llmkit.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    NativeCompletionRequest,
    check_tokens,
    constraint_of,
    sampling_params,
)
from llmkit.server.state import SYSTEM_FINGERPRINT, ServerState, State

log = logging.getLogger("llmkit.server")
router = APIRouter()


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: Request, state: State) -> Any:
    messages = [m.to_template() for m in body.messages]
    prompt = await off_loop(state.engine.model.tokenize_chat, messages)
    return await generate(http_request, state, body, prompt, openai_formatter(state, body, chat=True))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: Request, state: State) -> Any:
    model = state.engine.model
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        tokens = await off_loop(model.tokenize, prompt)
    else:
        tokens = check_tokens(prompt, model.n_vocab, "prompt")
    return await generate(http_request, state, body, tokens, openai_formatter(state, body, chat=False))


@router.post("/completion")
@router.post("/completions")
async def completion(body: NativeCompletionRequest, http_request: Request, state: State) -> Any:
    """llama-server's own completion (post_completions): its request fields, its answer (``sse.NativeFormatter``)."""
    model = state.engine.model
    tokens = check_tokens(await off_loop(tokenize_mixed, model, body.prompt), model.n_vocab, "prompt")
    prompt_text = b"".join(model.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")
    fmt = sse.NativeFormatter(state.model_name, prompt_text, body.n_top_logprobs(), model.token_to_piece, body.return_tokens, body.stream)
    return await generate(http_request, state, body, tokens, fmt)


def openai_formatter(state: ServerState, body: GenerationRequest, *, chat: bool) -> sse.Formatter:
    return sse.Formatter(chat, state.model_name, SYSTEM_FINGERPRINT, body.n_top_logprobs(), state.engine.model.token_to_piece)


async def generate(
    http_request: Request, state: ServerState, body: GenerationRequest, prompt: list[int], fmt: sse.Formatter | sse.NativeFormatter
) -> Any:
    """Submit the prompt; answer with the whole completion, or stream it."""
    engine = state.engine
    n_top = body.n_top_logprobs()
    # the constraint's conversion and check are CPU work: off the event loop; bad ones are a 400 here
    params = await off_loop(request_params, body, state.settings.sampling_defaults(), engine.model)
    try:
        request = engine.submit(
            prompt,
            params,
            cache_prompt=body.cache_prompt,
            id_slot=None if body.id_slot < 0 else body.id_slot,
            n_probs=0 if n_top is None else max(n_top, 1),  # the engine computes logprobs only when n_probs > 0
            n_keep=body.n_keep,
            n_cache_reuse=body.n_cache_reuse,
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


def request_params(body: GenerationRequest, defaults: SamplingParams, model: Model) -> SamplingParams:
    """The request's sampling settings, with its constraint (if any) compiled into a grammar for ``model``'s slots."""
    constraint = constraint_of(body)
    return sampling_params(body, defaults, None if constraint is None else grammar.compile(constraint, model))


def tokenize_mixed(model: Model, prompt: str | list[int | str]) -> list[int]:
    """A native prompt's tokens (llama-server's tokenize_mixed): strings tokenized, ids kept; BOS only if it starts with a string."""
    if isinstance(prompt, str):
        return model.tokenize(prompt)
    return [t for i, part in enumerate(prompt) for t in (model.tokenize(part, add_special=i == 0) if isinstance(part, str) else [part])]
