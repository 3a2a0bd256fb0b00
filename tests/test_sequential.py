"""The sequential translation server, over real HTTP, with the real embedded model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llmkit import models
from llmkit.course import launch
from llmkit.sequential.app import create_app
from llmkit.sequential.translator import Translator

from filehost import file_route, redirect_route, serve_files
from helpers import sse_events

LONG_TEXT = " ".join(["The weather was lovely, so we walked along the river and talked about books."] * 6)


# --- happy paths ------------------------------------------------------------------


def test_health(sequential_server):
    r = httpx.get(f"{sequential_server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_translate_and_stream_agree(sequential_server):
    body = {"text": "Good morning. How are you?", "target_lang": "fr"}
    whole = httpx.post(f"{sequential_server.url}/translate", json=body, timeout=60)
    assert whole.status_code == 200
    translation = whole.json()["translation"]
    assert translation.strip()

    streamed = httpx.post(f"{sequential_server.url}/translate/stream", json=body, timeout=60)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.content)
    assert events[-1] == b"[DONE]"
    tokens = [json.loads(e) for e in events[:-1]]
    assert len(tokens) > 1 and all(isinstance(t, str) for t in tokens)
    # greedy (--temp 0) and a cleared cache: the same request gives the same text
    assert "".join(tokens) == translation


def test_japanese_stream_never_sends_a_broken_character(sequential_server, model):
    # The model really does split Japanese characters across tokens ...
    pieces = [model.token_to_piece(t) for t in model.tokenize("今日は良い天気です", add_special=False)]
    assert any(not _is_utf8(p) for p in pieces), "expected at least one partial-UTF-8 token"
    # ... and the stream still only carries whole characters.
    # SmolLM2-135M ignores the code "ja" but follows the language's name.
    body = {"text": "Thank you very much.", "target_lang": "Japanese"}
    r = httpx.post(f"{sequential_server.url}/translate/stream", json=body, timeout=60)
    tokens = [json.loads(e) for e in sse_events(r.content)[:-1]]
    text = "".join(tokens)
    assert any(ord(c) > 0x3000 for c in text), text  # it did write Japanese
    # Every piece is whole characters; only if the token limit (-n 160) cuts the answer inside a
    # character does the last piece end with U+FFFD, marking the cut (Detokenizer.flush).
    assert all("\ufffd" not in piece for piece in tokens[:-1]) and "\ufffd" not in tokens[-1][:-1], tokens[-3:]


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_cache_is_cleared_every_request(sequential_server):
    """The baseline: the same prompt twice is evaluated twice in full (see the log)."""
    body = {"text": "One, two, three.", "target_lang": "de"}
    for _ in range(2):
        assert httpx.post(f"{sequential_server.url}/translate", json=body, timeout=60).status_code == 200
    lines = [line for line in sequential_server.log().splitlines() if "cache cleared, 0 reused" in line]
    assert len(lines) >= 2
    assert lines[-1].split("prompt ")[1].split(" tokens")[0] == lines[-2].split("prompt ")[1].split(" tokens")[0]


def test_health_answers_while_a_translation_runs(sequential_server):
    body = {"text": LONG_TEXT, "target_lang": "ja"}
    with httpx.stream("POST", f"{sequential_server.url}/translate/stream", json=body, timeout=120) as stream:
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(events)  # the first token: the translation holds the lock, and goes on
        assert httpx.get(f"{sequential_server.url}/health").status_code == 200
        rest = list(events)
    # /health did not wait for the lock: the translation was still running when it answered
    assert len(rest) > 1 and rest[-1] == "data: [DONE]", "the translation ran on after /health answered"


# --- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, status, message",
    [
        (b"{not json", 400, "Invalid JSON"),
        (b"\xff\xfe", 400, "Invalid JSON"),
        (b"[1, 2]", 400, "'text' is required"),
        (b"{}", 400, "'text' is required"),
        (b'{"text": ""}', 400, "'text' is required"),
        (b'{"text": 42}', 400, "'text' is required"),
        (b'{"text": null}', 400, "'text' is required"),
        (rb'{"text": "Hi \ud800"}', 400, "'text' is not valid Unicode (it holds a lone surrogate)"),
        (rb'{"text": "Hi", "target_lang": "\udfff"}', 400, "'target_lang' is not valid Unicode (it holds a lone surrogate)"),
    ],
)
@pytest.mark.parametrize("path", ["/translate", "/translate/stream"])
def test_bad_body(sequential_server, path, content, status, message):
    r = httpx.post(f"{sequential_server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert r.json() == {"error": message}


@pytest.mark.parametrize("content", [b"[" * 100_000 + b"]" * 100_000, b'{"text": ' + b'{"a": ' * 100_000])
@pytest.mark.parametrize("path", ["/translate", "/translate/stream", "/models/select"])
def test_a_body_nested_100_000_deep_is_400(sequential_server, path, content):
    r = httpx.post(f"{sequential_server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"error": "Invalid JSON: nested too deeply"}
    assert httpx.get(f"{sequential_server.url}/health").status_code == 200


@pytest.mark.parametrize("lang", [5, ["ja"], {"x": 1}, "", None])
def test_target_lang_must_be_a_string(sequential_server, lang):
    r = httpx.post(f"{sequential_server.url}/translate", json={"text": "Hi", "target_lang": lang})
    assert r.status_code == 400
    assert "target_lang" in r.json()["error"]


def test_unknown_path_is_404_json(sequential_server):
    r = httpx.get(f"{sequential_server.url}/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_web_ui_is_served(sequential_server):
    r = httpx.get(f"{sequential_server.url}/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]


# --- faults, in a server running in this process so that we can break it on purpose ---


@pytest.fixture(scope="module")
def translator(model_path):
    t = Translator(model_path, temperature=0, seed=1, n_threads=1)
    yield t
    t.close()


@pytest.fixture(scope="module")
def inproc(translator):
    app = create_app(translator)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("something broke inside the handler")

    with launch.serve_app(app) as url:
        yield url


def test_exception_in_handler_is_a_json_500_and_the_server_lives(inproc):
    r = httpx.get(f"{inproc}/boom")
    assert r.status_code == 500
    assert r.json() == {"error": "something broke inside the handler"}
    assert httpx.get(f"{inproc}/health").status_code == 200
    r = httpx.post(f"{inproc}/translate", json={"text": "Hello", "target_lang": "fr"}, timeout=60)
    assert r.status_code == 200 and r.json()["translation"]


def test_exception_during_stream_ends_with_an_error_event(inproc, translator, monkeypatch):
    calls = {"n": 0}
    real = translator.model.token_to_piece

    def failing_piece(token, **kw):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("detokenizer exploded")
        return real(token, **kw)

    monkeypatch.setattr(translator.model, "token_to_piece", failing_piece)
    r = httpx.post(f"{inproc}/translate/stream", json={"text": LONG_TEXT, "target_lang": "ja"}, timeout=60)
    assert r.status_code == 200
    events = sse_events(r.content)
    assert json.loads(events[-1]) == {"error": "detokenizer exploded"}
    assert b"[DONE]" not in events
    monkeypatch.undo()
    assert not translator.lock.locked()
    r = httpx.post(f"{inproc}/translate", json={"text": "Hello", "target_lang": "fr"}, timeout=60)
    assert r.status_code == 200


def test_disconnect_stops_generation_and_frees_the_lock(inproc, translator):
    received = 0
    with httpx.stream("POST", f"{inproc}/translate/stream", json={"text": LONG_TEXT, "target_lang": "ja"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 3
    while translator.lock.locked() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not translator.lock.locked(), "the lock should be free right after the client left"
    assert translator.last.predicted_n < received + 10, translator.last
    t0 = time.perf_counter()
    r = httpx.post(f"{inproc}/translate", json={"text": "Yes.", "target_lang": "fr"}, timeout=60)
    assert r.status_code == 200
    assert translator.last.prompt_n > 0 and time.perf_counter() - t0 < 10


# --- models: catalog, download from a local "hub", swap ---------------------------


def test_models_lists_the_catalog_with_the_embedded_one_selected(sequential_server):
    listed = httpx.get(f"{sequential_server.url}/models").json()["models"]
    assert [m["name"] for m in listed] == [e.name for e in models.CATALOG]
    assert listed[0] == {**listed[0], "downloaded": True, "selected": True}
    assert sum(m["selected"] for m in listed) == 1
    assert set(listed[0]) == {"name", "params", "size", "downloaded", "selected"}


@pytest.mark.parametrize("body, status, message", [({}, 400, "'model' is required"), ({"model": "nope"}, 404, "Unknown model")])
def test_select_bad_input(sequential_server, body, status, message):
    r = httpx.post(f"{sequential_server.url}/models/select", json=body)
    assert r.status_code == status and r.json() == {"error": message}


def status_events(response: httpx.Response) -> list[dict]:
    return [json.loads(e) for e in sse_events(response.content)]


def test_select_downloads_loads_and_falls_back(tmp_path, model_path):
    """Against a local hub that serves the embedded GGUF under a catalog entry's name."""
    entry = models.CATALOG[1]
    routes = {
        f"/{entry.repo}/resolve/main/{entry.filename}": redirect_route("/cdn/model.gguf"),
        "/cdn/model.gguf": file_route(model_path),
    }
    broken = models.CATALOG[2]  # not on the local hub: 404
    with serve_files(routes) as hub:
        env = {"LLMKIT_HUB_URL": hub, "LLMKIT_MODELS_DIR": str(tmp_path)}
        with launch.serve("sequential", "--temp", "0", env=env) as server:
            r = httpx.post(f"{server.url}/models/select", json={"model": broken.name}, timeout=60)
            events = status_events(r)
            assert events[-1]["status"] == "error" and "404" in events[-1]["message"]
            assert not list(tmp_path.iterdir()), "a failed download leaves nothing behind"
            selected = [m["name"] for m in httpx.get(f"{server.url}/models").json()["models"] if m["selected"]]
            assert selected == [models.CATALOG[0].name], "the previous model stays selected"

            r = httpx.post(f"{server.url}/models/select", json={"model": entry.name}, timeout=120)
            events = status_events(r)
            progress = [e["progress"] for e in events if e["status"] == "downloading"]
            assert progress == sorted(set(progress)) and progress[-1] == 100
            assert [e["status"] for e in events[-2:]] == ["loading", "ready"]
            listed = {m["name"]: m for m in httpx.get(f"{server.url}/models").json()["models"]}
            assert listed[entry.name]["downloaded"] and listed[entry.name]["selected"]
            assert not listed[models.CATALOG[0].name]["selected"]
            r = httpx.post(f"{server.url}/translate", json={"text": "Hello", "target_lang": "fr"}, timeout=60)
            assert r.status_code == 200 and r.json()["translation"]


# --- the command line ------------------------------------------------------------


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "llmkit", *args], capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("how", ["flag", "env"])
def test_bad_model_path_is_a_one_line_error(tmp_path, how):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    args = ["serve", "sequential", "--port", str(launch.free_port())]
    p = run_cli(*args, "--model", str(bad)) if how == "flag" else run_cli(*args, env={"LLMKIT_MODEL": str(bad)})
    assert p.returncode == 2
    assert p.stderr.strip() == f"llmkit: error: not a GGUF file (bad magic bytes): {bad}"
    assert "Traceback" not in p.stderr


def test_missing_model_file(tmp_path):
    p = run_cli("serve", "sequential", "--model", str(tmp_path / "missing.gguf"))
    assert p.returncode == 2 and "model file not found" in p.stderr and str(tmp_path) in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_translate_command_streams_from_a_server(sequential_server):
    p = run_cli("translate", "Thank you very much.", "--to", "es", "--url", sequential_server.url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()


def test_translate_command_reports_an_error_answer(sequential_server):
    p = run_cli("translate", "", "--url", sequential_server.url)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip() == "error: 'text' is required"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_shut_down_cleanly(sig):
    server = launch.start("sequential")
    server.process.send_signal(sig)
    # uvicorn finishes in-flight responses, then re-raises the signal so that the
    # exit status still says "stopped by SIGTERM" (-15) to whoever started it.
    assert server.process.wait(30) in (0, -sig)
    assert "Finished server process" in server.log()
    assert "Traceback" not in server.log()


def test_sigterm_waits_for_a_running_stream():
    server = launch.start("sequential", "--temp", "0", "-n", "48", "-t", "1")
    try:
        body = {"text": LONG_TEXT, "target_lang": "French"}
        with httpx.stream("POST", f"{server.url}/translate/stream", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[len("data: ") :])
        assert rest[-1] == "data: [DONE]", "the stream ran to its end before the server stopped"
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
