"""OpenAI's Responses API (~ llama-server's post_responses_oai and handle_count_tokens,
server_chat_convert_responses_to_chatcmpl in server-chat.cpp, the to_json_oaicompat_resp* of server-task.cpp).

    POST /v1/responses, /responses                             a response, whole or streamed (named SSE events)
    POST /v1/responses/input_tokens, /responses/input_tokens   {"object": "response.input_tokens", "input_tokens": N}

A request becomes a chat request (``ResponsesRequest.to_chat``): ``instructions`` a system
message, ``input`` the conversation (a string, or items: messages, ``function_call`` s and their
``function_call_output`` s), ``max_output_tokens`` the budget, ``text.format`` a JSON Schema to
answer in; then it runs through the same ``generation.chat`` as OpenAI chat's. ``ResponsesFormatter``
writes the answer as a Response: typed output items (a ``message`` with ``output_text`` parts,
a ``function_call`` per call), ``status`` (``incomplete`` with ``incomplete_details`` when
``max_output_tokens`` cut it), usage with cached tokens. A stream is events named after their
``type``, each with a ``sequence_number``:

    response.created, response.in_progress                       the response, empty
    response.output_item.added      {"output_index": 0, "item": {"type": "message", ...}}
    response.content_part.added     {"item_id", "output_index", "content_index": 0, "part": {"type": "output_text", ...}}
    response.output_text.delta      {"item_id", "output_index", "content_index", "delta": "Hel"}   per piece of text
    response.output_text.done, response.content_part.done, response.output_item.done
    (a function_call item: added with its name, function_call_arguments.delta pieces, .done, output_item.done)
    response.completed | response.incomplete                       the whole response, usage included

Stateless: nothing is stored, so ``previous_response_id`` is a 400 that says to send the
whole conversation in ``input`` (llama-server refuses it too), and ``store`` changes nothing
(a Response says ``"store": false``). Only function tools run here; any other tool type is a 400.
Every field of chat's that the body gives (llama-server's extras: ``stop``, ``seed``, ``priority``
...) is carried to the chat request as it is, as llama-server's converter copies every field;
errors come in OpenAI's shape (the router's ``LLAMA_SERVER``).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Discriminator, Field, Tag, model_validator

from llmkit.engine import End, Outcome, Piece
from llmkit.engine import Request as EngineRequest
from llmkit.server import sse
from llmkit.server.dialects.blocks import Blocks
from llmkit.server.errors import LLAMA_SERVER, ApiError, off_loop
from llmkit.server.generation import chat, chat_prompt
from llmkit.server.protocol import ApiModel, ChatRequest, GenerationRequest, NPredict, as_chat, carried
from llmkit.server.state import State
from llmkit.server.tools import Delta, renders_tools

router = APIRouter(dependencies=[Depends(LLAMA_SERVER)])

MEDIA = "only text input is supported: this model reads text only"


class InputText(ApiModel):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(ApiModel):
    type: Literal["refusal"]
    refusal: str


class InputMedia(ApiModel):
    """An image, a file or audio: refused, the model reads text only."""

    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[InputText | Refusal | InputMedia, Field(discriminator="type")]


def parts_text(content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    if any(isinstance(p, InputMedia) for p in content):
        raise ValueError(MEDIA)
    return "".join(p.text if isinstance(p, InputText) else p.refusal for p in content)  # type: ignore[union-attr]  # no media left


class MessageItem(ApiModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(ApiModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(ApiModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(ApiModel):
    """A reasoning model's item, sent back with the conversation: kept out of the prompt."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"  # an input message may leave out its type


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(ApiModel):
    type: Literal["function"]
    name: str
    description: str = ""
    parameters: dict = Field(default_factory=dict)
    strict: bool = True

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"only function tools run on this server, not {data.get('type')!r} (OpenAI's hosted tools run at OpenAI)")
        return data


class FunctionChoice(ApiModel):
    """``{"type": "function", "name": ...}``: call this tool (chat's ``NamedToolChoice``, flat)."""

    type: Literal["function"]
    name: str


class TextFormat(ApiModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name", "schema", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool = False

    def to_chat(self) -> dict:
        """As chat's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "json_schema": {"name": self.name or "response", "schema": self.schema_ or {}, "strict": self.strict},
        }


class TextConfig(ApiModel):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({"type": "text"}))


# the body's fields that become another of the chat request's (the rest are chat's own, carried as they are)
CONVERTED = frozenset({"input", "instructions", "tools", "tool_choice", "text", "max_output_tokens"})
IGNORED = frozenset({"store", "metadata", "previous_response_id", "conversation"})  # accepted (the last two refused)
CHAT_NAMES = {"messages": "input", "response_format": "text.format"}  # the chat request's fields -> the client's, where they differ


class InputRequest(GenerationRequest):
    """What a prompt is made of (``/input_tokens`` reads only this), and llama-server's extra fields."""

    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # None: as the chat template can
    text: TextConfig = TextConfig()
    previous_response_id: str | None = None
    conversation: str | dict | None = None

    def to_chat(self, **fields: Any) -> ChatRequest:
        """The same request as a chat request (llama-server: server_chat_convert_responses_to_chatcmpl)."""
        if self.previous_response_id is not None or self.conversation is not None:
            raise ValueError(
                "this server stores no responses: send the whole conversation in 'input' (not 'previous_response_id' or 'conversation')"
            )
        body = carried(self, CONVERTED) | {
            "messages": self.chat_messages(),
            "tools": [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})} for t in self.tools],
            **fields,
        }
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        if self.text.format.type != "text":
            body["response_format"] = self.text.format.to_chat()
        return as_chat(body, CHAT_NAMES)

    def chat_messages(self) -> list[dict]:
        """``instructions`` and ``input`` as chat messages; a call joins the assistant message before it."""
        messages: list[dict[str, Any]] = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if isinstance(item, MessageItem):
                text = parts_text(item.content)
                if item.role == "assistant" and last is not None and "tool_calls" not in last:
                    last["content"] += text
                else:
                    messages.append({"role": item.role, "content": text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if last is not None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output)})
        return messages


class ResponsesRequest(InputRequest):
    max_output_tokens: NPredict | None = None
    store: bool = False  # accepted; nothing is stored
    metadata: dict[str, str] = Field(default_factory=dict)

    def to_chat(self, **fields: Any) -> ChatRequest:
        budget = {} if self.max_output_tokens is None else {"max_tokens": self.max_output_tokens}
        return super().to_chat(**budget, **fields)


@router.post("/v1/responses")
@router.post("/responses")
async def responses(body: ResponsesRequest, http_request: Request, state: State) -> Any:
    """llama-server's post_responses_oai: convert, then the chat path, then a Response."""
    request = await off_loop(body.to_chat)
    return await chat(http_request, state, request, ResponsesFormatter(state.model_name, echo(body, state.engine.model.chat_template)))


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")
async def input_tokens(body: InputRequest, state: State) -> dict:
    """The prompt's length in tokens, instructions and tools included (llama-server: handle_count_tokens)."""
    prompt, _ = await off_loop(chat_prompt, state.engine.model, await off_loop(body.to_chat))
    return {"object": "response.input_tokens", "input_tokens": len(prompt)}


def echo(body: ResponsesRequest, template: str) -> dict:
    """The request's settings that a Response repeats (``parallel_tool_calls``: as it applies, see ``ChatRequest.tool_calling``)."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": renders_tools(template) if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": body.text.format.model_dump(exclude_unset=True, by_alias=True) or {"type": "text"}},
        "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice or "auto",
        "tools": [t.model_dump() for t in body.tools],
        "metadata": body.metadata,
    }


# --- the answer ------------------------------------------------------------------------


STATUS = {End.EOS: "completed", End.WORD: "completed", End.LIMIT: "incomplete", End.CANCELLED: "cancelled"}  # how a Response ends


def usage(outcome: Outcome) -> dict:
    return {
        "input_tokens": outcome.n_prompt,
        "input_tokens_details": {"cached_tokens": outcome.n_cached},
        "output_tokens": outcome.n_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.n_prompt + outcome.n_output,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def part(text: str) -> dict:
    """A message item's text part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class ResponsesFormatter:
    """The JSON objects of one Response (llama-server: to_json_oaicompat_resp and its stream). A stream's output
    items are its typed blocks (``Blocks``): a ``message`` with one ``output_text`` part, or a ``function_call``."""

    model: str
    echo: dict  # the request's settings, as ``echo`` picks them
    id: str = field(default_factory=lambda: new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))
    items: list[dict] = field(default_factory=list)  # the output items so far (a stream's, in order)
    sequence_number: int = 0
    done = None
    frame = staticmethod(sse.named_event)
    blocks: Blocks = field(init=False, repr=False)  # the stream's typed blocks, whose events this writes

    def __post_init__(self) -> None:
        self.blocks = Blocks(self)

    def response(self, outcome: Outcome, pieces: list[Piece], answer: sse.Answer) -> dict:
        status = STATUS[outcome.end]
        output = [self.message_item(answer.content, status)] if answer.content else []
        output += [self.call_item(c.id, c.name, c.arguments, status) for c in answer.calls]
        return self.whole(status, output, outcome)

    def whole(self, status: str, output: list[dict], outcome: Outcome | None) -> dict:
        """The Response object (OpenAI's fields, in its order)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            **({"completed_at": int(time.time())} if status == "completed" else {}),
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "truncation": "disabled",
            "usage": usage(outcome) if outcome is not None else None,
            "user": None,
            **self.echo,
        }

    @staticmethod
    def message_item(text: str, status: str) -> dict:
        return {"id": new_id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part(text)]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {
            "id": f"fc_{call_id}",
            "type": "function_call",
            "status": status,
            "call_id": f"call_{call_id}",
            "name": name,
            "arguments": arguments,
        }

    # stream

    def event(self, kind: str, **data: Any) -> dict:
        self.sequence_number += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence_number - 1, **data}

    def opening(self, request: EngineRequest) -> list[dict]:
        empty = self.whole("in_progress", [], None)
        return [self.event("created", response=empty), self.event("in_progress", response=empty)]

    def chunk(self, request: EngineRequest, piece: Piece, deltas: list[Delta]) -> list[dict]:
        return self.blocks.push(deltas)

    def where(self, index: int) -> dict:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def started(self, index: int, delta: Delta) -> list[dict]:
        """An output item added (a message's with its empty text part)."""
        text = delta.index < 0
        item = self.message_item("", "in_progress") if text else self.call_item(delta.id, delta.name, "", "in_progress")
        self.items.append(item)
        events = [self.event("output_item.added", output_index=index, item=dict(item, content=[]) if text else dict(item))]
        if text:
            events.append(self.event("content_part.added", **self.where(index), content_index=0, part=part("")))
        return events

    def wrote(self, index: int, delta: Delta) -> list[dict]:
        if delta.index < 0:
            return [self.event("output_text.delta", **self.where(index), content_index=0, delta=delta.content, logprobs=[])]
        return [self.event("function_call_arguments.delta", **self.where(index), delta=delta.arguments)]

    def stopped(self, index: int, written: str, status: str) -> list[dict]:
        """The item's ``.done`` events (its text or arguments whole), then ``output_item.done``."""
        item, where = self.items[index], self.where(index)
        if item["type"] == "message":
            item["content"][0]["text"] = written
            events = [
                self.event("output_text.done", **where, content_index=0, text=written, logprobs=[]),
                self.event("content_part.done", **where, content_index=0, part=part(written)),
            ]
        else:
            item["arguments"] = written
            events = [self.event("function_call_arguments.done", **where, name=item["name"], arguments=written)]
        item["status"] = status
        return [*events, self.event("output_item.done", output_index=index, item=item)]

    def closing(self, outcome: Outcome, answer: sse.Answer) -> list[dict]:
        status = STATUS[outcome.end]
        events = self.blocks.close(status)
        # llama-server's extra: the timings, beside the response (as on a chat stream's last chunk)
        return [*events, self.event(status, response=self.whole(status, self.items, outcome), timings=outcome.timings.to_dict())]

    def error(self, exc: ApiError) -> list[dict]:
        failed = self.whole("failed", self.items, None) | {"error": {"code": exc.type, "message": str(exc)}}
        return [self.event("failed", response=failed)]
