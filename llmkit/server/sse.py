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
from typing import Any

from llmkit.engine import Request
from llmkit.engine.request import Piece, TokenLogprob
from llmkit.llama import LLAMA_DEFAULT_SEED

DONE = "data: [DONE]\n\n"


def event(data: dict) -> str:
    """One server-sent event. Raw UTF-8 (no \\u escapes), compact, as llama-server sends it."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(request: Request) -> dict:
    """OpenAI's usage object, with llama-server's cached-token count."""
    n_prompt, n_output = len(request.prompt), len(request.output)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_output,
        "total_tokens": n_prompt + n_output,
        "prompt_tokens_details": {"cached_tokens": request.timings.cache_n},
    }


def token_logprobs(items: list[TokenLogprob], n_top: int, token_piece: Callable[[int], bytes]) -> list[dict]:
    """``[{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}]`` per token
    (llama-server's ``probs_vector_to_json``, in both its dialects)."""

    def entry(token: int, logprob: float) -> dict:
        raw = token_piece(token)
        return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw), "logprob": logprob}

    return [entry(i.token, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top[:n_top]]} for i in items]


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

    def _choice(self, text: str | None, finish_reason: str | None, lp: dict | None, *, chunk: bool) -> dict:
        body: dict[str, Any]
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": lp, "finish_reason": finish_reason}

    # whole response

    def response(self, request: Request, pieces: list[Piece]) -> dict:
        text, items = "".join(p.text for p in pieces), [i for p in pieces for i in p.logprobs]
        choice = self._choice(text, request.finish_reason, self.logprobs(items), chunk=False)
        return self._envelope([choice], chunk=False, usage=usage(request), timings=request.timings.to_dict())

    # stream

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role (OpenAI does; clients expect it)."""
        if not self.chat:
            return []
        choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
        return [self._envelope([choice], chunk=True)]

    def chunk(self, request: Request, piece: Piece) -> dict:
        return self._envelope([self._choice(piece.text, None, self.logprobs(piece.logprobs), chunk=True)], chunk=True)

    def closing(self, request: Request, include_usage: bool) -> list[dict]:
        """The empty delta with ``finish_reason``, then the usage chunk if asked; timings ride on the last one."""
        chunks = [self._envelope([self._choice(None, request.finish_reason, None, chunk=True)], chunk=True)]
        if include_usage:
            chunks.append(self._envelope([], chunk=True, usage=usage(request)))
        chunks[-1]["timings"] = request.timings.to_dict()
        return chunks


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
    n_sent: int = 0  # tokens sent so far in the stream
    done = None  # llama-server ends a native stream without [DONE]

    def generation_settings(self, request: Request) -> dict:
        """The request's settings, as far as llmkit has them (task_params::to_json names and order)."""
        p = request.params
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
            "stop": p.stop,
            "max_tokens": p.max_tokens,
            "n_predict": p.max_tokens,
            "ignore_eos": p.ignore_eos,
            "stream": self.stream,
            "n_probs": request.n_probs,
            "grammar": p.grammar or "",
        }

    def final(self, request: Request, content: str, tokens: list[int], items: list[TokenLogprob]) -> dict:
        """The last object: totals, settings, why it stopped, timings (the whole answer, or a stream's end)."""
        body = {
            "index": 0,
            "content": content,
            "tokens": tokens,
            "id_slot": request.slot_id,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(request.output),
            "tokens_evaluated": len(request.prompt),
            "generation_settings": self.generation_settings(request),
            "prompt": self.prompt,
            "has_new_line": "\n" in request.text,
            "truncated": request.truncated,
            "stop_type": request.stop_type,
            "stopping_word": request.stopping_word,
            "tokens_cached": request.n_cached,
            "timings": request.timings.to_dict(),
        }
        if items and self.n_top is not None:
            body["completion_probabilities"] = token_logprobs(items, self.n_top, self.token_piece)
        return body

    def response(self, request: Request, pieces: list[Piece]) -> dict:
        """The whole answer: every token the model produced, the stop word's included (as llama-server)."""
        tokens = list(request.output) if self.return_tokens else []
        return self.final(request, "".join(p.text for p in pieces), tokens, [i for p in pieces for i in p.logprobs])

    def opening(self) -> list[dict]:
        return []

    def chunk(self, request: Request, piece: Piece) -> dict:
        """One piece of text and the tokens it came from (llama-server sends one chunk per token)."""
        self.n_sent += len(piece.tokens)
        body = {
            "index": 0,
            "content": piece.text,
            "tokens": piece.tokens,
            "stop": False,
            "id_slot": request.slot_id,
            "tokens_predicted": self.n_sent,
            "tokens_evaluated": len(request.prompt),
        }
        if self.n_top is not None:
            body["completion_probabilities"] = token_logprobs(piece.logprobs, self.n_top, self.token_piece)
        return body

    def closing(self, request: Request, include_usage: bool) -> list[dict]:
        """The totals, with empty content and tokens: the chunks carried them (no probabilities either)."""
        return [self.final(request, "", [], [])]
