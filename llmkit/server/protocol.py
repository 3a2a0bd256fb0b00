"""What the generation dialects share: the request fields, the chat request every chat API becomes, and their mapping
onto the engine's ``RequestParams``.

(~ llama-server's server-schema.cpp: a declarative table of request fields with types, limits and aliases, and
``eval_llama_cmpl_schema``.) Fields are strict (``"0.5"`` is not a number, ``1`` is not a boolean), unknown fields
are ignored as OpenAI does, and a ``null`` field counts as absent. A field that fails validation becomes a 400
naming it (``errors.describe_validation_errors``).

The options come from one place, the engine's dataclasses: a body field named like a field of ``RequestParams``
or ``SamplingParams`` is read as it is, under that name (``BY_NAME``); the few that need a conversion (OpenAI's
other names, a constraint to compile) are listed in ``CONVERTED``, and the rest are the HTTP layer's own
(``HTTP_ONLY``). Each dialect's body (``dialects/``) holds its own fields; tests/test_options.py checks that every
field of every body is one of these, so a field cannot be accepted and then ignored without a word.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmkit.engine import RequestParams
from llmkit.grammar import Constraint, Gbnf, Schema
from llmkit.grammar.sampler import Grammar
from llmkit.sampling import SamplingParams
from llmkit.server.errors import ApiError, invalid
from llmkit.server.tools import Tool, ToolCalling, renders_tools
from llmkit.text import is_unicode

Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
# -1: no limit; 0: read the prompt into the slot's cache and generate nothing (as server-schema.cpp describes n_predict;
# the pinned llama-server samples one token first: tests/test_differential.py shows it)
NPredict = Annotated[int, Field(ge=-1)]

SAMPLING = frozenset(f.name for f in dataclasses.fields(SamplingParams))
ENGINE = frozenset(f.name for f in dataclasses.fields(RequestParams) if f.name != "sampling") | SAMPLING  # the engine's options
# body fields read through a conversion -> the engine's option they set (GenerationRequest.converted, constraint_of,
# ChatRequest.tool_calling)
CONVERTED = {
    "max_tokens": "max_tokens",  # OpenAI's name, beside ...
    "max_completion_tokens": "max_tokens",  # ... its newer one, and ...
    "n_predict": "max_tokens",  # ... llama-server's: the first one given
    "stop": "stop",  # a string or a list: a tuple
    "id_slot": "id_slot",  # -1: any slot (None)
    "n_probs": "n_probs",  # llama-server's, ...
    "logprobs": "n_probs",  # ... OpenAI chat's switch and text completions' count, ...
    "top_logprobs": "n_probs",  # ... and chat's count (n_top_logprobs)
    "response_format": "grammar",  # the constraints (constraint_of), compiled into the sampler's grammar
    "json_schema": "grammar",
    "grammar": "grammar",
    "tools": "grammar",  # the tool calls' grammar (ToolCalling.grammar) and its trigger
    "tool_choice": "grammar",
    "parallel_tool_calls": "grammar",
    "kv_transfer_params": "hand_off",  # vLLM's PD handshake: a prefill worker keeps its cells (llmkit.server.handoff)
    "logit_bias": "logit_bias",  # pairs or an object, a token id or a text each (logit_bias_of)
}
# the engine's options no body field sets: the tool grammar's trigger is made with it; the tenant is a header (X-Tenant)
NOT_FROM_BODY = frozenset({"grammar_trigger", "tenant"})
# body fields read as they are, under the engine's name (llama-server's)
BY_NAME = ENGINE - set(CONVERTED) - set(CONVERTED.values()) - NOT_FROM_BODY
# body fields the HTTP layer reads itself (or accepts and ignores, as said where they are declared)
HTTP_ONLY = frozenset({"model", "n", "stream_options", "sse_ping_interval", "messages", "prompt", "return_tokens", "response_fields"})


class ApiModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _representable(cls, value: Any) -> Any:
        """Every field, to its last list item and object key: what the model, the C library and the answer can hold."""
        representable(value)
        return value


INT64 = range(-(2**63), 2**63)


def representable(value: Any) -> None:
    """Refuse (ValueError) an integer beyond 64 bits, which no C call takes, and a string holding a lone surrogate
    (JSON's ``"\\ud800"``), which is not UTF-8: the tokenizer, the grammar and the answer's own JSON could not write
    it (llama-server's JSON parser refuses both). A nested body model has checked its own fields."""
    pending = [value]
    while pending:  # a loop, not recursion: a JSON value nested as deep as the parser allows is read to its end
        item = pending.pop()
        if type(item) is int and item not in INT64:
            raise ValueError(f"{item} does not fit in a 64-bit integer")
        if isinstance(item, str) and not is_unicode(item):
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate)")
        if isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            pending += item


class StreamOptions(ApiModel):
    include_usage: bool = False


class JsonSchemaFormat(ApiModel):
    """OpenAI's ``response_format.json_schema``: the schema and its wrapper."""

    name: str | None = None  # OpenAI requires it; llama-server (and this server) do not read it
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool = False


class ResponseFormat(ApiModel):
    """``{"type": "text"}``, ``{"type": "json_object"[, "schema": {...}]}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    schema_: dict | None = Field(None, alias="schema")  # llama-server's json_object with a schema
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(ApiModel):
    """The fields every generation dialect shares: OpenAI's, then llama-server's (its names: ``RequestParams``')."""

    model: str | None = None  # accepted and ignored: the server has one model
    max_tokens: NPredict | None = None
    max_completion_tokens: NPredict | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Probability | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # one choice per request (strict: ``true`` is not 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # llama-server's extras
    n_predict: NPredict | None = None
    top_k: int | None = None  # 0 or less: no top-k sampler (llama.cpp's rule; vLLM's clients and SGLang's router send -1)
    min_p: Probability | None = None
    repeat_penalty: Annotated[float, Field(ge=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=0)] | None = None
    cache_prompt: bool = True
    id_slot: Annotated[int, Field(ge=-1)] = -1
    ignore_eos: bool = False
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0
    logit_bias: list | dict | None = None  # [[token or text, bias or false], ...] or {"token or text": bias}: logit_bias_of
    n_keep: Annotated[int, Field(ge=-1)] = 0  # context shift keeps this many prompt tokens (-1: all)
    n_cache_reuse: Annotated[int, Field(ge=0)] | None = None  # None: the server's --cache-reuse
    # speculation: at most this many draft tokens a step (None: the server's; 0: off). Older llama-servers read
    # this field; the pinned one sets speculation per server only
    n_draft_max: Annotated[int, Field(ge=0)] | None = Field(None, alias="speculative.n_max")
    grammar: str | None = None
    json_schema: dict | None = None
    sse_ping_interval: int | None = None  # seconds of silence before a ping, this stream only (None: the server's)
    priority: int | None = None  # llmkit's (vLLM's field): lower goes first under --scheduling-policy priority
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: disaggregated prefill and decode (llmkit.server.handoff)

    @field_validator("logit_bias")
    @classmethod
    def _readable_logit_bias(cls, raw: list | dict | None) -> list | dict | None:
        if raw is not None:
            logit_bias_of(raw)  # a ValueError says which entry it cannot read
        return raw

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def n_top_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs at all."""
        return self.n_probs or None

    def settings(self) -> dict[str, Any]:
        """The options this body gives, under the engine's names (only those given: the rest stay the server's)."""
        return {name: getattr(self, name) for name in self.model_fields_set & BY_NAME} | self.converted()

    def converted(self) -> dict[str, Any]:
        """The options read through a conversion (``CONVERTED``; the constraints are compiled apart), as given."""
        given = self.model_fields_set
        options: dict[str, Any] = {}
        if budget := [n for name in ("n_predict", "max_completion_tokens", "max_tokens") if (n := getattr(self, name)) is not None]:
            options["max_tokens"] = budget[0]
        if self.stop is not None:
            options["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if "id_slot" in given:
            options["id_slot"] = None if self.id_slot < 0 else self.id_slot
        if (n_top := self.n_top_logprobs()) is not None:
            options["n_probs"] = max(n_top, 1)  # the engine computes logprobs only when n_probs > 0
        if self.kv_transfer_params is not None:
            options["hand_off"] = bool(self.kv_transfer_params.get("do_remote_decode"))
        if self.logit_bias is not None:
            options["logit_bias"] = logit_bias_of(self.logit_bias)
        return options


class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class FunctionCall(ApiModel):
    name: str
    arguments: str | dict = "{}"  # OpenAI: JSON text; some clients send the object itself


class MessageToolCall(ApiModel):
    """A call the assistant made, in the history a client sends back."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = ""
    tool_calls: list[MessageToolCall] = []
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking, for a template that shows it (llama-server's field)

    def to_template(self) -> dict:
        """The dict a chat template reads (text parts joined, as llama-server does)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDef(ApiModel):
    name: str
    description: str = ""
    parameters: dict = {}
    strict: bool = False  # accepted; the arguments' grammar is the schema's, strict or not


class ChatTool(ApiModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    """``{"type": "function", "function": {"name": ...}}``: call this tool."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _not_two_assistant_messages_at_the_end(messages: list[Message]) -> list[Message]:
    if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
        raise ValueError("Cannot have 2 or more assistant messages at the end of the list.")  # llama-server's words
    return messages


Messages = Annotated[list[Message], AfterValidator(_not_two_assistant_messages_at_the_end)]


class ChatRequest(GenerationRequest):
    """A chat request, as every chat API becomes one (``responses`` and ``messages`` convert theirs to it: ``as_chat``)."""

    messages: Messages
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0
    tools: list[ChatTool] = []
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # None: as the chat template can (llama-server: its caps)

    def n_top_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else super().n_top_logprobs()

    def tool_calling(self, template: str) -> ToolCalling:
        """The request's tools and ``tool_choice``, checked (a ValueError says what is wrong), for a model whose
        chat template is ``template``. Parallel calls, unless asked for or not, as llama-server: if the template
        can write several (``supports_parallel_tool_calls``); a template with no tools in it cannot."""
        tools = [Tool(t.function.name, t.function.description, t.function.parameters) for t in self.tools]
        choice = self.tool_choice or ("auto" if tools else "none")
        native = renders_tools(template)
        parallel = native if self.parallel_tool_calls is None else self.parallel_tool_calls
        if isinstance(choice, NamedToolChoice):
            return ToolCalling(tools, "required", choice.function.name, parallel, native)
        return ToolCalling(tools, choice, None, parallel, native)


def carried(body: BaseModel, converted: frozenset[str]) -> dict[str, Any]:
    """The fields a dialect's body gives that the chat request has under the same name, as given (by their JSON
    names): a dialect converts only the rest (``converted``)."""
    names = body.model_fields_set & set(ChatRequest.model_fields) - converted
    return body.model_dump(include=names, by_alias=True)


def as_chat(body: dict[str, Any], names: Mapping[str, str]) -> ChatRequest:
    """A dialect's request converted to a chat request, validated as one. A failure is the client's 400 in the client's
    own words: ``names`` maps each chat field the dialect converts to the client's field it came from."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc, names) from None


# --- request -> engine ---------------------------------------------------------


def constraint_of(body: GenerationRequest) -> Constraint | None:
    """Which constraint the request carries (``response_format``, ``json_schema`` or ``grammar``), if any.

    As llama-server (server-common.cpp, server-schema.cpp): a JSON ``response_format``
    or the top-level ``json_schema`` gives a schema, ``grammar`` GBNF as it is. An empty
    schema means any JSON object; an empty ``grammar`` counts as absent. Two constraints
    at once are a ValueError (a 400). Only resolved here:
    ``grammar.compile`` converts and checks it.
    """
    schema, field, strict = body.json_schema, "json_schema", False
    gbnf = body.grammar or None
    if schema is not None and gbnf is not None:
        raise ValueError("Cannot use both 'json_schema' and 'grammar'")
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if gbnf is not None:
            raise ValueError(f"Cannot use both 'grammar' and 'response_format' of type {fmt.type!r}")
        if fmt.type == "json_object":  # its own schema if it has one, else the top-level one, else any object
            if fmt.schema_ is not None:
                if schema is not None:
                    raise ValueError("Cannot use both 'json_schema' and 'response_format.schema'")
                schema, field = fmt.schema_, "response_format.schema"
            elif schema is None:
                schema, field = {}, "response_format"
        else:
            if fmt.json_schema is None:
                raise ValueError("'response_format.json_schema' is required when 'response_format.type' is 'json_schema'")
            if schema is not None:
                raise ValueError("Cannot use both 'json_schema' and 'response_format.json_schema'")
            schema, field = fmt.json_schema.schema_ or {}, "response_format.json_schema.schema"
            strict = fmt.json_schema.strict
    if schema is None and gbnf is None:
        return None
    return Gbnf(gbnf) if gbnf is not None else Schema(schema, strict, field)  # type: ignore[arg-type]  # one of them is set


def logit_bias_of(raw: list | dict) -> tuple[tuple[int | str, float], ...]:
    """A request's ``logit_bias`` as (token id or text, bias) pairs, read as llama-server reads it (server-schema.cpp):
    pairs ``[token, bias]`` or an object ``{"token": bias}`` (OpenAI's form); a key that is not a token id is a text,
    whose every token gets the bias (the sampler tokenizes it); ``false`` bans (-inf). A token out of the vocabulary
    is skipped, as there (Sampler). What it cannot read is a ValueError that says which entry: llama-server skips it
    ("TODO: we may want to throw errors here"), so a typo would change nothing without a word."""
    pairs = raw.items() if isinstance(raw, dict) else raw
    out: list[tuple[int | str, float]] = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(f"entry {i} is not a pair [token id or text, bias]: {pair!r}")
        key, value = pair
        if isinstance(raw, dict) and key.strip().lstrip("+-").isdigit():
            key = int(key)  # an object's keys are strings: "15043" is a token id
        if not (type(key) is int or isinstance(key, str)):
            raise ValueError(f"entry {i}: {key!r} is neither a token id nor a text")
        out.append((key, _bias(value, i)))
    return tuple(out)


def _bias(value: Any, i: int) -> float:
    if value is False:
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"entry {i}: the bias must be a finite number, or false to ban the token, not {value!r}")
    return float(value)


def params_from_body(
    body: GenerationRequest, defaults: RequestParams, grammar: Grammar | None = None, grammar_trigger: str | None = None
) -> RequestParams:
    """Map a request onto the server's defaults (``--temp``, ``--seed``, ``-n``): only given fields change
    (llama-server: eval_llama_cmpl_schema).

    ``grammar``: the request's constraint, compiled (``constraint_of`` says which, ``grammar.compile`` makes it);
    ``grammar_trigger``: the word that starts it, for a lazy grammar (a tool call the model may make).
    """
    options = body.settings() | ({"grammar": grammar, "grammar_trigger": grammar_trigger} if grammar is not None else {})
    sampling = dataclasses.replace(defaults.sampling, **{k: v for k, v in options.items() if k in SAMPLING})
    return dataclasses.replace(defaults, **{k: v for k, v in options.items() if k not in SAMPLING}, sampling=sampling)


def check_tokens(tokens: list[int], n_vocab: int, field: str) -> list[int]:
    """Token ids from a client must exist: llama.cpp would fail the whole batch on a bad one."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"'{field}': token {bad} is not in the vocabulary (0..{n_vocab - 1})")
    return tokens
