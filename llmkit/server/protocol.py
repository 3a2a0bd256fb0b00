"""Request bodies as pydantic models, and their mapping to the engine's RequestParams.

(~ llama-server's server-schema.cpp: a declarative table of request fields
with types, limits and aliases.) Fields are strict (``"0.5"`` is not a
number, ``1`` is not a boolean), unknown fields are ignored as OpenAI does,
and a ``null`` field counts as absent. A field that fails validation
becomes a 400 naming it (``errors.describe_validation_errors``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from llmkit.engine import RequestParams
from llmkit.grammar import Constraint, Gbnf, Schema
from llmkit.llama import Grammar
from llmkit.server.errors import ApiError
from llmkit.server.tools import Tool, ToolCalling, renders_tools


def _n_predict(n: int) -> int:
    # 0 is refused: llama-server reads it as "only evaluate the prompt", which the engine does not do
    # (it would generate without limit, as it checks the budget only after appending a token).
    if n == 0 or n < -1:
        raise ValueError("should be -1 (no limit) or a positive number of tokens")
    return n


Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
NPredict = Annotated[int, AfterValidator(_n_predict)]


class ApiModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


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
    """The fields chat and text completions share: OpenAI's, then llama-server's."""

    model: str | None = None  # accepted and ignored: the server has one model
    max_tokens: NPredict | None = None
    max_completion_tokens: NPredict | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Probability | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # llama-server's extras
    n_predict: NPredict | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Probability | None = None
    repeat_penalty: Annotated[float, Field(ge=0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=0)] | None = None
    cache_prompt: bool = True
    id_slot: Annotated[int, Field(ge=-1)] = -1
    ignore_eos: bool = False
    n_probs: Annotated[int, Field(ge=0, le=20)] = 0
    n_keep: Annotated[int, Field(ge=-1)] = 0  # context shift keeps this many prompt tokens (-1: all)
    n_cache_reuse: Annotated[int, Field(ge=0)] | None = None  # None: the server's --cache-reuse
    # speculation: at most this many draft tokens a step (None: the server's; 0: off). Older llama-servers read
    # this field; the pinned one sets speculation per server only
    speculative_n_max: Annotated[int, Field(ge=0)] | None = Field(None, alias="speculative.n_max")
    grammar: str | None = None
    json_schema: dict | None = None
    sse_ping_interval: int | None = None  # seconds of silence before a ping, this stream only (None: the server's)
    priority: int | None = None  # llmkit's (vLLM's field): lower goes first under --scheduling-policy priority
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: disaggregated prefill and decode (llmkit.server.handoff)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def n_top_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs at all."""
        return self.n_probs or None


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


class ChatRequest(GenerationRequest):
    """A chat request, as every chat API becomes one (``responses`` and ``messages`` convert theirs to it)."""

    messages: list[Message]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0
    tools: list[ChatTool] = []
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # None: as the chat template can (llama-server: its caps)

    @model_validator(mode="after")
    def _not_two_assistant_messages_at_the_end(self) -> ChatRequest:
        if len(self.messages) >= 2 and self.messages[-1].role == self.messages[-2].role == "assistant":
            raise ValueError("Cannot have 2 or more assistant messages at the end of the list.")  # llama-server's words
        return self

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


class ChatCompletionRequest(ChatRequest):
    """OpenAI's Chat Completions request: at least one message (llama-server's Messages route takes none)."""

    messages: Annotated[list[Message], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    # a string, or (OpenAI) a token list, or a list holding one of those: n = 1 prompt only
    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def n_top_logprobs(self) -> int | None:
        return self.logprobs if self.logprobs is not None else super().n_top_logprobs()

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p  # type: ignore[return-value]  # mypy cannot narrow p[0]


def _is_token(x: Any) -> bool:
    return type(x) is int  # a JSON integer (not a boolean, not 1.0)


def _is_single_prompt(p: Any) -> bool:
    """A string, token ids, or strings and token ids mixed (at least one id: a list of strings is several prompts)."""
    if isinstance(p, str):
        return True
    return isinstance(p, list) and all(_is_token(x) or isinstance(x, str) for x in p) and (not p or any(map(_is_token, p)))


MAX_PROMPTS = 64  # prompts in one native request (each is a request to the engine)


def _native_prompts(p: Any) -> list[str | list[int | str]]:
    """The prompts as llama-server's ``tokenize_input_prompts`` reads them (server-common.cpp).

    A prompt is a string, a list of token ids, a list mixing strings and token ids, or
    ``{"prompt_string": ...}``; a list of those is several prompts, answered with one
    completion each (``index`` says which).
    """
    prompts = p if isinstance(p, list) and p and not any(map(_is_token, p)) else [p]  # a list of prompts, or one
    if isinstance(p, list) and not p:
        raise ValueError("must not be empty")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, not {len(prompts)}")
    return [_native_prompt(one) for one in prompts]


def _native_prompt(p: Any) -> str | list[int | str]:
    if isinstance(p, dict) and "prompt_string" in p:
        if "multimodal_data" in p:
            raise ValueError("'multimodal_data' is not supported: the model reads text only")
        p = p["prompt_string"]
    if not _is_single_prompt(p):
        raise ValueError('should be a string, a list of token ids, a list of strings and token ids, or {"prompt_string": ...}')
    return p


class NativeCompletionRequest(GenerationRequest):
    """llama-server's own ``POST /completion`` (post_completions): its prompt shapes, and ``return_tokens``."""

    prompt: Annotated[Any, AfterValidator(_native_prompts)]  # one or more prompts (a list after validation)
    return_tokens: bool = False


class EmbeddingRequest(ApiModel):
    input: str | Annotated[list[str], Field(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class NativeEmbeddingRequest(EmbeddingRequest):
    """llama-server's own ``/embedding``: the text in ``input`` or ``content``."""

    input: str | Annotated[list[str], Field(min_length=1)] | None = None  # type: ignore[assignment]  # or in content
    content: str | Annotated[list[str], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _input_or_content(self) -> NativeEmbeddingRequest:
        if self.input is None:
            if self.content is None:
                raise ValueError('"input" or "content" must be provided')
            self.input = self.content
        return self


class TokenizeRequest(ApiModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(ApiModel):
    tokens: list[int]


# --- request -> engine ---------------------------------------------------------


def constraint_of(body: GenerationRequest) -> Constraint | None:
    """Which constraint the request carries (``response_format``, ``json_schema`` or ``grammar``), if any.

    As llama-server (server-common.cpp, server-schema.cpp): a JSON ``response_format``
    or the top-level ``json_schema`` gives a schema, ``grammar`` GBNF as it is. An empty
    schema means any JSON object; an empty ``grammar`` counts as absent. Two constraints
    at once, or one with ``ignore_eos``, are a ValueError (a 400). Only resolved here:
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
    if body.ignore_eos:
        raise ValueError(
            "'ignore_eos' cannot be used with a grammar or a schema: once the output is complete, the end is the only token left"
        )
    return Gbnf(gbnf) if gbnf is not None else Schema(schema, strict, field)  # type: ignore[arg-type]  # one of them is set


def params_from_body(
    body: GenerationRequest, defaults: RequestParams, grammar: Grammar | None = None, grammar_trigger: str | None = None
) -> RequestParams:
    """Map a request onto the server's defaults (``--temp``, ``--seed``, ``-n``): only given fields change
    (llama-server: eval_llama_cmpl_schema).

    ``grammar``: the request's constraint, compiled (``constraint_of`` says which, ``grammar.compile`` makes it);
    ``grammar_trigger``: the word that starts it, for a lazy grammar (a tool call the model may make).
    """
    sampling: dict[str, Any] = {
        "temperature": body.temperature,
        "top_k": body.top_k,
        "top_p": body.top_p,
        "min_p": body.min_p,
        "seed": body.seed,
        "repeat_penalty": body.repeat_penalty,
        "repeat_last_n": body.repeat_last_n,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "ignore_eos": body.ignore_eos,
        "grammar": grammar,
        "grammar_trigger": grammar_trigger,
    }
    n_top = body.n_top_logprobs()
    own: dict[str, Any] = {
        "max_tokens": next((n for n in (body.n_predict, body.max_completion_tokens, body.max_tokens) if n is not None), None),
        "stop": (body.stop,) if isinstance(body.stop, str) else None if body.stop is None else tuple(body.stop),
        "cache_prompt": body.cache_prompt,
        "id_slot": None if body.id_slot < 0 else body.id_slot,
        "n_probs": 0 if n_top is None else max(n_top, 1),  # the engine computes logprobs only when n_probs > 0
        "n_keep": body.n_keep,
        "n_cache_reuse": body.n_cache_reuse,
        "n_draft_max": body.speculative_n_max,
        "priority": body.priority,
        "sampling": dataclasses.replace(defaults.sampling, **{k: v for k, v in sampling.items() if v is not None}),
    }
    return dataclasses.replace(defaults, **{k: v for k, v in own.items() if v is not None or k == "id_slot"})


def check_tokens(tokens: list[int], n_vocab: int, field: str) -> list[int]:
    """Token ids from a client must exist: llama.cpp would fail the whole batch on a bad one."""
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"'{field}': token {bad} is not in the vocabulary (0..{n_vocab - 1})")
    return tokens
