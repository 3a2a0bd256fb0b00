"""The routes that tell about the server and its model, and the tokenizer's (~ llama-server's handlers in server-context.cpp).

GET  /health, /v1/health          {"status": "ok"} (503 while the model loads: ``middleware.Gate``)
GET  /v1/models, /models          the one loaded model (and /v1/models/{id})
GET  /props                       server settings and defaults
GET  /slots                       per-slot state (501 with --no-slots)
GET  /metrics                     Prometheus text (501 without --metrics)
POST /tokenize, /detokenize, /apply-template
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from llmkit.engine import SlotStatus
from llmkit.llama import Model
from llmkit.server import metrics
from llmkit.server.dialects.openai_chat import ChatCompletionRequest
from llmkit.server.errors import ApiError, off_loop
from llmkit.server.protocol import ApiModel, check_tokens
from llmkit.server.state import SYSTEM_FINGERPRINT, ServerState, State

router = APIRouter()


class TokenizeRequest(ApiModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(ApiModel):
    tokens: list[int]


@router.get("/health")
@router.get("/v1/health")
async def health() -> dict:
    return {"status": "ok"}


def model_info(state: ServerState) -> dict:
    engine = state.engine
    m = engine.model
    meta = {
        "n_vocab": m.n_vocab,
        "n_ctx": state.n_ctx_slot,
        "n_ctx_train": m.n_ctx_train,
        "n_embd": m.n_embd,
        "n_params": m.n_params(),
        "size": m.path.stat().st_size,
    }
    return {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "llamacpp", "meta": meta}


@router.get("/v1/models")
@router.get("/models")
async def list_models(state: State) -> dict:
    return {"object": "list", "data": [model_info(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State) -> dict:
    if model_id != state.model_name:
        raise ApiError(404, f"Model not found: {model_id}")
    return model_info(state)


@router.get("/props")
async def props(state: State) -> dict:
    engine, settings = state.engine, state.settings
    status = await state.status()
    return {
        "default_generation_settings": {"n_ctx": status.n_ctx_slot, "params": settings.defaults.to_dict()},
        "total_slots": len(status.slots),
        "model_alias": state.model_name,
        "model_path": str(engine.model.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": settings.slots,
        "endpoint_metrics": settings.metrics,
        "chat_template": engine.model.chat_template,
        "build_info": SYSTEM_FINGERPRINT,
        # llmkit's own: every engine setting in effect (EngineConfig: llama-server's flag names), and the prompt cache
        "engine": status.config.to_dict(),
        "prompt_cache": status.prompt_cache,
    }


@router.get("/slots")
async def slots(state: State) -> list[dict]:
    if not state.settings.slots:
        raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`")
    status = await state.status()
    speculative = status.config.speculates
    return [slot_json(slot, speculative) for slot in status.slots]


def slot_json(slot: SlotStatus, speculative: bool = False) -> dict:
    """One slot as ``GET /slots`` shows it (llama-server's keys, and llmkit's ``n_cached``, ``n_restored_from_cache`` and
    ``n_shared``)."""
    state: dict[str, Any] = {
        "id": slot.id,
        "n_ctx": slot.n_ctx,
        "speculative": speculative,
        "is_processing": slot.job is not None,
        "n_cached": slot.n_cached,
        "n_restored_from_cache": slot.n_restored,
        "n_shared": slot.n_shared,  # --kv-share: of n_cached, the first cells another slot may hold too
    }
    if slot.job is not None:
        state |= dataclasses.asdict(slot.job)
    return state


@router.get("/metrics")
async def prometheus(state: State, registry: metrics.Registry) -> Response:
    if not state.settings.metrics:
        raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    await state.status()  # the snapshot the registry renders, waited for off the event loop
    content, media_type = metrics.render(registry)
    # llama-server's header, its name spelled as llama-server writes it on the wire (a client may read headers
    # case-sensitively, as its own tests do): a raw header, which Starlette does not lower and uvicorn's h11 writes
    # as it is (``llmkit serve slots`` runs h11 for it). Its value there is ggml_time_us() (microseconds since the
    # process started ggml), despite the name: here it is what the name says, the start in Unix seconds.
    response = Response(content, media_type=media_type)
    response.raw_headers.append((b"Process-Start-Time-Unix", str(state.t_start).encode()))
    return response


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict:
    model = state.engine.model
    tokens = await off_loop(model.tokenize, body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": text_or_bytes(model.token_to_piece(t))} for t in tokens]}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict:
    model = state.engine.model
    return {"content": model.detokenize(check_tokens(body.tokens, model.n_vocab, "tokens"))}


@router.post("/apply-template")
async def apply_template(body: ChatCompletionRequest, state: State) -> dict:
    """The chat prompt as text, tools described, nothing generated (llama-server: post_apply_template)."""
    return {"prompt": await off_loop(render_chat, state.engine.model, body)}


def render_chat(model: Model, body: ChatCompletionRequest) -> str:
    """The chat template applied; the text must be UTF-8 to be sent (a lone surrogate is a 400 from ``off_loop``, as for chat)."""
    messages, tools = body.tool_calling(model.chat_template).render([m.to_template() for m in body.messages])
    prompt = model.apply_chat_template(messages, tools)
    prompt.encode("utf-8")
    return prompt


def text_or_bytes(raw: bytes) -> str | list[int]:
    """A token's piece for /tokenize: text if it is whole UTF-8, else its bytes (as llama-server)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
