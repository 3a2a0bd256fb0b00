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
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmkit.engine import Request
from llmkit.engine.request import TokenLogprob

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

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_urlsafe(24)

    def logprobs(self, items: list[TokenLogprob]) -> dict | None:
        """``{"content": [{id, token, bytes, logprob, top_logprobs}]}``: OpenAI chat's shape, which
        llama-server uses for both APIs; text completions also get OpenAI's legacy lists."""
        if self.n_top is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            raw = self.token_piece(token)
            return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw), "logprob": logprob}

        content = [entry(i.token, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top[: self.n_top]]} for i in items]
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
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": lp, "finish_reason": finish_reason}

    # whole response

    def response(self, text: str, finish_reason: str, usage: dict, timings: dict, items: list[TokenLogprob]) -> dict:
        choice = self._choice(text, finish_reason, self.logprobs(items), chunk=False)
        return self._envelope([choice], chunk=False, usage=usage, timings=timings)

    # stream

    def role_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role (OpenAI does; clients expect it)."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
        return self._envelope([choice], chunk=True)

    def chunk(self, text: str, items: list[TokenLogprob]) -> dict:
        return self._envelope([self._choice(text, None, self.logprobs(items), chunk=True)], chunk=True)

    def final_chunks(self, finish_reason: str, usage: dict, timings: dict, include_usage: bool) -> list[dict]:
        """The empty delta with ``finish_reason``, then the usage chunk if asked; timings ride on the last one."""
        chunks = [self._envelope([self._choice(None, finish_reason, None, chunk=True)], chunk=True)]
        if include_usage:
            chunks.append(self._envelope([], chunk=True, usage=usage))
        chunks[-1]["timings"] = timings
        return chunks
