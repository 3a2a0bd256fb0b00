"""What OpenAI's two completion dialects share (``openai_chat``, ``openai_text``): the envelope of every answer and
chunk, usage, the end's reason, and the logprobs of a token (which llama-server's own ``native`` writes too).

(~ llama-server's server-task.cpp ``to_json_oaicompat*``, ``usage_json_oaicompat``, ``probs_vector_to_json``.)
One ``OpenAIFormatter`` builds every JSON object of one answer, whole or streamed; ``ChatFormatter`` and
``TextFormatter`` say only what differs: the object names, the body of a choice, a delta, the logprobs' shape.
A stream is:

    data: {... "delta": {"role": "assistant", "content": null} ...}   (chat only)
    data: {... "delta": {"content": "Hel"} ...}                       one per text piece (text: {"text": "Hel"})
    data: {... "delta": {}, "finish_reason": "stop"}
    data: {... "choices": [], "usage": {...}}                         with stream_options.include_usage
    data: [DONE]
"""

from __future__ import annotations

import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from llmkit.engine import End, Outcome, Piece, Request
from llmkit.engine.request import TokenLogprob
from llmkit.server.errors import LLAMA_SERVER, ApiError
from llmkit.server.protocol import GenerationRequest
from llmkit.server.sse import DONE, Answer, event
from llmkit.server.state import SYSTEM_FINGERPRINT, ServerState
from llmkit.server.tools import Delta

FINISH_REASON = {End.EOS: "stop", End.WORD: "stop", End.LIMIT: "length", End.CANCELLED: "cancelled"}  # how an answer ended


def usage(outcome: Outcome) -> dict:
    """OpenAI's usage object, with llama-server's cached-token count."""
    return {
        "prompt_tokens": outcome.n_prompt,
        "completion_tokens": outcome.n_output,
        "total_tokens": outcome.n_prompt + outcome.n_output,
        "prompt_tokens_details": {"cached_tokens": outcome.n_cached},
    }


def finish_reason(outcome: Outcome, answer: Answer) -> str:
    """Why the answer ended, in OpenAI's words: ``tool_calls`` when it ended with calls."""
    reason = FINISH_REASON[outcome.end]
    return "tool_calls" if answer.calls and reason == "stop" else reason


def token_logprobs(items: list[TokenLogprob], n_top: int, token_piece: Callable[[int], bytes]) -> list[dict]:
    """``[{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}]`` per token
    (llama-server's ``probs_vector_to_json``, in both its dialects)."""

    def entry(token: int, logprob: float) -> dict:
        raw = token_piece(token)
        return {"id": token, "token": raw.decode("utf-8", "ignore"), "bytes": list(raw), "logprob": logprob}

    return [entry(i.token, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top[:n_top]]} for i in items]


@dataclass
class OpenAIFormatter(ABC):
    """The JSON objects of one OpenAI completion answer; a dialect's subclass fills in what differs."""

    model: str
    system_fingerprint: str
    n_top: int | None = None  # alternatives per token in ``logprobs``; None: no logprobs
    token_piece: Callable[[int], bytes] = bytes  # token id -> its bytes (Model.token_to_piece)
    include_usage: bool = False  # a stream ends with a usage chunk (stream_options.include_usage)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    done = DONE  # the stream's last line
    frame = staticmethod(event)

    ID_PREFIX: ClassVar[str]  # "chatcmpl-", "cmpl-"
    OBJECT: ClassVar[str]  # a whole answer's "object"
    CHUNK_OBJECT: ClassVar[str]  # a stream chunk's
    END: ClassVar[dict]  # the body of the stream's last choice, beside its finish_reason

    def __post_init__(self) -> None:
        self.id = self.id or self.ID_PREFIX + secrets.token_urlsafe(24)

    @abstractmethod
    def body(self, answer: Answer) -> dict:
        """A whole answer's choice, beside its index, logprobs and finish_reason."""

    @abstractmethod
    def delta(self, d: Delta) -> dict:
        """A stream chunk's choice for one delta."""

    def logprobs(self, items: list[TokenLogprob]) -> dict | None:
        """``{"content": [{id, token, bytes, logprob, top_logprobs}]}``: OpenAI chat's shape, which llama-server uses
        for both dialects (None: not asked for)."""
        return None if self.n_top is None else {"content": token_logprobs(items, self.n_top, self.token_piece)}

    def _envelope(self, choices: list[dict], *, chunk: bool, **extra: object) -> dict:
        return {
            "id": self.id,
            "object": self.CHUNK_OBJECT if chunk else self.OBJECT,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            **extra,
        }

    def _choice(self, body: dict, finish_reason: str | None = None, lp: dict | None = None) -> dict:
        return {"index": 0, **body, "logprobs": lp, "finish_reason": finish_reason}

    # whole response

    def response(self, outcome: Outcome, pieces: list[Piece], answer: Answer) -> dict:
        items = [i for p in pieces for i in p.logprobs]
        choice = self._choice(self.body(answer), finish_reason(outcome, answer), self.logprobs(items))
        return self._envelope([choice], chunk=False, usage=usage(outcome), timings=outcome.timings.to_dict())

    # stream

    def opening(self, request: Request) -> list[dict]:
        return []

    def chunk(self, request: Request, piece: Piece, deltas: list[Delta]) -> list[dict]:
        """A chunk per delta; the piece's logprobs ride on the last."""
        chunks = [self._envelope([self._choice(self.delta(d))], chunk=True) for d in deltas]
        if chunks and piece.logprobs:
            chunks[-1]["choices"][0]["logprobs"] = self.logprobs(piece.logprobs)
        return chunks

    def closing(self, outcome: Outcome, answer: Answer) -> list[dict]:
        """The last choice with ``finish_reason``, then the usage chunk if asked; timings ride on the last one."""
        chunks = [self._envelope([self._choice(self.END, finish_reason(outcome, answer))], chunk=True)]
        if self.include_usage:
            chunks.append(self._envelope([], chunk=True, usage=usage(outcome)))
        chunks[-1]["timings"] = outcome.timings.to_dict()
        return chunks

    def error(self, exc: ApiError) -> list[dict]:
        """A failure after the 200 was sent: the error's body, as one more event."""
        return [LLAMA_SERVER.body(exc)]


F = TypeVar("F", bound=OpenAIFormatter)


def openai_formatter(cls: type[F], state: ServerState, body: GenerationRequest) -> F:
    """The formatter of an answer to ``body`` (its logprobs, its usage chunk) on this server."""
    return cls(state.model_name, SYSTEM_FINGERPRINT, body.n_top_logprobs(), state.engine.model.token_to_piece, body.include_usage)
