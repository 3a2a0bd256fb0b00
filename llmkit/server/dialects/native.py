"""llama-server's own completion (~ post_completions, server-task.cpp ``to_json_non_oaicompat``).

    POST /completion, /completions    a prompt as text and/or token ids, or several prompts; whole or streamed (SSE)

Its request fields are llama-server's (``n_predict``, ``n_probs``, ``id_slot``, ``return_tokens`` ...);
several prompts are several requests to the engine, answered as a list (streamed one after the other).
``NativeFormatter`` writes the answer, same keys, same order as llama-server, with the request's
settings as ``generation_settings`` (``RequestParams.to_dict``, the one serializer ``/props`` uses too);
its stream has no ``[DONE]``:

    data: {"index": 0, "content": "Hel", "tokens": [...], "stop": false, ...}   one per text piece
    data: {"index": 0, "content": "", "tokens": [], "stop": true, ..., "timings": {...}}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import AfterValidator, Field

from llmkit.engine import End, Outcome, Piece, RequestParams
from llmkit.engine import Request as EngineRequest
from llmkit.engine.request import TokenLogprob
from llmkit.llama import Model
from llmkit.server import sse
from llmkit.server.dialects.openai import token_logprobs
from llmkit.server.errors import LLAMA_SERVER, ApiError, off_loop
from llmkit.server.generation import answer_many, submit
from llmkit.server.protocol import GenerationRequest, check_tokens
from llmkit.server.state import State
from llmkit.server.tools import Delta

router = APIRouter(dependencies=[Depends(LLAMA_SERVER)])

MAX_PROMPTS = 64  # prompts in one request (each is a request to the engine)


def _is_token(x: Any) -> bool:
    return type(x) is int  # a JSON integer (not a boolean, not 1.0)


def _is_single_prompt(p: Any) -> bool:
    """A string, token ids, or strings and token ids mixed (at least one id: a list of strings is several prompts)."""
    if isinstance(p, str):
        return True
    return isinstance(p, list) and all(_is_token(x) or isinstance(x, str) for x in p) and (not p or any(map(_is_token, p)))


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
    response_fields: list[str] = Field(default_factory=list)  # only these fields of the answer's last object, by slash path (a/b)


@router.post("/completion")
@router.post("/completions")
async def completion(body: NativeCompletionRequest, http_request: Request, state: State) -> Any:
    """llama-server's own completion (post_completions): its request fields, its answer (``NativeFormatter``);
    several prompts are several requests to the engine, answered as a list (streamed one after the other)."""
    model = state.engine.model
    requests: list[EngineRequest] = []
    formats: list[sse.WireFormat] = []
    try:
        for index, prompt in enumerate(body.prompt):
            tokens = check_tokens(await off_loop(tokenize_mixed, model, prompt), model.n_vocab, "prompt")
            text = b"".join(model.token_to_piece(t, special=True) for t in tokens).decode("utf-8", "replace")
            request = await submit(http_request, state, body, tokens)
            requests.append(request)
            formats.append(NativeFormatter(state.model_name, text, body.n_top_logprobs(), model.token_to_piece, body.return_tokens,
                                           index, tuple(body.response_fields), params=request.params))  # fmt: skip
    except BaseException:  # a later prompt is refused: the ones already queued have no reader
        for request in requests:
            request.cancel()
        raise
    return await answer_many(http_request, state, body, requests, formats)


def tokenize_mixed(model: Model, prompt: str | list[int | str]) -> list[int]:
    """A prompt's tokens (llama-server's tokenize_mixed): strings tokenized, ids kept; BOS only if it starts with a string."""
    if isinstance(prompt, str):
        return model.tokenize(prompt)
    return [t for i, part in enumerate(prompt) for t in (model.tokenize(part, add_special=i == 0) if isinstance(part, str) else [part])]


STOP_TYPE = {End.EOS: "eos", End.WORD: "word", End.LIMIT: "limit", End.CANCELLED: "none"}  # llama-server's stop_type


@dataclass
class NativeFormatter:
    """The JSON objects of one answer of llama-server's own ``/completion`` (server-task.cpp
    ``to_json_non_oaicompat`` of ``server_task_result_cmpl_partial`` and ``_final``, same keys, same order)."""

    model: str
    prompt: str  # the prompt as text, special tokens written out (the answer's ``prompt``)
    n_top: int | None = None  # alternatives per token in ``completion_probabilities``; None: none
    token_piece: Callable[[int], bytes] = bytes
    return_tokens: bool = False  # a whole answer lists its tokens only if asked (a stream's chunks always do)
    index: int = 0  # which prompt of the request this answers
    fields: tuple[str, ...] = ()  # response_fields: only these of the last object, by slash path; empty: all
    n_sent: int = 0  # tokens sent so far in the stream
    params: RequestParams = field(default_factory=RequestParams)  # the request's settings (its generation_settings)
    done = None  # llama-server ends a native stream without [DONE]
    frame = staticmethod(sse.event)

    def final(self, outcome: Outcome, content: str, text: str, tokens: list[int], items: list[TokenLogprob]) -> dict:
        """The last object: totals, settings, why it stopped, timings (the whole answer, or a stream's end, whose
        ``content`` is empty: ``text`` is the whole answer's)."""
        body = {
            "index": self.index,
            "content": content,
            "tokens": tokens,
            "id_slot": outcome.id_slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": outcome.n_output,
            "tokens_evaluated": outcome.n_prompt,
            "generation_settings": self.params.to_dict(),
            "prompt": self.prompt,
            "has_new_line": "\n" in text,
            "truncated": outcome.truncated,
            "stop_type": STOP_TYPE[outcome.end],
            "stopping_word": outcome.stopping_word,
            "tokens_cached": outcome.tokens_cached,
            "timings": outcome.timings.to_dict(),
        }
        if items and self.n_top is not None:
            body["completion_probabilities"] = token_logprobs(items, self.n_top, self.token_piece)
        return pick(body, self.fields) if self.fields else body

    def response(self, outcome: Outcome, pieces: list[Piece], answer: sse.Answer) -> dict:
        """The whole answer: every token the model produced, the stop word's included (as llama-server)."""
        tokens = list(outcome.output) if self.return_tokens else []
        return self.final(outcome, answer.content, answer.content, tokens, [i for p in pieces for i in p.logprobs])

    def opening(self, request: EngineRequest) -> list[dict]:
        return []

    def chunk(self, request: EngineRequest, piece: Piece, deltas: list[Delta]) -> list[dict]:
        """One piece of text and the tokens it came from (llama-server sends one chunk per token)."""
        self.n_sent += len(piece.tokens)
        body = {
            "index": self.index,
            "content": piece.text,
            "tokens": piece.tokens,
            "stop": False,
            "id_slot": request.id_slot,
            "tokens_predicted": self.n_sent,
            "tokens_evaluated": len(request.prompt),
        }
        if self.n_top is not None:
            body["completion_probabilities"] = token_logprobs(piece.logprobs, self.n_top, self.token_piece)
        return [body]

    def closing(self, outcome: Outcome, answer: sse.Answer) -> list[dict]:
        """The totals, with empty content and tokens: the chunks carried them (no probabilities either)."""
        return [self.final(outcome, "", answer.content, [], [])]

    def error(self, exc: ApiError) -> list[dict]:
        return [LLAMA_SERVER.body(exc)]


def pick(body: dict, paths: tuple[str, ...]) -> dict:
    """The values at ``paths`` ("generation_settings/n_predict"), keyed by the path; a path that leads nowhere is
    left out (llama-server's ``response_fields``: json_get_nested_values, server-common.cpp)."""
    picked = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked
