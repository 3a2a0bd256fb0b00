"""Server-sent events: the framing every streamed answer shares, and what a dialect's wire format answers.

(~ llama-server's server-common.cpp ``format_oai_sse``, ``format_anthropic_sse``.) An event is a ``data:``
line and a blank line (``event``); the Responses and Messages APIs name theirs with an ``event:`` line
before it (``named_event``). A comment line (``PING``) keeps a quiet stream alive; OpenAI's streams end
with ``DONE``.

Each dialect (``server/dialects/``) has a ``WireFormat``: the JSON objects of one answer, whole or
streamed, which ``generation`` frames and sends.
"""

from __future__ import annotations

import json
from typing import Protocol

from llmkit.engine import Outcome, Piece, Request
from llmkit.server.errors import ApiError
from llmkit.server.tools import Delta, ToolCall

DONE = "data: [DONE]\n\n"  # the end of an OpenAI stream
PING = ":\n\n"  # an SSE comment: clients skip it, and their read timeout starts again (llama-server's)


def event(data: dict) -> str:
    """One server-sent event. Raw UTF-8 (no \\u escapes), compact, as llama-server sends it."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_event(data: dict) -> str:
    """One server-sent event named after its ``type`` (the Responses and Messages APIs): a client
    dispatches on the ``event:`` line before it parses the JSON (llama-server: format_anthropic_sse)."""
    return f"event: {data['type']}\n{event(data)}"


class Answer(Protocol):
    """What the answer's text was read as (``tools.CallParser``, ``tools.TextParser``): content, then calls."""

    content: str
    calls: list[ToolCall]


class WireFormat(Protocol):
    """What ``generation`` asks of a dialect's answer: the whole answer, or a stream's events (``opening``,
    ``chunk`` per piece of text, ``closing``; ``error`` after the 200, in the dialect's shape), each sent as
    ``frame`` makes it, then ``done`` if any. While it streams, a format reads the request's inputs and where
    it runs (``opening``, ``chunk``); how it ended, only from its ``Outcome`` (``response``, ``closing``).
    One per dialect: ``openai_chat.ChatFormatter``, ``openai_text.TextFormatter``, ``native.NativeFormatter``,
    ``responses.ResponsesFormatter``, ``messages.MessagesFormatter``."""

    @property
    def done(self) -> str | None: ...

    def frame(self, data: dict) -> str: ...
    def response(self, outcome: Outcome, pieces: list[Piece], answer: Answer) -> dict: ...
    def opening(self, request: Request) -> list[dict]: ...
    def chunk(self, request: Request, piece: Piece, deltas: list[Delta]) -> list[dict]: ...
    def closing(self, outcome: Outcome, answer: Answer) -> list[dict]: ...
    def error(self, exc: ApiError) -> list[dict]: ...
