"""Anthropic's Messages API (~ llama-server's post_anthropic_messages and handle_count_tokens,
server_chat_convert_anthropic_to_oai in server-chat.cpp, the to_json_anthropic* of server-task.cpp).

    POST /v1/messages                  a message, whole or streamed (named SSE events)
    POST /v1/messages/count_tokens     {"input_tokens": N}: the prompt the same request would read

A request becomes a chat request (``CountTokensRequest.to_chat``) and runs through the same
``generation.chat`` as OpenAI's; ``MessagesFormatter`` writes the answer in Anthropic's shape:

    {"id": "msg_...", "type": "message", "role": "assistant", "model": "...",
     "content": [{"type": "text", "text": "..."}, {"type": "tool_use", "id": "toolu_...", "name": "...", "input": {...}}],
     "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use", "stop_sequence": null,
     "usage": {"input_tokens": N, "cache_read_input_tokens": N, "cache_creation_input_tokens": 0, "output_tokens": N}}

(``input_tokens`` counts the prompt tokens not read from the cache, as Anthropic and llama-server
do), and a stream as events named after their ``type``:

    message_start        the message, with no content yet, and its input usage; then a ping
    content_block_start  {"index": 0, "content_block": {"type": "text", "text": ""}}
    content_block_delta  {"index": 0, "delta": {"type": "text_delta", "text": "Hel"}}         per piece of text
    content_block_stop   {"index": 0}
                         (a tool_use block: its start with the name, input_json_delta pieces, its stop)
    message_delta        {"delta": {"stop_reason": ..., "stop_sequence": ...}, "usage": {"output_tokens": N}}
    message_stop

Errors on these routes come in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(the router declares ``errors.ANTHROPIC``). The fields chat has under the same name (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``stream``, and llmkit's ``priority``, which Anthropic's SDK
sends with ``extra_body``) are carried to the chat request as they are; the rest are converted
(``CONVERTED``). Differences from Anthropic's API, each said where it is decided:
``max_tokens`` is required (as Anthropic; llama-server puts 4096 in its place), ``messages`` may be
empty (as llama-server), images and documents are a 400 (the model reads text only; llama-server
answers 500), ``thinking`` is accepted and does nothing (the model does not reason first), and a
``tool_result`` marked as an error reaches the model as ``Error: <its text>``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Field, model_validator

from llmkit.engine import End, Outcome, Piece
from llmkit.engine import Request as EngineRequest
from llmkit.server import sse
from llmkit.server.dialects.blocks import Blocks
from llmkit.server.errors import ANTHROPIC, ApiError, off_loop
from llmkit.server.generation import chat, chat_prompt
from llmkit.server.protocol import ApiModel, ChatRequest, NPredict, Probability, as_chat, carried
from llmkit.server.state import State
from llmkit.server.tools import Delta

router = APIRouter(dependencies=[Depends(ANTHROPIC)])

MEDIA = "image input is not supported: this model reads text only"  # llama-server's words, then why


class TextBlock(ApiModel):
    type: Literal["text"]
    text: str


class MediaBlock(ApiModel):
    """An image or a document: refused, the model reads text only."""

    type: Literal["image", "document"]


class ToolUseBlock(ApiModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict = Field(default_factory=dict)


class ToolResultBlock(ApiModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            text = self.content
        elif any(isinstance(b, MediaBlock) for b in self.content):
            raise ValueError(MEDIA)
        else:
            text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(ApiModel):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""


Block = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(ApiModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def to_chat(self) -> list[dict]:
        """This turn as chat messages: its text, calls and thinking in one, then one ``tool`` message per
        result (llama-server's order)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text, calls, results, thinking = "", [], [], ""
        for block in self.content:
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, MediaBlock):
                raise ValueError(MEDIA)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            else:
                thinking += block.thinking
        turn: list[dict] = []
        if text or calls or thinking:
            turn.append({"role": self.role, "content": text} | ({"tool_calls": calls} if calls else {}))
            if thinking:
                turn[0]["reasoning_content"] = thinking
        return turn + results


class AnthropicTool(ApiModel):
    name: str
    description: str = ""
    input_schema: dict = Field(default_factory=dict)
    type: Literal["custom"] = "custom"

    @model_validator(mode="before")
    @classmethod
    def _a_client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "custom") != "custom":
            raise ValueError(f"only client tools run on this server, not {data['type']!r} (Anthropic's server tools run at Anthropic)")
        return data


class AnthropicToolChoice(ApiModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None  # None: as the chat template can

    def to_chat(self) -> str | dict:
        if self.type == "tool":
            if self.name is None:
                raise ValueError("'tool_choice': a choice of type 'tool' needs the tool's 'name'")
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


# the body's fields that become another of the chat request's (the rest are chat's own, carried as they are)
CONVERTED = frozenset({"messages", "system", "tools", "tool_choice", "stop_sequences", "output_config"})
IGNORED = frozenset({"thinking", "metadata"})  # accepted, and they change nothing here
# the chat request's fields -> the client's, where they differ
CHAT_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "parallel_tool_calls": "tool_choice"}


class CountTokensRequest(ApiModel):
    """What a prompt is made of: the conversation, the system prompt, the tools."""

    model: str | None = None  # accepted and ignored: the server has one model
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] = Field(default_factory=list)
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict | None = None  # accepted, does nothing: the model does not think before it answers

    def to_chat(self, **fields: Any) -> ChatRequest:
        """The same request as a chat request (llama-server: server_chat_convert_anthropic_to_oai)."""
        messages = [] if self.system is None else [{"role": "system", "content": self.system_text()}]
        messages += [m for message in self.messages for m in message.to_chat()]
        body = carried(self, CONVERTED) | {
            "messages": messages,
            "tools": [
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools
            ],
            **fields,
        }
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.to_chat()
            if self.tool_choice.disable_parallel_tool_use is not None:
                body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return as_chat(body, CHAT_NAMES)

    def system_text(self) -> str:
        return self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])


class JsonFormat(ApiModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(ApiModel):
    format: JsonFormat | None = None  # structured output: answer in this JSON Schema
    effort: str | None = None  # accepted, does nothing


class MessagesRequest(CountTokensRequest):
    max_tokens: NPredict  # required, as in Anthropic's API
    stop_sequences: list[str] = Field(default_factory=list)
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict | None = None  # accepted; {"user_id": ...} changes nothing here
    output_config: OutputConfig | None = None
    stream: bool = False
    priority: int | None = None  # llmkit's (vLLM's field; Anthropic's SDK: extra_body): lower goes first under --scheduling-policy priority

    def to_chat(self, **fields: Any) -> ChatRequest:
        settings: dict[str, Any] = {"stop": self.stop_sequences}
        if self.output_config is not None and self.output_config.format is not None:
            settings["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": self.output_config.format.schema_},
            }
        return super().to_chat(**settings, **fields)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, http_request: Request, state: State) -> Any:
    """llama-server's post_anthropic_messages: convert, then the chat path, then Anthropic's shape."""
    request = await off_loop(body.to_chat)
    return await chat(http_request, state, request, MessagesFormatter(state.model_name))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State) -> dict:
    """The prompt's length in tokens, tools and system prompt included (llama-server: handle_count_tokens)."""
    prompt, _ = await off_loop(chat_prompt, state.engine.model, await off_loop(body.to_chat))
    return {"input_tokens": len(prompt)}


# --- the answer ------------------------------------------------------------------------


STOP_REASON = {End.EOS: "end_turn", End.WORD: "stop_sequence", End.LIMIT: "max_tokens", End.CANCELLED: "end_turn"}  # Anthropic's


def stop_reason(outcome: Outcome, calls: int) -> str:
    """Anthropic's ``stop_reason``: ``tool_use`` when the answer ended with calls (and not at the token limit)."""
    return "tool_use" if calls and outcome.end is not End.LIMIT else STOP_REASON[outcome.end]


def usage(n_prompt: int, n_cached: int, n_output: int) -> dict:
    return {
        "input_tokens": n_prompt - n_cached,
        "cache_read_input_tokens": n_cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": n_output,
    }


@dataclass
class MessagesFormatter:
    """The JSON objects of one Messages answer (llama-server: the to_json_anthropic of its final and partial results).
    A stream's content blocks are its typed blocks (``Blocks``): ``text``, or a ``tool_use``."""

    model: str
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    done = None
    frame = staticmethod(sse.named_event)
    blocks: Blocks = field(init=False, repr=False)  # the stream's typed blocks, whose events this writes

    def __post_init__(self) -> None:
        self.blocks = Blocks(self)

    def message(self, content: list[dict], usage: dict, reason: str | None = None, stop_sequence: str = "") -> dict:
        """The message; with no ``reason`` yet, as a stream's ``message_start`` has it (nothing written)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence or None,
            "usage": usage,
        }

    def response(self, outcome: Outcome, pieces: list[Piece], answer: sse.Answer) -> dict:
        content: list[dict] = [{"type": "text", "text": answer.content}] if answer.content else []
        content += [{"type": "tool_use", "id": f"toolu_{c.id}", "name": c.name, "input": c.parsed_arguments()} for c in answer.calls]
        counts = usage(outcome.n_prompt, outcome.n_cached, outcome.n_output)
        return self.message(content, counts, stop_reason(outcome, len(answer.calls)), outcome.stopping_word)

    def opening(self, request: EngineRequest) -> list[dict]:
        counts = usage(len(request.prompt), request.n_cached, 0)
        return [{"type": "message_start", "message": self.message([], counts)}, {"type": "ping"}]

    def chunk(self, request: EngineRequest, piece: Piece, deltas: list[Delta]) -> list[dict]:
        return self.blocks.push(deltas)

    def started(self, index: int, delta: Delta) -> list[dict]:
        text = delta.index < 0
        block = {"type": "text", "text": ""} if text else {"type": "tool_use", "id": f"toolu_{delta.id}", "name": delta.name, "input": {}}
        return [{"type": "content_block_start", "index": index, "content_block": block}]

    def wrote(self, index: int, delta: Delta) -> list[dict]:
        text = delta.index < 0
        written = {"type": "text_delta", "text": delta.content} if text else {"type": "input_json_delta", "partial_json": delta.arguments}
        return [{"type": "content_block_delta", "index": index, "delta": written}]

    def stopped(self, index: int, written: str, status: str) -> list[dict]:
        return [{"type": "content_block_stop", "index": index}]

    def closing(self, outcome: Outcome, answer: sse.Answer) -> list[dict]:
        reason = stop_reason(outcome, len(answer.calls))
        delta = {"stop_reason": reason, "stop_sequence": outcome.stopping_word or None}
        return [
            *self.blocks.close(reason),
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": outcome.n_output}},
            {"type": "message_stop"},
        ]

    def error(self, exc: ApiError) -> list[dict]:
        return [ANTHROPIC.body(exc)]
