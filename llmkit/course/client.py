"""Small HTTP helpers the notebooks, the CLI and the bench use: stream from either server and time every piece.

    r = stream_translation(seq.url, "Good morning", "French")
    r = stream_chat(slots.url, [{"role": "user", "content": "Hi"}], max_tokens=32)
    r.text, r.ttft, r.times                 # what arrived, and when
    results = concurrently(stream_chat, [(url, msgs)] * 8)   # 8 clients at once
    r = await astream(async_client, url + "/v1/chat/completions", body, chat_piece)   # the same, in asyncio
    r = await astream(async_client, url + "/v1/messages", body, messages_piece)       # Anthropic's named events

Both servers speak SSE; the events are parsed with httpx-sse, and one reader
(``_Reader``) turns them into a ``StreamResult`` for the blocking and the
asyncio paths alike. To see the bytes on the wire, a plain
``httpx.post(...).content`` is all it takes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource

TIMEOUT = httpx.Timeout(10.0, read=120.0)  # read: the longest wait between two chunks


@dataclass
class StreamResult:
    """One streamed response: its pieces, when each arrived, and the raw bytes."""

    status: int
    pieces: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds after the request was sent
    t_sent: float = 0.0  # time.perf_counter() when the request was sent (to line up several streams)
    t_done: float = 0.0
    final: dict | None = None  # the last JSON event: finish_reason, usage, timings (OpenAI streams)
    usage: dict | None = None  # the last usage the stream carried: chat's last chunk, a Response's, Anthropic's message_delta
    error: Any = None  # the "error" of an error event or of a non-200 answer's body

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float:
        """Time to first token, in seconds."""
        return self.times[0] if self.times else float("nan")

    @property
    def t_first(self) -> float:
        """time.perf_counter() when the first piece arrived (when the stream ended, if none did)."""
        return self.t_sent + self.times[0] if self.times else self.t_done

    @property
    def seconds(self) -> float:
        return self.t_done - self.t_sent

    @property
    def n_tokens(self) -> int:
        """Generated tokens: the server's own count if it sent one (any API's usage, llama-server's timings), else the number of pieces."""
        usage, timings = self.usage or {}, (self.final or {}).get("timings") or {}
        return usage.get("completion_tokens", usage.get("output_tokens", timings.get("predicted_n", len(self.pieces))))

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server reused from its cache, if it said so (OpenAI's usage, llama-server's timings)."""
        final = self.final or {}
        details = (final.get("usage") or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens", (final.get("timings") or {}).get("cache_n"))


OnPiece = Callable[[str], None]  # called with each piece as it arrives (a widget, a progress bar)
PieceOf = Callable[[Any], "str | None"]  # the text piece in one event's JSON, if any


def translation_piece(data: Any) -> str | None:
    """The sequential server's events: every one is a token's text as a JSON string."""
    return data if isinstance(data, str) else None


def chat_piece(chunk: Any) -> str | None:
    """An OpenAI chunk's text: the chat delta's content, or a text completion's text."""
    choices = (chunk.get("choices") or []) if isinstance(chunk, dict) else []
    if not choices:
        return None
    choice = choices[0]
    return (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")


def responses_piece(chunk: Any) -> str | None:
    """A Responses stream's text: the ``delta`` of a ``response.output_text.delta`` event (its data repeats its name as ``type``)."""
    return chunk.get("delta") if isinstance(chunk, dict) and chunk.get("type") == "response.output_text.delta" else None


def messages_piece(chunk: Any) -> str | None:
    """An Anthropic Messages stream's text: the ``text_delta`` of a ``content_block_delta`` event."""
    if not isinstance(chunk, dict) or chunk.get("type") != "content_block_delta":
        return None
    delta = chunk.get("delta") or {}
    return delta.get("text") if delta.get("type") == "text_delta" else None


class _Reader:
    """Fills a ``StreamResult`` from a response: its status, then one SSE event's data at a time."""

    def __init__(self, piece_of: PieceOf, on_piece: OnPiece | None, first_only: bool):
        self.piece_of, self.on_piece, self.first_only = piece_of, on_piece, first_only
        self.result = StreamResult(status=0, t_sent=time.perf_counter())

    def refused(self, response: httpx.Response) -> None:
        """A non-200 answer (already read): its error."""
        try:
            body = response.json()
        except ValueError:
            body = response.text
        self.result.error = body.get("error", body) if isinstance(body, dict) else body

    def event(self, data: str) -> bool:
        """Take one event's data; False when the stream is over ([DONE], an error event, or the first piece if that is all we want)."""
        if data == "[DONE]":
            return False
        value = json.loads(data)
        if isinstance(value, dict) and "error" in value:
            self.result.error = value["error"]
            return False
        if isinstance(value, dict):
            self.result.final = value
            response = value.get("response")  # a Response's usage is inside it
            usage = value.get("usage") or (response.get("usage") if isinstance(response, dict) else None)
            if isinstance(usage, dict):
                self.result.usage = usage
        piece = self.piece_of(value)
        if piece:
            self.result.pieces.append(piece)
            self.result.times.append(time.perf_counter() - self.result.t_sent)
            if self.on_piece is not None:
                self.on_piece(piece)
            return not self.first_only
        return True

    def done(self) -> StreamResult:
        self.result.t_done = time.perf_counter()
        return self.result


def stream(url: str, body: dict, piece_of: PieceOf, *, headers: dict | None = None, on_piece: OnPiece | None = None) -> StreamResult:
    """POST ``body`` to ``url`` and read the SSE answer to its end (blocking)."""
    with httpx.Client(timeout=TIMEOUT) as client:
        reader = _Reader(piece_of, on_piece, first_only=False)
        with client.stream("POST", url, json=body, headers=headers) as response:
            reader.result.status = response.status_code
            if response.status_code != 200:
                response.read()
                reader.refused(response)
            else:
                for event in EventSource(response).iter_sse():
                    if not reader.event(event.data):
                        break
    return reader.done()


async def astream(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    piece_of: PieceOf,
    *,
    headers: dict | None = None,
    on_piece: OnPiece | None = None,
    first_only: bool = False,
) -> StreamResult:
    """``stream`` in asyncio, on the caller's client (its limits and timeouts); ``first_only``: stop at the first piece."""
    reader = _Reader(piece_of, on_piece, first_only)
    async with client.stream("POST", url, json=body, headers=headers) as response:
        reader.result.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            reader.refused(response)
        else:
            async for event in EventSource(response).aiter_sse():
                if not reader.event(event.data):
                    break
    return reader.done()


def stream_translation(url: str, text: str, target_lang: str = "ja", *, on_piece: OnPiece | None = None) -> StreamResult:
    """POST /translate/stream on the sequential server: every event is one token as a JSON string."""
    return stream(f"{url}/translate/stream", {"text": text, "target_lang": target_lang}, translation_piece, on_piece=on_piece)


def stream_chat(
    url: str, messages: list[dict], *, api_key: str | None = None, on_piece: OnPiece | None = None, **params: Any
) -> StreamResult:
    """POST /v1/chat/completions with stream=true on any OpenAI-compatible server."""
    body = {"model": "default", "messages": messages, "stream": True, "stream_options": {"include_usage": True}, **params}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return stream(f"{url}/v1/chat/completions", body, chat_piece, headers=headers, on_piece=on_piece)


def concurrently(fn: Callable[..., StreamResult], calls: list[tuple], *, stagger: float = 0.0) -> list[StreamResult]:
    """Run ``fn(*args)`` for every args tuple at the same time (one thread each), in order.

    ``stagger`` delays the i-th call by i * stagger seconds: a late request
    joining a batch that is already running.
    """
    start = threading.Barrier(len(calls))

    def run(i: int, args: tuple) -> StreamResult:
        start.wait()
        time.sleep(i * stagger)
        return fn(*args)

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(run, range(len(calls)), calls))


def aggregate_tokens_per_second(results: list[StreamResult]) -> float:
    """All tokens generated by the streams over the wall time from the first send to the last end."""
    wall = max(r.t_done for r in results) - min(r.t_sent for r in results)
    return sum(r.n_tokens for r in results) / wall
