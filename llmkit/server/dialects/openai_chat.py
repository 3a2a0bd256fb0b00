"""OpenAI's Chat Completions (~ llama-server's post_chat_completions, server-task.cpp ``to_json_oaicompat_chat*``).

    POST /v1/chat/completions, /chat/completions    a chat answer, whole or streamed (SSE), tools included

The body is the chat request every chat dialect becomes (``protocol.ChatRequest``), with at least one
message; ``generation.chat`` runs it; ``ChatFormatter`` writes the answer (``openai.OpenAIFormatter``'s
envelope): a ``message`` with its content and ``tool_calls``, or a stream of deltas that opens with the
assistant's role.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from llmkit.engine import Request as EngineRequest
from llmkit.server.dialects.openai import OpenAIFormatter, openai_formatter
from llmkit.server.errors import LLAMA_SERVER
from llmkit.server.generation import chat
from llmkit.server.protocol import ChatRequest, Messages
from llmkit.server.sse import Answer
from llmkit.server.state import State
from llmkit.server.tools import Delta, ToolCall

router = APIRouter(dependencies=[Depends(LLAMA_SERVER)])


class ChatCompletionRequest(ChatRequest):
    """OpenAI's Chat Completions request: at least one message (llama-server's Messages route takes none)."""

    messages: Annotated[Messages, Field(min_length=1)]


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: Request, state: State) -> Any:
    return await chat(http_request, state, body, openai_formatter(ChatFormatter, state, body))


class ChatFormatter(OpenAIFormatter):
    """The JSON objects of one chat answer (llama-server: ``to_json_oaicompat_chat``, ``_chat_stream``)."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT, END = "chatcmpl-", "chat.completion", "chat.completion.chunk", {"delta": {}}

    def body(self, answer: Answer) -> dict:
        return {"message": self.message(answer)}

    @staticmethod
    def tool_call(call: ToolCall) -> dict:
        return {"id": f"call_{call.id}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}

    def message(self, answer: Answer) -> dict:
        """The assistant's message: its text (null when it only calls tools), its tool calls."""
        message: dict[str, Any] = {"role": "assistant", "content": answer.content or (None if answer.calls else "")}
        if answer.calls:
            message["tool_calls"] = [self.tool_call(c) for c in answer.calls]
        return message

    def delta(self, d: Delta) -> dict:
        """One delta: ``{"content": ...}``, or a piece of ``tool_calls[i]`` (llama-server:
        server_chat_msg_diff_to_json_oaicompat)."""
        if d.index < 0:
            return {"delta": {"content": d.content}}
        call: dict[str, Any] = {"index": d.index}
        if d.name:
            call |= {"id": f"call_{d.id}", "type": "function", "function": {"name": d.name, "arguments": ""}}
        else:
            call["function"] = {"arguments": d.arguments}
        return {"delta": {"tool_calls": [call]}}

    def opening(self, request: EngineRequest) -> list[dict]:
        """A chat stream opens with the assistant's role (OpenAI's does; clients expect it)."""
        return [self._envelope([self._choice({"delta": {"role": "assistant", "content": None}})], chunk=True)]
