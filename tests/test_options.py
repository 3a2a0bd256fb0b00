"""A request's options come from one place, the engine's dataclasses (``llmkit.server.protocol``), model-free.

Every field of every dialect's body is read (under the engine's name, or through a listed conversion) or is the
HTTP layer's own, so a field added to a body and forgotten in the mapping fails here instead of being accepted and
ignored; every option of the engine comes from a body field or says where else it comes from; and the one
serializer of the settings writes llama-server's keys in llama-server's order, every field included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from llmkit.engine import RequestParams
from llmkit.engine.request import TO_JSON
from llmkit.sampling import SamplingParams
from llmkit.server.dialects import messages, responses
from llmkit.server.dialects.native import NativeCompletionRequest
from llmkit.server.dialects.openai_chat import ChatCompletionRequest
from llmkit.server.dialects.openai_text import CompletionRequest
from llmkit.server.protocol import (
    BY_NAME,
    CONVERTED,
    ENGINE,
    HTTP_ONLY,
    NOT_FROM_BODY,
    ChatRequest,
    GenerationRequest,
    constraint_of,
    params_from_body,
)

# a value for each field the mapping reads, unlike the default (a new field without one fails: give it one here)
SAMPLES: dict[str, Any] = {
    "max_tokens": 5, "max_completion_tokens": 6, "n_predict": 7, "temperature": 0.1, "top_p": 0.5, "seed": 7, "stop": ["x"],
    "presence_penalty": 0.5, "frequency_penalty": 0.5, "stream": True, "top_k": 3, "min_p": 0.2, "repeat_penalty": 1.1,
    "repeat_last_n": 8, "cache_prompt": False, "id_slot": 1, "ignore_eos": True, "n_probs": 2, "n_keep": 4, "n_cache_reuse": 16,
    "n_draft_max": 3, "priority": 2, "logprobs": True, "top_logprobs": 2, "kv_transfer_params": {"do_remote_decode": True},
    "logit_bias": {"15043": -100},
}  # fmt: skip
BESIDE = {"top_logprobs": {"logprobs": True}}  # a field read only beside another (in both the baseline and the sample)
CONSTRAINTS = {"response_format": {"type": "json_object"}, "json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}
TOOL = {"type": "function", "function": {"name": "f"}}
TOOLS = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": True}
GENERATION_BODIES = {  # each dialect's body that the mapping reads, with its required fields
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "Hi"}]},
    CompletionRequest: {"prompt": "Hi"},
    NativeCompletionRequest: {"prompt": "Hi"},
}
CONVERTED_BODIES = {  # the bodies that become a chat request, with their dialect's module and required fields
    responses.ResponsesRequest: (responses, {"input": "Hi"}),
    responses.InputRequest: (responses, {"input": "Hi"}),
    messages.MessagesRequest: (messages, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}),
    messages.CountTokensRequest: (messages, {"messages": [{"role": "user", "content": "Hi"}]}),
}


def json_name(model: type[BaseModel], name: str) -> str:
    return model.model_fields[name].alias or name


@pytest.mark.parametrize("model", GENERATION_BODIES, ids=lambda m: m.__name__)
def test_every_field_of_a_generation_body_is_read_or_http_only(model):
    unread = set(model.model_fields) - BY_NAME - set(CONVERTED) - HTTP_ONLY
    assert not unread, f"{model.__name__}: fields the mapping does not read (protocol.BY_NAME, CONVERTED or HTTP_ONLY)"


@pytest.mark.parametrize("model", CONVERTED_BODIES, ids=lambda m: m.__name__)
def test_every_field_of_a_converted_body_is_carried_converted_or_ignored_on_purpose(model):
    dialect, _ = CONVERTED_BODIES[model]
    unread = set(model.model_fields) - set(ChatRequest.model_fields) - dialect.CONVERTED - dialect.IGNORED
    assert not unread, f"{model.__name__}: fields neither chat's (carried) nor in {dialect.__name__}.CONVERTED or IGNORED"
    assert set(model.model_fields) | set(messages.MessagesRequest.model_fields) | {"max_output_tokens"} >= dialect.CONVERTED


def test_every_option_of_the_engine_comes_from_a_body_field_or_says_where_from():
    assert BY_NAME | set(CONVERTED.values()) | NOT_FROM_BODY == ENGINE
    assert set(GenerationRequest.model_fields) >= BY_NAME, "an option the engine has and no body field gives"
    assert not BY_NAME & (set(CONVERTED) | HTTP_ONLY | NOT_FROM_BODY)


@pytest.mark.parametrize("field", sorted(set(ChatRequest.model_fields) - HTTP_ONLY))
def test_every_field_the_mapping_reads_changes_the_engines_options(field):
    """Set alone, each field changes what the engine is asked: read, not just accepted."""
    body = GENERATION_BODIES[ChatCompletionRequest] | BESIDE.get(field, {})
    default = params_from_body(ChatCompletionRequest.model_validate(body), RequestParams())
    if field in CONSTRAINTS:
        assert constraint_of(ChatCompletionRequest.model_validate(body | {field: CONSTRAINTS[field]})) is not None
        return
    if field in TOOLS:
        given = ChatCompletionRequest.model_validate(body | {"tools": [TOOL], field: TOOLS[field]})
        plain = ChatCompletionRequest.model_validate(body | {"tools": [TOOL]})
        assert given.tool_calling("") != plain.tool_calling("") or (field == "tools" and plain.tool_calling("").tools)
        return
    assert field in SAMPLES, f"give {field!r} a sample value in SAMPLES"
    given = params_from_body(ChatCompletionRequest.model_validate(body | {json_name(ChatRequest, field): SAMPLES[field]}), default)
    assert given != default, f"{field!r} is accepted and changes nothing"


@pytest.mark.parametrize("model", CONVERTED_BODIES, ids=lambda m: m.__name__)
def test_the_fields_a_converted_body_shares_with_chat_arrive_in_the_chat_request(model):
    dialect, required = CONVERTED_BODIES[model]
    shared = sorted(set(model.model_fields) & set(ChatRequest.model_fields) & set(SAMPLES) - dialect.CONVERTED)
    if "stream" in model.model_fields:  # a generation (not a count): every chat dialect can carry them (Messages: extra_body)
        assert {"priority", "temperature", "stream", "max_tokens"} <= set(shared)
    for field in shared:
        chat = model.model_validate(required | {json_name(model, field): SAMPLES[field]}).to_chat()
        assert getattr(chat, field) == SAMPLES[field], field


def test_one_serializer_writes_llama_servers_keys_in_its_order_then_every_other_field():
    params = RequestParams.of(max_tokens=4, stop=["a"], seed=None, temperature=0)
    settings = params.to_dict()
    assert list(settings)[: len(TO_JSON)] == list(TO_JSON)
    fields = {f.name for cls in (RequestParams, SamplingParams) for f in dataclasses.fields(cls)} - {"sampling"}
    assert fields <= set(settings), "every field is written"
    assert settings["seed"] == 0xFFFFFFFF and settings["n_predict"] == settings["max_tokens"] == 4 and settings["stop"] == ["a"]
    assert settings["grammar"] == ""  # no grammar: llama-server's empty string


def test_a_top_k_below_one_is_accepted_and_means_no_top_k():
    """llama-server reads any top_k and llama.cpp skips the sampler below 1; clients of vLLM and SGLang's router (its
    Responses route) send -1 for "off". A 400 here would refuse them where llama-server answers."""
    body = GENERATION_BODIES[ChatCompletionRequest] | {"top_k": -1}
    assert params_from_body(ChatCompletionRequest.model_validate(body), RequestParams()).sampling.top_k == -1
    responses_body = responses.ResponsesRequest.model_validate({"input": "Hi", "top_k": -1})
    assert responses_body.top_k == -1
