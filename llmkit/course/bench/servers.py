"""The servers a bench run talks to: the sequential server and any OpenAI-compatible one, started here or given by URL.

Each kind knows its request (``request``), how to read its stream
(``piece_of``: the shared SSE reader of ``llmkit.course.client`` does the rest), how
to ask for a first token behind a long shared prefix (``prefixed``), and
whether it has ``/metrics`` to scrape. An OpenAI-compatible server that also
speaks the Responses and Messages APIs (the slot server, llama-server) is seen
through either of them as ``ResponsesServer`` or ``MessagesServer`` (``through``):
the same requests, in that API's body, read from its named events.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from llmkit.course import client, launch
from llmkit.course.bench.config import NO_BUDGET, SMALL_BATCH, SMALL_BATCH_FLAGS, BenchError, Config
from llmkit.course.bench.prompts import LANG, chat_prompt
from llmkit.course.client import StreamResult


@dataclass
class Server:
    name: str
    url: str
    pid: int | None = None  # set for a server started here (the soak samples its memory)

    path: ClassVar[str]

    @staticmethod
    def piece_of(data: Any, /) -> str | None:
        """The text of one SSE event's JSON (``client.translation_piece`` or ``client.chat_piece``)."""
        raise NotImplementedError

    def request(self, text: str, max_tokens: int, *, cache_prompt: bool = True) -> dict:
        """The JSON body of one streamed request that translates ``text``."""
        raise NotImplementedError

    async def stream(self, http: httpx.AsyncClient, body: dict, **options: Any) -> StreamResult:
        """Send one streamed request and read it to the end (``first_only``: to its first piece); errors raise ``BenchError``."""
        result = await client.astream(http, self.url + self.path, body, type(self).piece_of, **options)
        if result.status != 200:
            raise BenchError(f"{self.name}: HTTP {result.status}: {str(result.error)[:300]}")
        if result.error is not None:
            raise BenchError(f"{self.name}: error in the stream: {result.error}")
        return result

    async def translate(
        self, http: httpx.AsyncClient, text: str, max_tokens: int, *, cache_prompt: bool = True, **options: Any
    ) -> StreamResult:
        """``stream`` of ``request(text, max_tokens)``."""
        return await self.stream(http, self.request(text, max_tokens, cache_prompt=cache_prompt), **options)

    async def prefixed(self, http: httpx.AsyncClient, prefix: str, question: str) -> StreamResult:
        """The first token of a request that starts with a long ``prefix`` (prefix reuse)."""
        raise NotImplementedError

    async def scrape(self, http: httpx.AsyncClient) -> dict[str, float] | None:
        """``/metrics`` as {sample name: value}, or None if the server does not expose it."""
        return None


class SequentialServer(Server):
    """``POST /translate/stream``: each event is one token's text; no max_tokens (the server was started with -n)."""

    path = "/translate/stream"
    piece_of = staticmethod(client.translation_piece)

    def request(self, text: str, max_tokens: int, *, cache_prompt: bool = True) -> dict:
        return {"text": text, "target_lang": LANG}

    async def prefixed(self, http: httpx.AsyncClient, prefix: str, question: str) -> StreamResult:
        # no system prompt here: the long prefix itself is translated (the server clears its cache every time)
        return await self.stream(http, self.request(prefix, 1), first_only=True)


class OpenAIServer(Server):
    """``POST /v1/chat/completions``: greedy, ``ignore_eos`` (every stream generates exactly max_tokens), usage in the last chunk."""

    api: ClassVar[str] = "chat"
    path = "/v1/chat/completions"
    piece_of = staticmethod(client.chat_piece)

    def request(self, text: str, max_tokens: int, *, cache_prompt: bool = True, system: str | None = None) -> dict:
        """With a ``system`` prompt, ``text`` is sent as it is, as the user's question."""
        body = self.body(chat_prompt(text) if system is None else text, max_tokens, system)
        if not cache_prompt:
            body["cache_prompt"] = False  # llama-server's field: the Messages API has no place for it (both servers drop it)
        return body

    def body(self, question: str, max_tokens: int, system: str | None = None) -> dict:
        """One greedy streamed request: ``question`` as the user's message, after a ``system`` prompt if any."""
        messages = [{"role": "user", "content": question}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return {
            "model": "default",
            "messages": messages,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }

    def chat_request(self, messages: list[dict], max_tokens: int) -> dict:
        """A greedy streamed request for a whole chat."""
        return {"model": "default", "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0}

    async def prefixed(self, http: httpx.AsyncClient, prefix: str, question: str) -> StreamResult:
        return await self.stream(http, self.request(question, 1, system=prefix))

    async def scrape(self, http: httpx.AsyncClient) -> dict[str, float] | None:
        from prometheus_client.parser import text_string_to_metric_families

        with contextlib.suppress(httpx.HTTPError):
            r = await http.get(f"{self.url}/metrics")
            if r.status_code == 200:
                return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
        return None


class ResponsesServer(OpenAIServer):
    """``POST /v1/responses``: the same request as chat's (the question as ``input``, the system prompt as ``instructions``,
    ``max_output_tokens``, ``ignore_eos``: both servers take llama-server's fields here); text in ``response.output_text.delta``
    events, usage in ``response.completed``."""

    api = "responses"
    path = "/v1/responses"
    piece_of = staticmethod(client.responses_piece)

    def body(self, question: str, max_tokens: int, system: str | None = None) -> dict:
        body = {"model": "default", "input": question, "stream": True, "max_output_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return body if system is None else {"instructions": system, **body}


class MessagesServer(OpenAIServer):
    """``POST /v1/messages``: the same request as chat's in Anthropic's body, which has no ``ignore_eos`` (both servers
    drop it): a stream ends at the budget only if the answer runs that long, and its tokens are counted from the usage
    of ``message_delta``. Text in ``content_block_delta`` events."""

    api = "messages"
    path = "/v1/messages"
    piece_of = staticmethod(client.messages_piece)

    def body(self, question: str, max_tokens: int, system: str | None = None) -> dict:
        body = {"model": "default", "messages": [{"role": "user", "content": question}], "stream": True, "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip
        return body if system is None else {"system": system, **body}


APIS: dict[str, type[OpenAIServer]] = {kind.api: kind for kind in (OpenAIServer, ResponsesServer, MessagesServer)}


def through(server: Server, api: str) -> OpenAIServer:
    """``server`` (the slot server, llama-server) seen through one of its chat APIs: "chat", "responses" or "messages"."""
    return APIS[api](server.name, server.url, server.pid)


def http_client(connections: int, *, keepalive: bool = True) -> httpx.AsyncClient:
    """``keepalive=False``: a new connection per request. llama-server closes its connection after every stream (while
    its headers say keep-alive), so a request sent right after one ends can take a connection that is closing."""
    limits = httpx.Limits(max_connections=connections + 2, max_keepalive_connections=(connections + 2) * keepalive)
    return httpx.AsyncClient(timeout=httpx.Timeout(30, read=600), limits=limits)


def server_flags(cfg: Config) -> list[str]:
    """Flags of every server started here: greedy, and the bench's threads and model."""
    return ["--temp", "0", "--seed", "1", *(["-t", str(cfg.threads)] if cfg.threads else []), *(["-m", cfg.model] if cfg.model else [])]


def slot_flags(cfg: Config) -> list[str]:
    """Flags of the slot servers and llama-servers started together: ``max(concurrency)`` slots of ``ctx_per_slot`` tokens
    (explicit -np: one KV stream per slot), with ``/metrics``."""
    n = max(cfg.concurrency)
    return [*server_flags(cfg), "-np", str(n), "-c", str(n * cfg.ctx_per_slot), "--metrics"]


def start_servers(cfg: Config, stack: contextlib.ExitStack) -> list[Server]:
    """Our two servers and the real llama-server (built from the same llama.cpp, same flags) as child
    processes on free ports, unless skipped; then the --url ones."""
    common = server_flags(cfg)
    servers: list[Server] = []
    if "sequential" not in cfg.skip:
        p = stack.enter_context(launch.serve("sequential", *common, "-n", str(cfg.max_tokens)))
        servers.append(SequentialServer("sequential", p.url, pid=p.process.pid))
    for name, skip, kind, extra in (
        ("slots", "slots", "slots", []),
        (NO_BUDGET, "no-budget", "slots", ["--step-tokens", "0"]),  # only -b (2048) caps a step, as llama-server's default
        ("llama-server", "llama-server", "llama-server", []),
    ):
        if skip not in cfg.skip:
            p = stack.enter_context(launch.serve(kind, *slot_flags(cfg), *extra))
            servers.append(OpenAIServer(name, p.url, pid=p.process.pid))
    for name, url in cfg.urls.items():
        servers.append(OpenAIServer(name, url.rstrip("/").removesuffix("/v1")))
    return servers


def start_small_batch(cfg: Config, stack: contextlib.ExitStack) -> list[Server]:
    """llama-server with ``-b`` and ``-ub`` at the slot server's step budget, for the arrivals scenario (none if
    llama-server is skipped). llama-server caps every step at ``-b`` tokens (``pre_decode``), the slot server only
    the steps that carry a running stream: beside a stream, the two read a burst of prompts alike."""
    if "llama-server" in cfg.skip:
        return []
    p = stack.enter_context(launch.serve("llama-server", *slot_flags(cfg), *SMALL_BATCH_FLAGS.split()))
    return [OpenAIServer(SMALL_BATCH, p.url, pid=p.process.pid)]
