"""What a router asks of the slot server beyond the APIs: the prompt's token ids, before it routes.

    POST /v1/chat/completions/render    {"token_ids": [...]}: the chat request's prompt, as the chat route reads it
    POST /v1/responses/render           the same for a Responses request

A prefix-aware router must know which tokens a request's prompt is. vllm-router (the fleet's router) does not
tokenize for HTTP workers: before its ``cache_aware`` or ``kv_aware`` policy chooses, it posts the client's body to
every worker's ``/render`` (vLLM's contract: ``backend/preprocess.rs`` in vllm-router 0.1.17) and compares the
token ids each returns with what it believes each worker holds. Without these routes the router falls back to the
least-loaded worker: a prefix-aware policy that knows no prefix. llama-server has no such route (it has no router
of its kind); its ``/tokenize`` takes text, not a chat.
"""

from __future__ import annotations

from fastapi import APIRouter

from llmkit.server.dialects.openai_chat import ChatCompletionRequest
from llmkit.server.dialects.responses import ResponsesRequest
from llmkit.server.errors import off_loop
from llmkit.server.generation import chat_prompt
from llmkit.server.state import State

router = APIRouter()


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, state: State) -> dict:
    """The token ids the chat route would prefill for this request (vLLM's render_chat_completion)."""
    prompt, _ = await off_loop(chat_prompt, state.engine.model, body)
    return {"token_ids": prompt}


@router.post("/v1/responses/render")
async def render_response(body: ResponsesRequest, state: State) -> dict:
    """The token ids the Responses route would prefill (through the chat request it becomes)."""
    prompt, _ = await off_loop(chat_prompt, state.engine.model, await off_loop(body.to_chat))
    return {"token_ids": prompt}
