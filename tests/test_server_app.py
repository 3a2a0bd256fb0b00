"""The slot server's HTTP layer in this process, over a scripted engine: the states a real model
cannot be asked for on demand (still loading, failed to load, failing mid-stream, a crashing route).

The fake engine answers ``submit`` with a real ``llmkit.engine.Request`` whose
pieces and ending are written in advance, so every byte the app sends is
its own; no model is loaded.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from llmkit.course import launch
from llmkit.engine import Counters, End, EngineConfig, EngineError, EngineStatus, Outcome, Piece, Request, SlotStatus
from llmkit.server import Settings, create_app
from llmkit.server.handoff import tokens_sha256
from llmkit.server.state import ServingEngine
from llmkit.timings import Timings

from helpers import wait_until

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}


class FakeModel:
    n_vocab = 100
    path = Path("fake.gguf")
    chat_template = "<role>content"

    def tokenize(self, text: str, **_: object) -> list[int]:
        return [1] * max(1, len(text.split()))

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return [1, 2, 3]

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        return b"x"

    def detokenize(self, tokens: list[int]) -> str:
        return "x" * len(tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def ends(request: Request, end: End) -> None:
    """The engine's last word on ``request``: it ended, with nothing generated."""
    request.finish(Outcome(end, (), len(request.prompt), 0, Timings(), id_slot=request.id_slot))


class FakeEngine:
    """``submit`` runs ``script(request)`` at once: the request's events are queued before anyone reads."""

    def __init__(self, script: Callable[[Request], None] = lambda r: ends(r, End.EOS), *, starts: bool = True):
        self.model = FakeModel()
        self.script = script
        self.starts = starts  # whether a request gets a slot (else the script ends it before it starts)
        self.closed = False
        self.kv_events = None  # it makes no KV events

    def submit(self, prompt, params=None, kv=None) -> Request:
        request = Request(prompt, params, kv)
        if self.starts:
            request.start(0, n_cached=0)
        self.script(request)
        return request

    def status(self) -> EngineStatus:
        return EngineStatus(EngineConfig(n_parallel=1, n_ctx=64).resolved(), (SlotStatus(0, 64, 0, 0, None),), (), Counters(), None)

    def close(self) -> None:
        self.closed = True


def test_the_fake_is_an_engine_as_the_routes_see_it():
    assert isinstance(FakeEngine(), ServingEngine)


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """uvicorn in a thread; unlike ``launch.serve_app``, does not wait for /health to say 200."""
    port = launch.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=launch.HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://{launch.HOST}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def events(r: httpx.Response) -> list:
    return [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]


def test_503_while_the_model_loads_then_ok():
    loaded = threading.Event()
    app = create_app(lambda: (loaded.wait(10), FakeEngine())[1], Settings(alias="fake"))
    with running(app) as url:
        for path in ("/health", "/v1/models"):
            r = httpx.get(url + path)
            assert r.status_code == 503
            assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        loaded.set()
        launch.wait_healthy(url, 5)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert app.state.server.engine.closed  # the app loaded it: the app closes it


def test_a_model_that_fails_to_load_is_a_500():
    go = threading.Event()

    def fail() -> FakeEngine:
        go.wait(10)
        raise RuntimeError("not a GGUF file")

    with running(create_app(fail)) as url:
        assert httpx.get(url + "/health").status_code == 503  # still loading
        go.set()
        deadline = time.monotonic() + 10
        while (r := httpx.get(url + "/health")).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.status_code == 500 and r.json()["error"]["message"] == "The model failed to load: not a GGUF file"
        assert httpx.get(url + "/v1/models").status_code == 500  # every path, from then on


def test_an_unexpected_exception_is_a_json_500_and_the_server_keeps_serving():
    app = create_app(FakeEngine(), Settings(alias="fake"))

    @app.get("/boom")
    async def boom() -> None:
        raise ZeroDivisionError("division by zero")

    with launch.serve_app(app) as url:
        r = httpx.get(url + "/boom")
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "server_error" and "ZeroDivisionError" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200


def test_a_request_that_fails_to_start_is_an_http_error_even_streamed():
    engine = FakeEngine(lambda r: r.fail(EngineError("saving the slot's prompt failed")), starts=False)
    with launch.serve_app(create_app(engine, Settings(alias="fake"))) as url:
        for stream in (True, False):
            r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 500 and r.headers["content-type"] == "application/json"
            assert r.json() == {"error": {"code": 500, "message": "saving the slot's prompt failed", "type": "server_error"}}


def test_once_started_a_stream_is_a_200_and_an_error_before_the_first_token_comes_inside_it():
    """As llama-server: the status line goes out when a slot takes the request (its "begin" result), before the prompt."""
    engine = FakeEngine(lambda r: r.fail(EngineError("llama_decode failed")))
    with launch.serve_app(create_app(engine, Settings(alias="fake"))) as url:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert [json.loads(e) for e in events(r)] == [{"error": {"code": 500, "message": "llama_decode failed", "type": "server_error"}}]
        whole = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream": False})
        assert whole.status_code == 500 and whole.json()["error"]["message"] == "llama_decode failed"


def test_a_quiet_stream_gets_pings_until_its_first_piece():
    def script(r: Request) -> None:  # the prompt takes 1.6 s to read
        threading.Timer(1.6, lambda: (r.emit(Piece("Hi", [1])), ends(r, End.EOS))).start()

    with launch.serve_app(create_app(FakeEngine(script), Settings(alias="fake", sse_ping_interval=1))) as url:
        quiet = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(5, read=1.4))  # each wait under 1.6 s
        never = httpx.post(url + "/v1/chat/completions", json={**CHAT, "sse_ping_interval": -1})
    assert quiet.text.startswith(":\n\ndata: ") and events(quiet)[-1] == "[DONE]"  # one ping, then the answer
    assert not never.text.startswith(":")


def test_an_engine_error_after_the_first_token_ends_the_stream_with_an_error_event():
    def script(r: Request) -> None:
        r.emit(Piece("Hel", [1]))
        r.fail(EngineError("llama_decode failed"))

    with launch.serve_app(create_app(FakeEngine(script), Settings(alias="fake"))) as url:
        r = httpx.post(url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        _role, piece, error = events(r)  # no final chunk, no [DONE]
        assert json.loads(piece)["choices"][0]["delta"] == {"content": "Hel"}
        assert json.loads(error) == {"error": {"code": 500, "message": "llama_decode failed", "type": "server_error"}}


def test_a_stream_with_no_text_still_has_every_frame():
    with launch.serve_app(create_app(FakeEngine(), Settings(alias="fake"))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})
        role, final, usage, done = events(r)
        assert json.loads(role)["choices"][0]["delta"]["role"] == "assistant"
        assert json.loads(final)["choices"][0] | {"delta": {}} == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        assert json.loads(usage)["usage"]["completion_tokens"] == 0 and done == "[DONE]"


@pytest.mark.parametrize("body", [{"prompt": "a b c"}, {"prompt": [5, 6]}, {"prompt": ["a b"]}, {"prompt": [[5, 6]]}])
def test_completion_prompt_forms(body):
    seen = []
    engine = FakeEngine(lambda r: (seen.append(r.prompt), ends(r, End.EOS)))
    with launch.serve_app(create_app(engine, Settings(alias="fake"))) as url:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    assert seen == [[1, 1, 1] if body["prompt"] == "a b c" else [5, 6] if body["prompt"] in ([5, 6], [[5, 6]]) else [1, 1]]


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b'{"a": ' * 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/embeddings", "/tokenize"])
def test_a_body_nested_100_000_deep_is_a_400(path, content):
    with launch.serve_app(create_app(FakeEngine(), Settings(alias="fake"))) as url:
        r = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["code"] == 400 and error["message"].startswith("Invalid JSON: RecursionError: maximum recursion depth exceeded"), error
        assert httpx.get(url + "/health").status_code == 200


def test_a_lone_surrogate_in_a_message_is_a_400():
    with launch.serve_app(create_app(FakeEngine(), Settings(alias="fake"))) as url:
        ok = httpx.post(url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert ok.status_code == 200 and ok.json() == {"prompt": "<user>Hi"}
        r = httpx.post(
            url + "/apply-template",
            content=rb'{"messages": [{"role": "user", "content": "Hi \ud800"}]}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
        message = "Invalid request: 'messages.0.content': Value error, the text is not valid Unicode (it holds a lone surrogate)"
        assert r.json() == {"error": {"code": 400, "message": message, "type": "invalid_request_error"}}


# --- a client that leaves; errors in each API's shape ---------------------------------

GENERATION_ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Hi"},
    "/completion": {"prompt": "Hi"},
    "/v1/responses": {"input": "Hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
}


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_a_client_that_leaves_a_whole_answer_cancels_its_request(path):
    """No byte of a whole answer is written before its end, so only the read side can tell that the client
    has gone: the request must be cancelled (its slot freed) then, not when the generation ends."""
    started = []

    def never_ends(r: Request) -> None:  # as the engine does on cancel: end it
        r.on_cancel = lambda: ends(r, End.CANCELLED)
        started.append(r)

    with launch.serve_app(create_app(FakeEngine(never_ends), Settings(alias="fake"))) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + path, json=GENERATION_ROUTES[path], timeout=httpx.Timeout(10, read=0.5))
        wait_until(lambda: started and started[0].done, timeout=5)
        assert started[0].cancelled and started[0].outcome is not None and started[0].outcome.end is End.CANCELLED


def test_anthropic_routes_answer_errors_in_anthropics_shape():
    app = create_app(FakeEngine(), Settings(alias="fake", api_key="k"))
    with launch.serve_app(app) as url:
        r = httpx.post(url + "/v1/messages", json={"messages": []})
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
        key = {"x-api-key": "k"}
        r = httpx.post(url + "/v1/messages", json={"messages": [{"role": "robot", "content": "x"}]}, headers=key)
        assert r.status_code == 400 and r.json()["type"] == "error"
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "'max_tokens'" in error["message"] and "'messages.0.role'" in error["message"]
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
        r = httpx.post(url + "/v1/messages", json={"max_tokens": 5, "messages": [{"role": "user", "content": [image]}]}, headers=key)
        assert r.status_code == 400 and "image input is not supported" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=key)
        assert r.status_code == 200 and r.json() == {"input_tokens": 3}
        # the other APIs keep theirs
        r = httpx.post(url + "/v1/responses", json={"input": "Hi", "previous_response_id": "resp_1"}, headers=key)
        assert r.status_code == 400 and "send the whole conversation" in r.json()["error"]["message"] and r.json()["error"]["code"] == 400
        for body, words in (
            ({"input": "Hi", "tools": [{"type": "web_search"}]}, "'tools.0': Value error, only function tools run on this server"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text only"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "'input"),
            ({"input": "Hi", "max_output_tokens": -2}, "'max_output_tokens'"),
        ):
            r = httpx.post(url + "/v1/responses", json=body, headers=key)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_an_engine_error_mid_stream_is_an_error_event_in_each_apis_shape():
    def script(r: Request) -> None:
        r.emit(Piece("Hel", [1]))
        r.fail(EngineError("llama_decode failed"))

    with launch.serve_app(create_app(FakeEngine(script), Settings(alias="fake"))) as url:
        r = httpx.post(url + "/v1/messages", json={**GENERATION_ROUTES["/v1/messages"], "stream": True})
        *_, last = r.text.strip().split("\n\n")
        assert last == 'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"llama_decode failed"}}'
        r = httpx.post(url + "/v1/responses", json={"input": "Hi", "stream": True})
        name, data = r.text.strip().split("\n\n")[-1].split("\n")
        failed = json.loads(data.removeprefix("data: "))
        assert name == "event: response.failed" and failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == {"code": "server_error", "message": "llama_decode failed"}


# --- one dialect per router: its errors, converted requests in the client's words, options from every dialect -------

HI_A_B = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
TWO_ASSISTANT_TURNS = {  # the conversation ends in two assistant turns, in each chat API's words: a 400 in each
    "/v1/chat/completions": {"messages": HI_A_B},
    "/v1/responses": {"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "1", "name": "f",
                                "arguments": "{}"}, {"role": "assistant", "content": "b"}]},  # the call's turn, then text
    "/v1/messages": {"max_tokens": 8, "messages": HI_A_B},
    "/v1/messages/count_tokens": {"messages": HI_A_B},
}  # fmt: skip
FIELD = {"/v1/chat/completions": "messages", "/v1/responses": "input", "/v1/messages": "messages", "/v1/messages/count_tokens": "messages"}


@pytest.mark.parametrize("path", TWO_ASSISTANT_TURNS)
def test_a_converted_request_that_fails_chats_rules_is_answered_in_the_clients_words_and_dialect(path):
    """Responses and Messages bodies become a chat request, validated again: its failure names the client's field, in
    the client's dialect, not pydantic's text about an internal class."""
    with launch.serve_app(create_app(FakeEngine(), Settings(alias="fake"))) as url:
        r = httpx.post(url + path, json=TWO_ASSISTANT_TURNS[path])
    assert r.status_code == 400, r.text
    body = r.json()
    error = body["error"]
    assert (body.get("type"), "code" in error) == (("error", False) if path.startswith("/v1/messages") else (None, True)), body
    words = "Value error, Cannot have 2 or more assistant messages at the end of the list."
    assert error["message"] == f"Invalid request: '{FIELD[path]}': {words}"


def test_the_routers_dialect_decides_the_error_shape_before_routing_and_after():
    app = create_app(FakeEngine(), Settings(alias="fake", api_key="k"))
    with launch.serve_app(app) as url:
        refused = {path: httpx.post(url + path, json={}) for path in ("/v1/messages/count_tokens", "/v1/responses", "/completion")}
        key = {"x-api-key": "k"}
        unknown = httpx.post(url + "/v1/messages/nothing", json={}, headers=key)  # no route: no dialect, llama-server's shape
        too_long = httpx.post(url + "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": 1}]}, headers=key)
    anthropic = {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
    assert refused["/v1/messages/count_tokens"].json() == anthropic
    for path in ("/v1/responses", "/completion"):
        assert refused[path].json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
    assert too_long.status_code == 400 and too_long.json()["type"] == "error"


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_priority_and_the_tenant_reach_the_engine_from_every_dialect(path):
    """priority is a body field in every dialect (Messages: an extra one, which Anthropic's SDK sends with extra_body)."""
    seen = []
    engine = FakeEngine(lambda r: (seen.append(r.params), ends(r, End.EOS)))
    with launch.serve_app(create_app(engine, Settings(alias="fake"))) as url:
        body = {**GENERATION_ROUTES[path], "priority": -3, "stream": True}
        r = httpx.post(url + path, json=body, headers={"X-Tenant": "team-a"})
    assert r.status_code == 200, r.text
    (params,) = seen
    assert (params.priority, params.tenant, params.stream) == (-3, "team-a", True)


# --- the event loop never waits for the engine ----------------------------------------------------------------------


class BlockedStepEngine(FakeEngine):
    """``status()`` waits until the test ends the step (``step_over``), as ``Engine.status`` waits while the engine's
    thread reads a long prompt: what the server does meanwhile is shown by order, never by a clock."""

    def __init__(self, script: Callable[[Request], None]):
        super().__init__(script)
        self.step_over, self.in_step, self.asked = threading.Event(), threading.Event(), 0
        self.step_over.set()  # no step runs until the test starts one

    def status(self) -> EngineStatus:
        self.asked += 1
        self.in_step.set()
        assert self.step_over.wait(60), "the test never ended the step"
        return super().status()


def arrived(received: queue.Queue[str]) -> None:
    try:
        received.get(timeout=30)
    except queue.Empty:
        pytest.fail("a piece the engine emitted did not reach its stream: the event loop is held")


def test_a_scrape_during_a_long_step_delays_no_stream_and_no_health_check():
    pieces: queue.Queue[int | None] = queue.Queue()  # the test says when the engine emits each piece (None: the end)

    def script(r: Request) -> None:
        def run() -> None:
            for _ in iter(pieces.get, None):
                r.emit(Piece("x", [1]))
                r.wake()
            ends(r, End.EOS)
            r.wake()

        threading.Thread(target=run, daemon=True).start()

    engine = BlockedStepEngine(script)
    received: queue.Queue[str] = queue.Queue()
    with launch.serve_app(create_app(lambda: engine, Settings(alias="fake", metrics=True))) as url:
        engine.asked = 0

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"x"' in line:  # a piece's chunk
                        received.put(line)

        reader = threading.Thread(target=stream)
        reader.start()
        pieces.put(0)
        arrived(received)  # the stream runs
        engine.step_over.clear()  # a long step begins: status() now waits for its end
        answers: dict[str, int] = {}
        scrapes = [threading.Thread(target=lambda p=p: answers.update({p: httpx.get(url + p, timeout=60).status_code}))
                   for p in ("/metrics", "/slots", "/props")]  # fmt: skip
        try:
            for s in scrapes:
                s.start()
            assert engine.in_step.wait(30)
            for k in range(1, 4):  # while the scrapes wait for the step: pieces still reach the client, /health answers
                pieces.put(k)
                arrived(received)
                assert httpx.get(url + "/health", timeout=30).status_code == 200
                assert all(s.is_alive() for s in scrapes) and answers == {}, "the step was still running"
        finally:
            engine.step_over.set()  # the step ends: the scrapes get their answers
            pieces.put(None)
        for s in scrapes:
            s.join(60)
        reader.join(60)
    assert answers == {"/metrics": 200, "/slots": 200, "/props": 200}
    assert engine.asked == 1  # three scrapes during one step share one wait for its end


# --- a decode worker fetches KV cells from its prefill peers only ------------------------------------------------------


class Listener:
    """A socket that must see no connection (or, the control, does): counts what connects, closes it at once."""

    def __init__(self, host: str = launch.HOST):
        self.socket = socket.create_server((host, 0))
        self.socket.settimeout(0.2)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.connections = 0
        self.open = True
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while self.open:
            with contextlib.suppress(TimeoutError, OSError):
                conn, _ = self.socket.accept()
                self.connections += 1
                conn.close()

    def close(self) -> None:
        self.open = False
        self.thread.join(2)
        self.socket.close()


def handed(host: str, port: object, key: object = "kv-1-0") -> dict:
    """A chat body as vllm-router sends it to a decode worker, naming where its cells are."""
    params = {"do_remote_prefill": True, "remote_host": host, "remote_port": port, "remote_block_ids": [key],
              "first_tokens": [1], "tokens_sha256": tokens_sha256([1, 2, 3])}  # fmt: skip
    return {**CHAT, "stream": False, "kv_transfer_params": params}


def test_a_decode_worker_refuses_kv_cells_from_anywhere_but_its_peers_and_connects_nowhere(caplog):
    peer, other_port, other_host = Listener(), Listener(), Listener("127.0.0.2")
    gone = launch.free_port()
    settings = Settings(alias="fake", pd_peers=frozenset({(peer.host, peer.port), (launch.HOST, gone)}))
    hostile = {
        "another port": handed(launch.HOST, other_port.port),
        "another host": handed(other_host.host, other_host.port),
        "a path in the key": handed(peer.host, peer.port, "kv-1-0/../../v1/models?x="),
        "a key of another shape": handed(peer.host, peer.port, "../slots"),
        "a port as text": handed(peer.host, str(peer.port)),
        "no address": {**CHAT, "stream": False, "kv_transfer_params": {"do_remote_prefill": True}},
    }
    try:
        with launch.serve_app(create_app(FakeEngine(), settings)) as url:
            answers = {name: httpx.post(url + "/v1/chat/completions", json=body, timeout=10) for name, body in hostile.items()}
            names_the_peers = httpx.post(url + "/v1/chat/completions", json=handed(launch.HOST, 1), timeout=10)
            with caplog.at_level("WARNING", logger="llmkit.server"):
                from_a_gone_peer = httpx.post(url + "/v1/chat/completions", json=handed(launch.HOST, gone), timeout=10)
            assert other_port.connections == other_host.connections == peer.connections == 0  # nothing connected ...
            control = httpx.post(url + "/v1/chat/completions", json=handed(peer.host, peer.port), timeout=10)
            assert wait_until(lambda: peer.connections == 1, 5)  # ... where the control, to the peer, connects
    finally:
        for listener in (peer, other_port, other_host):
            listener.close()
    for name, r in answers.items():
        assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"], (name, r.text)
    assert names_the_peers.status_code == 400 and f"{peer.host}:{peer.port}" in names_the_peers.json()["error"]["message"]
    # a peer that cannot give the cells: the prompt is read here, as a decode worker does when they expired
    assert from_a_gone_peer.status_code == 200 and "no KV cells from the prefill worker" in caplog.text
    assert control.status_code == 200
