"""Differential test: one table of requests, sent to llmkit's slot server and to the real llama-server.

Both run the same llama.cpp (llama-cpp-python's vendored copy; ``launch.serve("llama-server")``
builds it once, for the CPU features llama-cpp-python's library was compiled with, so that both run
the same kernels: ``test_llama_server_runs_the_same_cpu_kernels``) on the same model with the same
flags. Per request we compare the HTTP status, the JSON *shape* (keys and value types, recursively;
int and float are one "number"; a list is the set of its elements' shapes) and, for a stream, the
sequence of its events' shapes (runs of equal shapes counted once) and whether ``data: [DONE]`` ends
it; a stream of named events (``event:`` lines: the Responses and Messages APIs) by the sequence of
its names (runs counted once, aligned as ``difflib`` aligns lines) and each name's data shapes. Some
rows also compare values (``same``): greedy text, token counts, error types.

Every difference must be listed in ``INTENDED`` with its reason; a listed difference that
no longer occurs fails too, so the list stays true.

llama-server serves embeddings only when started with ``--embeddings`` ("restrict to only
support embedding use case", its --help), and then still generates, but in a mode meant for
embedding models; so the embedding rows go to a third llama-server, started with
``--embeddings --pooling mean`` (llmkit's pooling), and the generation rows never touch it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import difflib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmkit.course import launch, upstream
from llmkit.course.upstream import build
from llmkit.server import metrics

pytestmark = pytest.mark.timeout(1800)  # a first run builds llama-server (~13 min on 2 cores); then about 1 min

FLAGS = ("-np", "2", "-c", "4096", "-t", "1", "--temp", "0", "--seed", "1", "--metrics")
EMBEDDING_FLAGS = ("-np", "1", "-c", "2048", "-t", "1", "--embeddings", "--pooling", "mean")

HELLO = [{"role": "user", "content": "Say hello."}]
COUNT = "Count: 1, 2, 3, 4,"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
CHAT = {"messages": HELLO, "max_tokens": 8}
ERROR = ("error.code", "error.type")
JSON_ANSWER = ("choices[0].message.content", "choices[0].finish_reason")
SUM = "What is 2+2?"  # "The answer to this classic math problem is 4.", then the end, from both
ASK_SUM = [{"role": "user", "content": SUM}]
TEXT = "output[0].content[0].text"  # a Response's text
ITEMS = [{"role": "user", "content": "Hi!"},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello! How can I assist you today?"}]},
         {"role": "user", "content": [{"type": "input_text", "text": SUM}]}]  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
TOOL_ROUND_TRIP = [*ASK, {"role": "assistant", "content": [CALL]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 22 C"}]}]  # fmt: skip
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


# --- comparing ---------------------------------------------------------------------------


def shape(x: Any) -> Any:
    """The JSON value with every leaf replaced by its type; a list by its elements' distinct shapes."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        shapes = []
        for s in map(shape, x):
            if s not in shapes:
                shapes.append(s)
        return shapes
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    return "null" if x is None else "string"


ABSENT = "absent"


def diff(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two shapes differ, as ``"path: ours X, theirs Y"`` (a missing key or list item: ``absent``).

    A tuple is a sequence of names (a stream's events), aligned as ``difflib`` aligns lines: each
    run that differs is ``"path[i]: ours [...], theirs [...]"``, ``i`` its place in ours.
    """
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        runs = difflib.SequenceMatcher(None, ours, theirs, autojunk=False).get_opcodes()
        return [f"{path}[{i}]: ours {brief(ours[i:i2])}, theirs {brief(theirs[j:j2])}" for op, i, i2, j, j2 in runs if op != "equal"]
    if isinstance(ours, dict) and isinstance(theirs, dict):
        keys = [*ours, *(k for k in theirs if k not in ours)]
        return [d for k in keys for d in diff(ours.get(k, ABSENT), theirs.get(k, ABSENT), f"{path}.{k}" if path else k)]
    if isinstance(ours, list) and isinstance(theirs, list) and ours and theirs:
        n = max(len(ours), len(theirs))

        def pad(x: list) -> list:
            return x + [ABSENT] * (n - len(x))

        return [d for i, (a, b) in enumerate(zip(pad(ours), pad(theirs), strict=True)) for d in diff(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: ours {brief(ours)}, theirs {brief(theirs)}"]


def brief(x: Any) -> str:
    text = json.dumps(x)
    return text if len(text) <= 160 else text[:157] + "..."


def pick(x: Any, path: str) -> Any:
    """A value by its path, ``usage.prompt_tokens`` or ``choices[0].text``."""
    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(x, list) and part.isdigit() and int(part) < len(x):
            x = x[int(part)]
        elif isinstance(x, dict):
            x = x.get(part)
        else:
            return None
    return x


# --- the requests ------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    path: str
    body: Any = None  # None: GET; bytes: sent as they are; anything else: JSON
    server: str = "main"  # or "embedding": llama-server needs --embeddings for these
    repeat: int = 1  # send it this many times, compare the last answer
    view: Callable[[Any], Any] = shape  # what of an answer's JSON is compared
    same: tuple[str, ...] = ()  # paths whose values must be equal too
    common: tuple[str, ...] = ()  # paths where only the keys both servers have are compared

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream", False)


# the /props keys both servers have (llama-server has more: webui, tokens, template caps, ...)
PROPS = ["default_generation_settings", "total_slots", "model_alias", "model_path", "modalities",
         "endpoint_slots", "endpoint_metrics", "chat_template", "build_info"]  # fmt: skip


class AnyCounts:
    """An engine whose every count is 0: enough for ``metrics.gauges`` to list its names (its counters and cells too)."""

    def __getattr__(self, name: str) -> Any:
        return self if name in ("counters", "cells") else 0


METRIC_NAMES = [*metrics.COUNTERS, *metrics.gauges(AnyCounts())]  # every name llmkit's /metrics writes
# the names metrics.py lists under its "llmkit's own" comments: not llama-server's names
OWN_METRICS = [
    name for part in inspect.getsource(metrics).split("# llmkit's own")[1:] for name in re.findall(r'"(\w+)":', part.split("}", 1)[0])
]


def metrics_view(text: str) -> dict:
    """Which of llmkit's metric names the text has (a sample line ``llamacpp:<name> <value>``)."""
    return {n: re.search(rf"^{re.escape(metrics.PREFIX + n)}(\{{.*\}})? ", text, re.M) is not None for n in METRIC_NAMES}


ROWS = [
    # chat
    Row("chat", "/v1/chat/completions", CHAT, same=("choices[0].message.content", "usage.prompt_tokens")),
    Row("chat stream", "/v1/chat/completions", {**CHAT, "stream": True}),
    Row("chat stream usage", "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    Row("chat logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    Row("chat stream logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2, "stream": True}),
    Row("chat cached", "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Repeat after me: " + "slots " * 40}], "max_tokens": 4},
        repeat=2, same=("usage.prompt_tokens", "usage.prompt_tokens_details.cached_tokens")),
    Row("chat without /v1", "/chat/completions", CHAT),
    Row("chat eos", "/v1/chat/completions", {"messages": ASK_SUM, "max_tokens": 64},
        same=("choices[0].message.content", "choices[0].finish_reason", "usage.completion_tokens")),
    # OpenAI text completion
    Row("completions", "/v1/completions", {"prompt": COUNT, "max_tokens": 8}, same=("choices[0].text",)),
    Row("completions stream", "/v1/completions", {"prompt": COUNT, "max_tokens": 8, "stream": True}),
    Row("completions stream usage", "/v1/completions",
        {"prompt": COUNT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}),
    Row("completions logprobs", "/v1/completions", {"prompt": COUNT, "max_tokens": 4, "logprobs": 2}),
    # llama-server's own completion
    Row("completion", "/completion", {"prompt": COUNT, "n_predict": 8}, same=("content", "tokens_evaluated", "stop_type")),
    Row("completion n_probs", "/completion", {"prompt": COUNT, "n_predict": 4, "n_probs": 2}),
    Row("completion stream", "/completion", {"prompt": COUNT, "n_predict": 8, "stream": True}),
    Row("completion stream n_probs", "/completion", {"prompt": COUNT, "n_predict": 4, "n_probs": 2, "stream": True}),
    Row("completions without /v1", "/completions", {"prompt": COUNT, "n_predict": 8}),
    Row("completion n_predict 0", "/completion", {"prompt": COUNT, "n_predict": 0}, same=("content", "tokens_predicted", "stop_type")),
    # structured output
    Row("response_format json_schema", "/v1/chat/completions",
        {"messages": PERSON, "max_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
        same=JSON_ANSWER),
    Row("json_schema", "/v1/chat/completions", {"messages": PERSON, "max_tokens": 24, "json_schema": SCHEMA}, same=JSON_ANSWER),
    Row("grammar", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 8, "grammar": 'root ::= "yes" | "no"'},
        same=("choices[0].message.content",)),
    # OpenAI's Responses API
    Row("responses", "/v1/responses", {"input": SUM, "max_output_tokens": 64}, same=("status", TEXT, "usage.input_tokens")),
    Row("responses items", "/v1/responses", {"instructions": "You are a helpful assistant.", "input": ITEMS, "max_output_tokens": 16},
        same=(TEXT, "usage.input_tokens")),
    Row("responses stream", "/v1/responses", {"input": SUM, "max_output_tokens": 64, "stream": True}),
    Row("responses max_output_tokens", "/v1/responses", {"input": COUNT, "max_output_tokens": 4},
        same=("status", "incomplete_details", TEXT, "usage.output_tokens")),
    Row("responses text.format", "/v1/responses",
        {"input": PERSON, "max_output_tokens": 24, "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}},
        same=(TEXT,)),
    Row("responses input_tokens", "/v1/responses/input_tokens", {"instructions": "Answer briefly.", "input": ITEMS},
        same=("object", "input_tokens")),
    Row("responses previous_response_id", "/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}, same=ERROR),
    Row("responses missing input", "/responses", {"max_output_tokens": 4}, same=ERROR),
    # Anthropic's Messages API
    Row("messages", "/v1/messages", {"messages": ASK_SUM, "max_tokens": 64},
        same=("content[0].text", "stop_reason", "stop_sequence", "usage.output_tokens")),
    Row("messages system", "/v1/messages", {"system": [{"type": "text", "text": "Answer briefly."}], "messages": ASK_SUM,
        "max_tokens": 8}, same=("content[0].text", "stop_reason")),
    Row("messages stream", "/v1/messages", {"messages": HELLO, "max_tokens": 8, "stream": True}),
    Row("messages stop_sequences", "/v1/messages", {"messages": HELLO, "max_tokens": 32, "stop_sequences": ["!"]},
        same=("content[0].text", "stop_reason", "stop_sequence")),
    Row("messages count_tokens", "/v1/messages/count_tokens", {"system": "Answer briefly.", "messages": HELLO}, same=("input_tokens",)),
    Row("messages tool_result", "/v1/messages", {"messages": TOOL_ROUND_TRIP, "tools": [ANTHROPIC_WEATHER], "max_tokens": 16}),
    Row("messages missing messages", "/v1/messages", {"max_tokens": 8}),
    Row("messages image", "/v1/messages", {"messages": [{"role": "user", "content": [IMAGE]}], "max_tokens": 8}),
    Row("messages missing max_tokens", "/v1/messages", {"messages": HELLO}),
    # tools: SmolLM2's template has no tool syntax, so llama-server answers in text; llmkit calls
    Row("chat tools required", "/v1/chat/completions",
        {"messages": ASK, "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required", "parallel_tool_calls": False,
         "max_tokens": 48}),
    Row("responses tools required", "/v1/responses",
        {"input": ASK, "tools": [{"type": "function", **WEATHER}], "tool_choice": "required", "parallel_tool_calls": False,
         "max_output_tokens": 48}),
    Row("messages tools any, streamed", "/v1/messages",
        {"messages": ASK, "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "max_tokens": 48,
         "stream": True}),
    # tokens
    Row("tokenize", "/tokenize", {"content": "Hello world"}, same=("tokens",)),
    Row("tokenize with_pieces", "/tokenize", {"content": "Hello wörld", "with_pieces": True}, same=("tokens",)),
    Row("tokenize bytes", "/tokenize", {"content": "\U0001f999 x", "with_pieces": True}, same=("tokens",)),
    Row("detokenize", "/detokenize", {"tokens": [19556, 905]}, same=("content",)),
    # embeddings
    Row("v1/embeddings, no --embeddings", "/v1/embeddings", {"input": "The cat sat."}, same=("error.type",)),
    Row("v1/embeddings", "/v1/embeddings", {"input": ["The cat sat.", "Stock prices fell."]}, server="embedding"),
    Row("embedding", "/embedding", {"content": "The cat sat."}, server="embedding"),
    Row("embeddings without /v1", "/embeddings", {"input": ["The cat sat.", "Stock prices fell."]}, server="embedding"),
    # server state
    Row("apply-template", "/apply-template", {"messages": HELLO}, same=("prompt",)),
    Row("v1/models", "/v1/models"),
    Row("models", "/models"),
    Row("health", "/health", same=("status",)),
    Row("v1/health", "/v1/health"),
    Row("props", "/props", view=lambda props: shape({k: props.get(k, "absent") for k in PROPS}),
        common=("default_generation_settings.params",)),
    # errors
    Row("invalid JSON", "/v1/chat/completions", b'{"messages": [', same=ERROR),
    Row("body not an object", "/v1/chat/completions", [1, 2], same=ERROR),
    Row("missing messages", "/v1/chat/completions", {"max_tokens": 8}, same=ERROR),
    Row("max_tokens wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "x"}, same=ERROR),
    Row("unknown response_format", "/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, same=ERROR),
    Row("prompt over context", "/v1/completions", {"prompt": "hello " * 2100, "max_tokens": 4},
        same=(*ERROR, "error.n_prompt_tokens", "error.n_ctx")),
    Row("prompt over context, streamed", "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello " * 2100}], "stream": True}, same=(*ERROR, "error.n_ctx")),
    Row("completion bad prompt", "/completion", {"prompt": 42}, same=ERROR),
    Row("completions missing prompt", "/v1/completions", {"max_tokens": 4}, same=ERROR),
    Row("unknown route", "/v1/nothing", {"x": 1}, same=(*ERROR, "error.message")),
    # after the generations: the slots have been used, the counters counted
    Row("slots", "/slots", view=lambda slots: [shape(s) for s in slots], common=("",)),
    Row("metrics", "/metrics", view=metrics_view),
]  # fmt: skip


# --- what differs, and why (the ONE list) ------------------------------------------------
# (rows, difference, reason): the rows by name, the difference as the start of a diff line
# ("path: ours X, theirs Y"; ``*`` matches anything). Every entry must match a difference in
# each of its rows, and every difference must be matched.

CHAT_ROWS = ("chat", "chat stream", "chat stream usage", "chat stream logprobs", "chat cached", "chat without /v1", "chat eos",
             "response_format json_schema", "json_schema", "grammar", "chat tools required")  # fmt: skip
RESPONSES = ("responses", "responses items", "responses max_output_tokens", "responses text.format", "responses tools required")
RESPONSE_ROWS = (*RESPONSES, "responses stream")
MESSAGE_ROWS = ("messages", "messages system", "messages stream", "messages stop_sequences", "messages tool_result",
                "messages tools any, streamed")  # fmt: skip
MESSAGE_STREAMS = ("messages stream", "messages tools any, streamed")
# the fields of OpenAI's Response object that llama-server's to_json_oaicompat_resp leaves out
RESPONSE_FIELDS = ("error", "incomplete_details", "previous_response_id", "reasoning", "store", "truncation", "user",
                   "instructions", "max_output_tokens", "parallel_tool_calls", "temperature", "top_p", "text", "tool_choice", "tools",
                   "metadata")  # fmt: skip
TOOLS_IGNORED = ("llama-server renders tools only in a template's own tool syntax, and common/chat.cpp's autoparser finds none in "
                 "SmolLM2's (its prompt with tools is the prompt without, 37 tokens, no grammar): it answers in text; "
                 "llmkit describes the tools in Hermes 2 Pro's format and constrains the answer to a call (tools.py)")  # fmt: skip
NATIVE_ROWS = ("completion", "completion n_probs", "completion stream", "completion stream n_probs", "completions without /v1",
               "completion n_predict 0")  # fmt: skip
PROMPT_ONLY = ("server-schema.cpp says n_predict 0 evaluates the prompt into the cache and generates nothing, and llmkit does "
               "that; llama-server's process_token checks the budget only after a token (n_gen > 0), so it samples one")  # fmt: skip

INTENDED: list[tuple[tuple[str, ...], str, str]] = [
    (CHAT_ROWS, '*choices[0].logprobs: ours "null", theirs "absent"',
     "OpenAI's chat schema has logprobs: null in every choice; llama-server leaves the key out when it has none"),
    (("chat eos",), "values.usage.completion_tokens",
     "llmkit counts the answer's tokens (as its sequential server, which notebook 03 compares); "
     "llama-server also counts the end token it sampled"),
    (("response_format json_schema", "json_schema"), "values.choices[0].message.content",
     "llmkit's JSON grammar allows one optional space between tokens (llama-cpp-python's SPACE_RULE); "
     "llama.cpp's also newlines and indentation"),
    (("completions stream",), 'events[1].usage: ours "absent"',
     "llmkit follows OpenAI: usage only with stream_options.include_usage; llama-server's to_json_oaicompat puts it on every final chunk"),
    (("completions stream usage",), 'events[1].usage: ours "absent"',
     "with include_usage llmkit sends OpenAI's usage chunk (choices: [], as llama-server does for chat), "
     "not usage on the finish_reason chunk"),
    (("completions stream usage",), 'events[1].timings: ours "absent"', "the same: timings ride on the last chunk, here the usage chunk"),
    (("completions stream usage",), 'events[2]: ours {*theirs "absent"', "the same: llmkit's separate usage chunk"),
    (("completions logprobs",), 'body.choices[0].logprobs.*theirs "absent"',
     "llmkit adds OpenAI's legacy text-completion lists (tokens, token_logprobs, top_logprobs) beside llama-server's content"),
    (NATIVE_ROWS, '*generation_settings.*: ours "absent"',
     "generation_settings lists the sampling settings llmkit has; llama-server's task_params::to_json adds dry, xtc, mirostat, ..."),
    (NATIVE_ROWS, '*generation_settings.*: ours *, theirs "absent"',
     "after llama-server's keys, RequestParams.to_dict writes llmkit's own settings (cache_prompt, id_slot, priority, tenant ...)"),
    (("completion n_predict 0",), "values.content", PROMPT_ONLY),
    (("completion n_predict 0",), "values.tokens_predicted", PROMPT_ONLY),
    (("chat", "chat stream", "chat stream usage", "chat logprobs", "chat stream logprobs", "chat cached", "chat without /v1", "chat eos",
      "completions", "completions stream", "completions logprobs", "completion", "completion n_probs", "completion stream",
      "completion stream n_probs", "completions without /v1", "completion n_predict 0", "response_format json_schema",
      "json_schema", "grammar", "chat tools required", "responses stream"),
     '*timings.n_cache_reuse: ours "number", theirs "absent"',
     "llmkit's timings also say how many of cache_n were moved into place by --cache-reuse (llama-server counts them in cache_n only)"),
    (("v1/models", "models"), 'body.models: ours "absent"',
     "llama-server adds an Ollama-style model list; llmkit answers OpenAI's list only"),
    (("v1/models", "models"), 'body.data[0].*: ours "absent"',
     "llama-server's model object adds aliases, tags, meta.vocab_type and meta.ftype; llmkit's meta has the sizes only"),
    (("v1/embeddings, no --embeddings",), "status: ours 200, theirs 501",
     "llmkit always serves embeddings (its own mean-pooling context); llama-server only in --embeddings mode"),
    (("v1/embeddings, no --embeddings",), "body.*", "the same: an embedding list against llama-server's 501 error"),
    (("v1/embeddings, no --embeddings",), "values.error.*", "the same: no error here"),
    (("invalid JSON",), "status: ours 400, theirs 500",
     "llama-server's json::parse throws inside ex_wrapper, which answers 500; llmkit chooses the 4xx of a client error"),
    (("invalid JSON",), "values.error.*", "the same: code 400 and invalid_request_error against 500 and server_error"),
    *((("metrics",), f"body.{name}: ours true, theirs false", "llmkit's own counter (metrics.py: \"llmkit's own\")")
      for name in OWN_METRICS),
    # OpenAI's Responses API
    *((RESPONSE_ROWS, f'*.{field}: ours *, theirs "absent"',
       "OpenAI's Response object has it, the request's settings echoed (responses.echo); llama-server's to_json_oaicompat_resp "
       "writes id, object, created_at, completed_at, model, output, status and usage only") for field in RESPONSE_FIELDS),
    (RESPONSE_ROWS, '*usage.output_tokens_details: ours {"reasoning_tokens": "number"}, theirs "absent"',
     "OpenAI's usage has output_tokens_details (no reasoning here: 0); llama-server's leaves it out"),
    (("responses stream",), 'data.response.created[0].response.*: ours *, theirs "absent"',
     "llmkit's response.created carries the whole (empty) Response, as OpenAI's does; llama-server's only id, object and status"),
    (("responses stream",), 'data.response.in_progress[0].response.*: ours *, theirs "absent"', "the same for response.in_progress"),
    (("responses stream",), 'data.response.completed[0].response.completed_at: ours "number", theirs "absent"',
     "OpenAI's completed Response has completed_at, streamed or not; llama-server writes it in a whole response only"),
    (("responses stream",), '*.sequence_number: ours "number", theirs "absent"',
     "OpenAI's stream events are numbered; llama-server's (to_json_oaicompat_resp, partial and final) are not"),
    (("responses stream",), '*.output_index: ours "number", theirs "absent"',
     "OpenAI's item events say which output item they belong to; llama-server's give the item_id only"),
    (("responses stream",), '*.content_index: ours "number", theirs "absent"',
     "OpenAI's text and part events say which content part they belong to; llama-server's do not"),
    (("responses stream",), 'data.response.output_text.*[0].logprobs: ours [], theirs "absent"',
     "OpenAI's output_text.delta and .done carry logprobs (empty: none asked for); llama-server's do not"),
    (("responses stream",), 'data.response.content_part.added[0].part.*: ours [], theirs "absent"',
     "llmkit's new part is OpenAI's empty output_text part (annotations, logprobs), as in llama-server's content_part.done; "
     "its content_part.added has type and text only"),
    (("responses max_output_tokens",), 'values.status: ours "incomplete", theirs "completed"',
     "OpenAI: a response cut by max_output_tokens is incomplete; llama-server's to_json_oaicompat_resp always says completed"),
    (("responses max_output_tokens",), "values.incomplete_details",
     "the same: OpenAI's incomplete_details.reason max_output_tokens (llama-server: no incomplete_details)"),
    (("responses max_output_tokens",), 'body.completed_at: ours "absent", theirs "number"',
     "the same: OpenAI writes completed_at for a completed response only; llama-server always (it always says completed)"),
    (("responses text.format",), "values.output[0].content[0].text",
     "llmkit answers in text.format's JSON Schema; llama-server's server_chat_convert_responses_to_chatcmpl passes 'text' on "
     "unconverted and oaicompat_chat_params_parse reads only response_format and json_schema: the format is ignored"),
    # Anthropic's Messages API
    (("messages",), "values.usage.output_tokens", "as chat eos: llama-server's n_decoded also counts the end token"),
    (MESSAGE_ROWS, '*usage.cache_creation_input_tokens: ours "number", theirs "absent"',
     "Anthropic's usage has cache_creation_input_tokens (0: nothing is written to a cache on request); llama-server's leaves it out"),
    (MESSAGE_STREAMS, 'events[1]: ours ["ping"], theirs []',
     "Anthropic's streams send a ping (llmkit: one, after message_start); llama-server's send none"),
    (MESSAGE_STREAMS, 'data.ping: ours [{"type": "string"}], theirs "absent"', "the same ping"),
    (("messages stop_sequences",), 'values.stop_reason: ours "stop_sequence", theirs "end_turn"',
     "Anthropic's stop_reason is stop_sequence when one ended the answer; llama-server's to_json_anthropic says end_turn "
     "for STOP_TYPE_WORD as for EOS (its stop_sequence is the word, as llmkit's)"),
    (("messages missing messages", "messages image"), 'body.type: ours "string", theirs "absent"',
     "llmkit answers Anthropic's error shape on its routes, {\"type\": \"error\", \"error\": {type, message}}; "
     "llama-server's ex_wrapper writes OpenAI's {\"error\": {code, message, type}} on every route"),
    (("messages missing messages", "messages image"), 'body.error.code: ours "absent", theirs "number"',
     "the same: Anthropic's error has no code"),
    (("messages missing messages",), "status: ours 400, theirs 500",
     "server_chat_convert_anthropic_to_oai throws std::runtime_error(\"'messages' is required\"), which ex_wrapper answers 500"),
    (("messages image",), "status: ours 400, theirs 500",
     "llama-server converts the image and oaicompat_chat_params_parse throws std::runtime_error (\"image input is not supported\"): "
     "500; llmkit refuses it as the client's error (messages.py: the model reads text only)"),
    (("messages missing max_tokens",), "status: ours 400, theirs 200",
     "Anthropic requires max_tokens (messages.py); llama-server's server_chat_convert_anthropic_to_oai puts 4096 in its place"),
    (("messages missing max_tokens",), "body.*", "the same: an error against a message"),
    # tools
    (("chat tools required",), 'body.choices[0].message.content: ours "null", theirs "string"', TOOLS_IGNORED),
    (("chat tools required",), 'body.choices[0].message.tool_calls: ours *, theirs "absent"', TOOLS_IGNORED),
    (("responses tools required",), "body.output[0].*", TOOLS_IGNORED + ": a function_call item against a message item"),
    (("messages tools any, streamed",), "data.content_block_*", TOOLS_IGNORED + ": a tool_use block against a text block"),
]  # fmt: skip


def matches(pattern: str, difference: str) -> bool:
    """``pattern`` (``*``: anything) matches the start of ``difference``, up to the end of a path part."""
    regex = ".*".join(map(re.escape, pattern.split("*")))
    return re.match(rf"{regex}(?=$|[:.\[,])", difference) is not None


# --- running -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    """llmkit's slot server, llama-server, and llama-server with --embeddings; started at once."""
    kinds = {"ours": ("slots", FLAGS), "theirs": ("llama-server", FLAGS), "theirs embedding": ("llama-server", EMBEDDING_FLAGS)}
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        futures = {name: pool.submit(launch.start, kind, *flags, timeout=300) for name, (kind, flags) in kinds.items()}
        concurrent.futures.wait(futures.values())
        for future in futures.values():
            if future.exception() is None:
                stack.callback(future.result().stop)
        yield {name: future.result() for name, future in futures.items()}  # raises if one failed: the others stop


def send(url: str, row: Row) -> dict:
    """The comparable view of one answer: status, then its JSON (or stream events, or text)."""
    if row.body is None:
        method, kwargs = "GET", {}
    elif isinstance(row.body, bytes):
        method, kwargs = "POST", {"content": row.body, "headers": {"Content-Type": "application/json"}}
    else:
        method, kwargs = "POST", {"json": row.body}
    for _ in range(row.repeat):
        with httpx.stream(method, url + row.path, timeout=120, **kwargs) as r:
            raw = r.read()
    answer = {"status": r.status_code}
    if r.status_code == 200 and row.stream:
        events = [e for e in map(sse_event, raw.strip().split(b"\n\n")) if e[1]]
        answer["done"] = bool(events) and events[-1] == (None, b"[DONE]")
        events = [(name, json.loads(data)) for name, data in events if data != b"[DONE]"]
        if all(name is None for name, _ in events):
            shapes = [shape(data) for _, data in events]
            answer["events"] = [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]
        else:  # named events (Responses, Messages): their names in order, then each name's data shapes
            names = [name for name, _ in events]
            answer["events"] = tuple(n for i, n in enumerate(names) if i == 0 or n != names[i - 1])
            answer["data"] = {n: shape([data for name, data in events if name == n]) for n in dict.fromkeys(names)}
        return answer
    content_type = r.headers.get("content-type", "")
    answer["content_type"] = content_type.split(";")[0]
    if row.path == "/metrics":
        answer["body"] = row.view(raw.decode())
        return answer
    try:
        data = json.loads(raw)
    except ValueError:
        answer["body"] = f"not JSON: {raw[:100]!r}"
        return answer
    answer["body"] = row.view(data)
    answer["values"] = {p: pick(data, p) for p in row.same}
    return answer


def sse_event(block: bytes) -> tuple[str | None, bytes]:
    """One server-sent event's name (its ``event:`` line; None: none) and data (its ``data:`` lines)."""
    name, data = None, []
    for line in block.split(b"\n"):
        key, _, value = line.partition(b":")
        if key == b"event":
            name = value.strip().decode()
        elif key == b"data":
            data.append(value.removeprefix(b" "))
    return name, b"\n".join(data)


def keep_common(a: Any, b: Any) -> None:
    """Drop the keys only one side has (in two dicts, or in each pair of two lists' dicts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() ^ b.keys():
            a.pop(k, None), b.pop(k, None)
    elif isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b, strict=False):  # the common prefix
            keep_common(x, y)


def test_llama_server_runs_the_same_cpu_kernels():
    """Greedy text compares only between builds of the same kernels: a llama-server built for AVX2 beside a
    llama-cpp-python compiled for AVX-512 gives logits that differ in the second decimal, enough to flip a near-tie."""
    ours, theirs = build.wheel_features(), build.server_features(upstream.server_binary())
    assert ours == theirs, f"llama-cpp-python was compiled for {ours}, llama-server for {theirs} (upstream.build.build_features)"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_same_as_llama_server(servers, row):
    theirs_url = servers["theirs embedding" if row.server == "embedding" else "theirs"].url
    ours, theirs = send(servers["ours"].url, row), send(theirs_url, row)
    for path in row.common:
        keep_common(pick(ours.get("body"), path), pick(theirs.get("body"), path))
    differences = diff(ours, theirs)
    intended = [pattern for rows, pattern, _ in INTENDED if row.name in rows]
    unexplained = [d for d in differences if not any(matches(p, d) for p in intended)]
    stale = [p for p in intended if not any(matches(p, d) for d in differences)]
    assert not unexplained, "differences not in INTENDED:\n" + "\n".join(unexplained)
    assert not stale, "listed in INTENDED but no longer different: " + ", ".join(stale)
