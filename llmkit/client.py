"""Small HTTP helpers the notebooks use: stream from either server and time every piece.

    r = stream_translation(seq.url, "Good morning", "French")
    r = stream_chat(slots.url, [{"role": "user", "content": "Hi"}], max_tokens=32)
    r.text, r.ttft, r.times                 # what arrived, and when
    results = concurrently(stream_chat, [(url, msgs)] * 8)   # 8 clients at once

Both servers speak SSE; the events are parsed with httpx-sse. To see the
bytes on the wire, a plain ``httpx.post(...).content`` is all it takes.
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
    error: Any = None  # the "error" of an error event or of a non-200 answer's body

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float:
        """Time to first token, in seconds."""
        return self.times[0] if self.times else float("nan")

    @property
    def seconds(self) -> float:
        return self.t_done - self.t_sent

    @property
    def n_tokens(self) -> int:
        """Generated tokens: the server's own count when it sent usage, else the number of pieces."""
        usage = (self.final or {}).get("usage") or {}
        return usage.get("completion_tokens", len(self.pieces))


OnPiece = Callable[[str], None]  # called with each piece as it arrives (a widget, a progress bar)


def _stream(url: str, body: dict, piece_of: Callable[[Any], str | None], headers: dict | None = None, on_piece: OnPiece | None = None) -> StreamResult:
    result = StreamResult(status=0)
    with httpx.Client(timeout=TIMEOUT) as client:
        result.t_sent = time.perf_counter()
        with client.stream("POST", url, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                response.read()
                body = response.json()
                result.error = body.get("error", body) if isinstance(body, dict) else body
                result.t_done = time.perf_counter()
                return result
            for event in EventSource(response).iter_sse():
                if event.data == "[DONE]":
                    break
                data = json.loads(event.data)
                if isinstance(data, dict) and "error" in data:
                    result.error = data["error"]
                    break
                piece = piece_of(data)
                if isinstance(data, dict):
                    result.final = data
                if piece:
                    result.pieces.append(piece)
                    result.times.append(time.perf_counter() - result.t_sent)
                    if on_piece is not None:
                        on_piece(piece)
    result.t_done = time.perf_counter()
    return result


def stream_translation(url: str, text: str, target_lang: str = "ja", *, on_piece: OnPiece | None = None) -> StreamResult:
    """POST /translate/stream on the sequential server: every event is one token as a JSON string."""
    return _stream(f"{url}/translate/stream", {"text": text, "target_lang": target_lang}, lambda data: data, on_piece=on_piece)


def _delta(chunk: dict) -> str | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    return (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")


def stream_chat(url: str, messages: list[dict], *, api_key: str | None = None, **params: Any) -> StreamResult:
    """POST /v1/chat/completions with stream=true on any OpenAI-compatible server."""
    body = {"model": "default", "messages": messages, "stream": True, "stream_options": {"include_usage": True}, **params}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return _stream(f"{url}/v1/chat/completions", body, _delta, headers)


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
