"""Disaggregated prefill and decode through vllm-router's PD mode: one worker reads the prompt, another generates, and
the prompt's KV cells move from the first to the second. llama-server has none of this; vLLM moves its blocks with a
KV connector (NIXL), whose handshake travels in the request's ``kv_transfer_params``: llmkit keeps that handshake and
moves the cells over HTTP.

    vllm-router --vllm-pd-disaggregation --prefill http://P --decode http://D ...    (both: llmkit serve slots)

What the router does (vllm-router 0.1.17, ``routers/http/vllm_pd_router.rs``, the default ``nixl`` connector) and
what each worker does here:

1. the router sends the client's body to P with ``max_tokens`` 1, ``stream`` off and ``"kv_transfer_params":
   {"do_remote_decode": true, ...}``. P reads the prompt and samples the first token, as any request
   (``RequestParams.hand_off``: the slot's KV cells go into the outcome), keeps the cells under an id for ``TTL``
   seconds (``Handoffs``), and answers as usual plus ``"kv_transfer_params": {"do_remote_prefill": true,
   "remote_host", "remote_port", "remote_block_ids": [id], "remote_engine_id", "first_tokens", "tokens_sha256"}``;
2. the router copies that object, as it is, into the client's own body and sends it to D (streamed or not, as the
   client asked); it answers the client with D's answer;
3. D fetches the cells, ``GET http://remote_host:remote_port/kv_handoff/{id}`` (once: P then forgets them), checks
   they are this prompt's (``tokens_sha256``), and starts the request from them (``Engine.submit(kv=)``): P's first
   token is the answer's first, and D decodes from there. So the text is the one a single server gives.

D connects only to the prefill workers it was told of (``--pd-peers``; ``llmkit fleet`` passes them): the address is
in the request's body, which any client of D can write, so a body naming another host or port, or an id that is not
one P makes, is a 400 and no connection is made. A decode worker that cannot get the cells from its peer (expired, P
gone, another KV layout) reads the prompt itself: the answer is the same, later; a warning in its log says why. Both
workers must run the same model with the same KV layout (``-np``, ``-kvu``): llama.cpp refuses cells of another
layout, and D then reads the prompt.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import struct
import threading
import time
from collections.abc import Collection
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from llmkit.engine import Request as EngineRequest
from llmkit.engine.request import KVState
from llmkit.server.errors import ApiError

log = logging.getLogger("llmkit.server")
router = APIRouter()

TTL = 60.0  # seconds a prefill worker keeps cells for their decode worker
MAX_BYTES = 1 << 30  # cells kept at most at once, in bytes (the oldest go first): SmolLM2-135M's are 23 KB a token
FETCH_TIMEOUT = 30.0
KEY = re.compile(r"kv-\d+-\d+")  # the ids ``Handoffs.put`` makes: nothing else is fetched


def tokens_sha256(tokens: list[int]) -> str:
    """A prompt's fingerprint: both workers render the same body with the same model, so the same tokens."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


class Handoffs:
    """A prefill worker's cells waiting for their decode worker, by id: each taken once, or dropped after ``ttl``
    seconds, or when newer ones need the room (``max_bytes``). Safe across threads: answers are offered on the event
    loop and taken in the thread pool."""

    def __init__(self, ttl: float = TTL, max_bytes: int = MAX_BYTES):
        self.ttl, self.max_bytes = ttl, max_bytes
        self.kept: dict[str, tuple[KVState, float]] = {}  # oldest first
        self.ids = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, kv: KVState) -> str:
        with self._lock:
            self._expire()
            while self.kept and sum(len(k.cells) for k, _ in self.kept.values()) + len(kv.cells) > self.max_bytes:
                del self.kept[next(iter(self.kept))]
            key = f"kv-{next(self.ids)}-{time.time_ns()}"
            self.kept[key] = (kv, time.monotonic() + self.ttl)
            return key

    def take(self, key: str) -> KVState | None:
        with self._lock:
            self._expire()
            kept = self.kept.pop(key, None)
            return kept[0] if kept is not None else None

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [key for key, (_, deadline) in self.kept.items() if deadline < now]:
            del self.kept[key]


def handoffs(request: Request) -> Handoffs:
    """The app's kept cells (``app.py`` makes them): a route's dependency."""
    return request.app.state.handoffs


HandoffsDep = Annotated[Handoffs, Depends(handoffs)]


def transfer_params(body: Any) -> dict[str, Any]:
    """The request's ``kv_transfer_params`` ({} when there are none: not a PD request)."""
    params = getattr(body, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def hands_off(body: Any) -> bool:
    """A prefill worker's request: keep the slot's cells for a decode worker."""
    return bool(transfer_params(body).get("do_remote_decode"))


def offer(http_request: Request, prompt: list[int], request: EngineRequest, answer: Any) -> Any:
    """(Prefill worker.) The answer, with where its decode worker fetches the cells (``kv_transfer_params``): this
    server's address as the router reached it."""
    kv = request.outcome.kv if request.outcome is not None else None
    if kv is None or not kv.output or not isinstance(answer, dict):  # ended before a token (an end of generation first)
        return answer
    key = handoffs(http_request).put(kv)
    host, port = http_request.url.hostname, http_request.url.port
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"llmkit@{host}:{port}",
        "remote_block_ids": [key], "remote_host": host, "remote_port": port,
        "first_tokens": list(kv.output), "tokens_sha256": tokens_sha256(prompt), "n_bytes": len(kv.cells),
    }  # fmt: skip
    return answer | {"kv_transfer_params": params}


def peer(url: str) -> tuple[str, int]:
    """A prefill worker's ``(host, port)`` from its URL (``--pd-peers http://127.0.0.1:8081``)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path.strip("/"):
        raise ValueError(f"a prefill peer is http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


def source(params: dict[str, Any], peers: Collection[tuple[str, int]]) -> str:
    """The URL of the cells ``params`` names, if a peer keeps them; else a 400 that says why (no connection made)."""
    try:
        host, port, (key,) = params["remote_host"], params["remote_port"], params["remote_block_ids"]
    except (KeyError, TypeError, ValueError):
        raise ApiError(400, "kv_transfer_params needs remote_host, remote_port and one remote_block_ids entry") from None
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise ApiError(400, f"kv_transfer_params.remote_block_ids: {key!r} is not an id a prefill worker gives")
    if isinstance(port, bool) or not isinstance(port, int) or (host, port) not in peers:
        told = ", ".join(f"{h}:{p}" for h, p in sorted(peers)) or "none (start it with --pd-peers)"
        raise ApiError(400, f"kv_transfer_params names {host!r} port {port!r}, not a prefill worker of this server's: {told}")
    return f"http://{host}:{port}/kv_handoff/{quote(key, safe='')}"


async def fetch(body: Any, prompt: list[int], peers: Collection[tuple[str, int]]) -> KVState | None:
    """(Decode worker.) The cells its prefill worker kept for this prompt; None (the prompt is read here) if there are
    none to fetch, or they cannot be had: the reason is logged. Cells from anywhere but ``peers``: a 400."""
    params = transfer_params(body)
    if not params.get("do_remote_prefill"):
        return None
    url = source(params, peers)
    try:
        first = [int(t) for t in params["first_tokens"]]
        if params["tokens_sha256"] != tokens_sha256(prompt) or not first:
            raise ValueError("the cells are not this prompt's")
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=False) as client:
            fetched = await client.get(url)
        fetched.raise_for_status()
    except (KeyError, TypeError, ValueError, httpx.HTTPError) as exc:
        log.warning("disaggregated decode: no KV cells from the prefill worker (%s); reading the prompt here", exc or type(exc).__name__)
        return None
    log.info("disaggregated decode: %d bytes of KV cells for %d tokens from %s in %.0f ms", len(fetched.content), len(prompt),
             url, fetched.elapsed.total_seconds() * 1e3)  # fmt: skip
    return KVState((*prompt, *first[:-1]), tuple(first), bytearray(fetched.content))


@router.get("/kv_handoff/{key}")
def kv_handoff(key: str, kept: HandoffsDep) -> Response:
    """The KV cells kept for a decode worker, once (llama_state_seq_get_data's bytes)."""
    kv = kept.take(key)
    if kv is None:
        raise ApiError(404, f"no KV cells under {key!r}: taken already, expired (kept {TTL:.0f} s), or never made here")
    return Response(bytes(kv.cells), media_type="application/octet-stream")
