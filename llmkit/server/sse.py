"""Completion bodies, stream chunks and their SSE framing.

(~ llama-server's server-task.cpp ``to_json_oaicompat*`` and
server-common.cpp ``format_oai_sse``.) One ``Formatter`` per response builds
every JSON object of it, chat or text, whole or streamed, so the two
endpoints share one code path. A stream is:

    data: {... "delta": {"role": "assistant", "content": null} ...}   (chat only)
    data: {... "delta": {"content": "Hel"} ...}                       one per text piece
    data: {... "delta": {}, "finish_reason": "stop"}
    data: {... "choices": [], "usage": {...}}                         with stream_options.include_usage
    data: [DONE]

``NativeFormatter`` is the same for llama-server's own ``/completion``
(``to_json_non_oaicompat``), whose stream has no ``[DONE]``:

    data: {"index": 0, "content": "Hel", "tokens": [...], "stop": false, ...}   one per text piece
    data: {"index": 0, "content": "", "tokens": [], "stop": true, ..., "timings": {...}}

Both answer the same four calls, which is all ``generation.generate`` needs:
``response`` (whole), then for a stream ``opening``, ``chunk`` per piece,
``closing``, and the ``done`` line if any.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmkit.engine import End, Outcome, Request, RequestParams
from llmkit.engine.request import Piece, TokenLogprob
from llmkit.llama import LLAMA_DEFAULT_SEED, Grammar
from llmkit.server.errors import ApiError
from llmkit.server.tools import Delta, ToolCall

DONE = "data: [DONE]\n\n"


def event(data: dict) -> str:
    """One server-sent event. Raw UTF-8 (no \\u escapes), compact, as llama-server sends it."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_event(data: dict) -> str:
    """One server-sent event named after its ``type`` (the Responses and Messages APIs): a client
    dispatches on the ``event:`` line before it parses the JSON (llama-server: format_anthropic_sse)."""
    return f"event: {data['type']}\n{event(data)}"


# How a request ended, in each dialect's words (llama-server: each result's to_json maps its stop_type)
FINISH_REASON = {End.EOS: "stop", End.WORD: "stop", End.LIMIT: "length", End.CANCELLED: "cancelled"}  # OpenAI's
STOP_TYPE = {End.EOS: "eos", End.WORD: "word", End.LIMIT: "limit", End.CANCELLED: "none"}  # llama-server's /completion


def usage(outcome: Outcome) -> dict:
    """OpenAI's usage object, with llama-server's cached-token count."""
    return {
        "prompt_tokens": outcome.n_prompt,
        "completion_tokens": outcome.n_output,
        "total_tokens": outcome.n_prompt + outcome.n_output,
        "prompt_tokens_details": {"cached_tokens": outcome.n_cached},
    }


def token_logprobs(items: list[TokenLogprob], n_top: int, token_piece: Callable[[int], bytes]) -> list[dict]:
    """``[{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}]`` per token
    (llama-server's ``probs_vector_to_json``, in both its dialects)."""

    def entry(token: int, logprob: float) -> dict:
        raw = token_piece(token)
        return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw), "logprob": logprob}

    return [entry(i.token, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top[:n_top]]} for i in items]


class WireFormat(Protocol):
    """What ``generation.generate`` asks of a response's format: the whole answer, or a stream's events
    (``opening``, ``chunk`` per piece of text, ``closing``; ``error`` after the 200), each sent as ``frame``
    makes it, then ``done`` if any. While it streams, a format reads the request's inputs and where it runs
    (``opening``, ``chunk``); how it ended, only from its ``Outcome`` (``response``, ``closing``). One per API:
    ``Formatter`` (OpenAI chat and text), ``NativeFormatter`` (llama-server's /completion),
    ``responses.ResponsesFormatter``, ``messages.MessagesFormatter``."""

    @property
    def done(self) -> str | None: ...

    def frame(self, data: dict) -> str: ...
    def response(self, outcome: Outcome, pieces: list[Piece], answer: Answer) -> dict: ...
    def opening(self, request: Request) -> list[dict]: ...
    def chunk(self, request: Request, piece: Piece, deltas: list[Delta]) -> list[dict]: ...
    def closing(self, outcome: Outcome, answer: Answer, include_usage: bool) -> list[dict]: ...
    def error(self, exc: ApiError) -> list[dict]: ...


class Answer(Protocol):
    """What the answer's text was read as (``tools.CallParser``, ``tools.TextParser``): content, then calls."""

    content: str
    calls: list[ToolCall]


def finish_reason(outcome: Outcome, answer: Answer) -> str:
    """Why the answer ended, in OpenAI's words: ``tool_calls`` when it ended with calls."""
    reason = FINISH_REASON[outcome.end]
    return "tool_calls" if answer.calls and reason == "stop" else reason


@dataclass
class Formatter:
    """The JSON objects of one completion response (``chat`` or text)."""

    chat: bool
    model: str
    system_fingerprint: str
    n_top: int | None = None  # alternatives per token in ``logprobs``; None: no logprobs
    token_piece: Callable[[int], bytes] = bytes  # token id -> its bytes (Model.token_to_piece)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    done = DONE  # the stream's last line
    frame = staticmethod(event)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_urlsafe(24)

    def logprobs(self, items: list[TokenLogprob]) -> dict | None:
        """``{"content": [{id, token, bytes, logprob, top_logprobs}]}``: OpenAI chat's shape, which
        llama-server uses for both APIs; text completions also get OpenAI's legacy lists."""
        if self.n_top is None:
            return None
        content = token_logprobs(items, self.n_top, self.token_piece)
        if self.chat:
            return {"content": content}
        return {
            "tokens": [c["token"] for c in content],
            "token_logprobs": [c["logprob"] for c in content],
            "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
            "content": content,
        }

    def _envelope(self, choices: list[dict], *, chunk: bool, **extra: object) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            **extra,
        }

    def _choice(self, body: dict, finish_reason: str | None = None, lp: dict | None = None) -> dict:
        return {"index": 0, **body, "logprobs": lp, "finish_reason": finish_reason}

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
        """One delta in chat's shape: ``{"content": ...}``, or a piece of ``tool_calls[i]`` (llama-server:
        server_chat_msg_diff_to_json_oaicompat); a text completion's ``{"text": ...}``."""
        if not self.chat:
            return {"text": d.content}
        if d.index < 0:
            return {"delta": {"content": d.content}}
        call: dict[str, Any] = {"index": d.index}
        if d.name:
            call |= {"id": f"call_{d.id}", "type": "function", "function": {"name": d.name, "arguments": ""}}
        else:
            call["function"] = {"arguments": d.arguments}
        return {"delta": {"tool_calls": [call]}}

    # whole response

    def response(self, outcome: Outcome, pieces: list[Piece], answer: Answer) -> dict:
        items = [i for p in pieces for i in p.logprobs]
        body = {"message": self.message(answer)} if self.chat else {"text": answer.content}
        choice = self._choice(body, finish_reason(outcome, answer), self.logprobs(items))
        return self._envelope([choice], chunk=False, usage=usage(outcome), timings=outcome.timings.to_dict())

    # stream

    def opening(self, request: Request) -> list[dict]:
        """Chat streams open with the assistant's role (OpenAI does; clients expect it)."""
        if not self.chat:
            return []
        return [self._envelope([self._choice({"delta": {"role": "assistant", "content": None}})], chunk=True)]

    def chunk(self, request: Request, piece: Piece, deltas: list[Delta]) -> list[dict]:
        """A chunk per delta; the piece's logprobs ride on the last."""
        chunks = [self._envelope([self._choice(self.delta(d))], chunk=True) for d in deltas]
        if chunks and piece.logprobs:
            chunks[-1]["choices"][0]["logprobs"] = self.logprobs(piece.logprobs)
        return chunks

    def closing(self, outcome: Outcome, answer: Answer, include_usage: bool) -> list[dict]:
        """The empty delta with ``finish_reason``, then the usage chunk if asked; timings ride on the last one."""
        reason = self._choice({"delta": {}} if self.chat else {"text": ""}, finish_reason(outcome, answer))
        chunks = [self._envelope([reason], chunk=True)]
        if include_usage:
            chunks.append(self._envelope([], chunk=True, usage=usage(outcome)))
        chunks[-1]["timings"] = outcome.timings.to_dict()
        return chunks

    def error(self, exc: ApiError) -> list[dict]:
        """A failure after the 200 was sent: the error's body, as one more event."""
        return [exc.body()]


@dataclass
class NativeFormatter:
    """The JSON objects of one answer of llama-server's own ``/completion`` (server-task.cpp
    ``to_json_non_oaicompat`` of ``server_task_result_cmpl_partial`` and ``_final``, same keys, same order)."""

    model: str
    prompt: str  # the prompt as text, special tokens written out (the answer's ``prompt``)
    n_top: int | None = None  # alternatives per token in ``completion_probabilities``; None: none
    token_piece: Callable[[int], bytes] = bytes
    return_tokens: bool = False  # a whole answer lists its tokens only if asked (a stream's chunks always do)
    stream: bool = False
    index: int = 0  # which prompt of the request this answers
    n_sent: int = 0  # tokens sent so far in the stream
    done = None  # llama-server ends a native stream without [DONE]
    frame = staticmethod(event)

    params: RequestParams = field(default_factory=RequestParams)  # the request's settings (its generation_settings)

    def generation_settings(self) -> dict:
        """The request's settings, as far as llmkit has them (task_params::to_json names and order)."""
        r, p = self.params, self.params.sampling
        return {
            "seed": LLAMA_DEFAULT_SEED if p.seed is None else p.seed,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "repeat_last_n": p.repeat_last_n,
            "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "stop": list(r.stop),
            "max_tokens": r.max_tokens,
            "n_predict": r.max_tokens,
            "ignore_eos": p.ignore_eos,
            "stream": self.stream,
            "n_probs": r.n_probs,
            "grammar": p.grammar.text if isinstance(p.grammar, Grammar) else p.grammar or "",
        }

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
            "generation_settings": self.generation_settings(),
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
        return body

    def response(self, outcome: Outcome, pieces: list[Piece], answer: Answer) -> dict:
        """The whole answer: every token the model produced, the stop word's included (as llama-server)."""
        tokens = list(outcome.output) if self.return_tokens else []
        return self.final(outcome, answer.content, answer.content, tokens, [i for p in pieces for i in p.logprobs])

    def opening(self, request: Request) -> list[dict]:
        return []

    def chunk(self, request: Request, piece: Piece, deltas: list[Delta]) -> list[dict]:
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

    def closing(self, outcome: Outcome, answer: Answer, include_usage: bool) -> list[dict]:
        """The totals, with empty content and tokens: the chunks carried them (no probabilities either)."""
        return [self.final(outcome, "", answer.content, [], [])]

    def error(self, exc: ApiError) -> list[dict]:
        return [exc.body()]
