"""The slot server over real HTTP: the official ``openai`` client, raw SSE bytes, monitoring, errors.

Two servers for the whole session (greedy, one CPU thread each so that a
busy machine does not make OpenMP threads spin against each other):

- ``server``: conftest's ``slot_server``, 4 slots of 512 tokens, /metrics on (test_server_overload.py shares it);
- ``key_server``: ``--api-key``, ``--no-slots``, no metrics, a 64 KiB body limit.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmkit.course import launch

from helpers import assert_error, post, sse_events, wait_until

ALIAS = "smollm2"
KEY = "sesame"
N_CTX_SLOT = 512
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="session")
def server(slot_server):
    """conftest's ``slot_server``, shared with test_server_overload.py."""
    assert slot_server.args[slot_server.args.index("--alias") + 1] == ALIAS and "--metrics" in slot_server.args
    assert slot_server.args[slot_server.args.index("-c") + 1] == str(4 * N_CTX_SLOT)
    return slot_server


@pytest.fixture(scope="session")
def key_server():
    flags = ("-c", "512", "-np", "1", "-t", "1", "--temp", "0", "--api-key", KEY, "--no-slots", "--max-body-size", "65536")
    with launch.serve("slots", *flags) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def slots(server) -> list[dict]:
    return httpx.get(f"{server.url}/slots", timeout=10).json()


def wait_idle(server, timeout: float = 10) -> float:
    """Seconds until no slot is processing (fails after ``timeout``)."""
    return wait_until(lambda: not any(s["is_processing"] for s in slots(server)), timeout, interval=0.05)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


# --- the openai client ------------------------------------------------------------


def test_models(client):
    assert [m.id for m in client.models.list().data] == [ALIAS]
    model = client.models.retrieve(ALIAS)
    assert model.owned_by == "llamacpp" and model.meta["n_ctx"] == N_CTX_SLOT
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat(client):
    r = client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=8)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == ALIAS
    assert r.system_fingerprint and abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 8
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == u.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == u.prompt_tokens == timings["prompt_n"] + u.prompt_tokens_details.cached_tokens


def test_chat_stream_matches_whole_answer(client):
    whole = client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=10)
    chunks = list(
        client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=10, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[1:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_openai_sampling_fields_and_seed(client):
    def ask():
        return client.chat.completions.create(
            model=ALIAS,
            messages=HELLO,
            temperature=1.0,
            seed=42,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            max_completion_tokens=6,
            response_format={"type": "text"},
            stop=None,
            n=1,
        )

    first, second = ask(), ask()
    assert first.choices[0].message.content == second.choices[0].message.content  # same seed, same text
    assert first.usage.completion_tokens <= 6


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    assert "".join(item.token for item in content) == r.choices[0].message.content


def test_completions(client):
    r = client.completions.create(model=ALIAS, prompt="Count: 1, 2, 3, 4,", max_tokens=12, logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text == " 5, 6, 7, 8," and choice.finish_reason == "length"  # greedy
    assert len(choice.logprobs.tokens) == 12 and all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    streamed = client.completions.create(model=ALIAS, prompt="Count: 1, 2, 3, 4,", max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_stop_strings(client):
    for stop in (" 7", [" 9", " 7,"]):
        r = client.completions.create(model=ALIAS, prompt="Count: 1, 2, 3, 4,", max_tokens=12, stop=stop)
        assert r.choices[0].text == " 5, 6," and r.choices[0].finish_reason == "stop"


def test_embeddings(client):
    r = client.embeddings.create(model=ALIAS, input=["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell."])
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (3, 576) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]  # similar sentences are closer
    assert r.usage.prompt_tokens == r.usage.total_tokens > 10
    single = client.embeddings.create(model=ALIAS, input="The cat sat on the mat.", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(single.data[0].embedding), dtype="<f4")  # the client gives base64 as is
    assert np.allclose(decoded, v[0], atol=1e-6)


# --- llama-server's extras ----------------------------------------------------------


def test_llama_server_fields(server):
    body = {
        "messages": HELLO,
        "n_predict": 6,
        "ignore_eos": True,
        "top_k": 5,
        "min_p": 0.1,
        "repeat_penalty": 1.1,
        "cache_prompt": False,
        "id_slot": 2,
        "temperature": None,
        "stop": None,
        "seed": None,
    }
    r = post(server, "/v1/chat/completions", body).json()
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    assert r["timings"]["cache_n"] == 0  # cache_prompt false
    assert slots(server)[2]["n_cached"] >= r["usage"]["prompt_tokens"]  # it ran in slot 2


def test_max_tokens_0_reads_the_prompt_into_the_slot_and_generates_nothing(server):
    """As server-schema.cpp describes n_predict 0 (the pinned llama-server samples one token anyway: test_differential)."""
    body = {"messages": [{"role": "user", "content": "Warm this prompt: " + "slots " * 30}], "id_slot": 1}
    warm = post(server, "/v1/chat/completions", body | {"max_tokens": 0}).json()
    assert (warm["choices"][0]["message"]["content"], warm["choices"][0]["finish_reason"]) == ("", "length")
    assert warm["usage"]["completion_tokens"] == 0 and warm["timings"]["prompt_n"] > 30
    again = post(server, "/v1/chat/completions", body | {"max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1  # it was read, and kept


def test_cached_tokens_on_repeated_system_prompt(client):
    system = {"role": "system", "content": "You are a terse assistant for a course on LLM serving. " * 6}
    first = client.chat.completions.create(model=ALIAS, messages=[system, {"role": "user", "content": "Hi."}], max_tokens=2)
    second = client.chat.completions.create(model=ALIAS, messages=[system, {"role": "user", "content": "Bye."}], max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 60 and cached < second.usage.prompt_tokens
    assert second.model_extra["timings"]["cache_n"] == cached
    assert first.usage.prompt_tokens > 60


def test_tokenize_detokenize(server):
    tokens = post(server, "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"content": "Hello world"}
    pieces = post(server, "/tokenize", {"content": "日本", "with_pieces": True}).json()["tokens"]
    assert all(isinstance(p["piece"], (str, list)) for p in pieces)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == "日本".encode()


def test_props_and_health(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    props = httpx.get(f"{server.url}/props").json()
    assert props["total_slots"] == 4 and props["model_alias"] == ALIAS
    assert props["default_generation_settings"]["n_ctx"] == N_CTX_SLOT
    assert props["default_generation_settings"]["params"]["temperature"] == 0
    assert "im_start" in props["chat_template"]


# --- the stream, byte by byte -------------------------------------------------------


def test_stream_bytes(server):
    """role chunk, one chunk per piece (whole UTF-8 characters), final chunk, usage chunk, [DONE]."""
    body = {
        "messages": [{"role": "user", "content": "Translate to Japanese: Good morning"}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e.decode("utf-8")) for e in events[:-1]]  # strict UTF-8: no broken character
    role, *pieces, final, usage = chunks
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}]
    assert pieces and all(list(p["choices"][0]["delta"]) == ["content"] and p["choices"][0]["delta"]["content"] for p in pieces)
    assert all(p["choices"][0]["finish_reason"] is None for p in pieces)
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 16 and "timings" in usage
    text = "".join(p["choices"][0]["delta"]["content"] for p in pieces)
    assert "\ufffd" not in text and any(ord(c) > 0x3000 for c in text)  # Japanese, every character whole
    assert len({c["id"] for c in chunks}) == 1
    # without include_usage: the final chunk carries the timings and comes right before [DONE]
    del body["stream_options"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "prompt": "Hi"}, timeout=60) as r:
        events = sse_events(r.read())
    final = json.loads(events[-2])
    assert events[-1] == b"[DONE]" and final["choices"][0]["finish_reason"] and "timings" in final and "usage" not in final


def test_disconnect_mid_stream_frees_the_slot(server):
    wait_idle(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):  # three events (a blank line after each)
            next(lines)
        busy = [s for s in slots(server) if s["is_processing"]]
        assert len(busy) == 1
    elapsed = wait_idle(server, timeout=5)  # 400 tokens would take many seconds
    slot = next(s for s in slots(server) if s["id"] == busy[0]["id"])
    assert slot["n_cached"] < 200, (slot, elapsed)


# --- monitoring --------------------------------------------------------------------------


def test_slots_busy_during_concurrent_requests_then_idle(server):
    wait_idle(server)
    responses, first_chunk = [], threading.Barrier(5, timeout=60)

    def run(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            first_chunk.wait()  # every request is generating
            responses.append(b"".join(line.encode() + b"\n" for line in lines))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first_chunk.wait()
    during = slots(server)
    for t in threads:
        t.join()
    assert [s["is_processing"] for s in during] == [True] * 4
    assert all(s["id_task"] and s["params"]["max_tokens"] == 48 and s["n_ctx"] == N_CTX_SLOT for s in during)
    assert len(responses) == 4 and all(r.rstrip().endswith(b"data: [DONE]") for r in responses)
    wait_idle(server, timeout=5)
    assert not any(s["is_processing"] for s in slots(server))


def test_metrics_match_the_sum_of_timings(server):
    wait_idle(server)
    before = metrics(server)
    timings = [
        post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 5}).json()["timings"],
        post(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 7}).json()["timings"],
    ]
    after = metrics(server)
    delta = {name: after[name] - before[name] for name in after}
    raw = dict(httpx.get(f"{server.url}/metrics", timeout=10).headers.raw)  # the names as they came over the wire
    started = int(raw[b"Process-Start-Time-Unix"])  # llama-server's header, spelled as llama-server writes it
    assert time.time() - 24 * 3600 < started <= time.time()

    def total(key: str) -> float:
        return sum(t[key] for t in timings)

    assert delta["llamacpp:prompt_tokens_total"] == total("prompt_n")
    assert delta["llamacpp:prompt_tokens_cached_total"] == total("cache_n")
    assert delta["llamacpp:tokens_predicted_total"] == total("predicted_n")
    assert delta["llamacpp:prompt_seconds_total"] == pytest.approx(total("prompt_ms") / 1e3, abs=1e-6)
    assert delta["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(total("predicted_ms") / 1e3, abs=1e-6)
    assert delta["llamacpp:n_decode_total"] >= total("predicted_n")
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and 1 <= after["llamacpp:n_busy_slots_per_decode"] <= 4


def test_access_log(server):
    post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
    lines = [line for line in server.log().splitlines() if "POST /v1/chat/completions 200 prompt=" in line]
    assert lines and re.search(r" 200 prompt=\d+ cached=\d+ generated=\d+ \d+\.\d+s$", lines[-1]), lines[-1:]


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": HELLO, "temperature": "hot"}, "'temperature'"),
        ({"messages": HELLO, "top_p": 1.5}, "'top_p'"),
        (b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', "'temperature'"),
        ({"messages": HELLO, "max_tokens": -2}, "'max_tokens'"),
        ({"messages": HELLO, "n": 2}, "'n'"),
        ({"messages": HELLO, "stop": 7}, "'stop'"),
        ({"messages": HELLO, "stream": "yes"}, "'stream'"),
        ({"messages": HELLO, "stream_options": {"include_usage": 1}}, "'stream_options.include_usage'"),
        ({"messages": HELLO, "response_format": {"type": "yaml"}}, "'response_format.type'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "'messages.0.role'"),
        ({"messages": []}, "'messages'"),
        ({}, "'messages'"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "Hi"}, {"role": "assistant", "content": "there"}]}, "2 or more assistant"),
        ({"messages": HELLO, "tool_choice": "required"}, "needs at least one tool"),
        ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tool name"),
        ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "grammar": 'root ::= "a"'}, "with tools"),
        ([1, 2], "'body'"),
    ],
)
def test_wrong_fields_are_400_naming_the_field(server, body, field):
    assert_error(post(server, "/v1/chat/completions", body), 400, "invalid_request_error", field)


def test_bad_requests_are_400(server):
    url = f"{server.url}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    assert_error(httpx.post(url, content=b'{"messages": [', headers=headers), 400, "invalid_request_error", "Invalid JSON")
    assert_error(httpx.post(url, content=b"", headers=headers), 400, "invalid_request_error")
    form = {"content-type": "application/x-www-form-urlencoded"}  # what curl -d sends without -H
    error = assert_error(httpx.post(url, content=b'{"messages": []}', headers=form), 400, "invalid_request_error")
    assert error["message"] == "Invalid request: 'body': must be a JSON object, sent with Content-Type: application/json"
    assert_error(post(server, "/v1/chat/completions", {"messages": HELLO, "id_slot": 9}), 400, "invalid_request_error", "id_slot")
    lone_surrogate = httpx.post(f"{server.url}/v1/completions", content=rb'{"prompt": "\ud800"}', headers=headers)
    assert_error(lone_surrogate, 400, "invalid_request_error", "Unicode")
    assert_error(post(server, "/v1/completions", {"prompt": [1, 10**9]}), 400, "invalid_request_error", "'prompt'")
    assert_error(post(server, "/detokenize", {"tokens": [-1]}), 400, "invalid_request_error", "'tokens'")
    assert_error(post(server, "/v1/embeddings", {"input": ""}), 400, "invalid_request_error", "empty")
    assert_error(
        post(server, "/v1/chat/completions", {"messages": HELLO, "grammar": 'root ::= "a'}), 400, "invalid_request_error", "grammar"
    )


def test_prompt_longer_than_the_slot_context(server, client):
    r = post(server, "/v1/completions", {"prompt": "hello " * 600})
    error = assert_error(r, 400, "exceed_context_size_error", "exceeds the available context size")
    assert error["n_ctx"] == N_CTX_SLOT and error["n_prompt_tokens"] > N_CTX_SLOT
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hello " * 600}])
    assert_error(post(server, "/v1/embeddings", {"input": "hello " * 600}), 400, "exceed_context_size_error")


def test_unknown_route_and_method(server, client):
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404, "not_found_error")
    assert_error(httpx.get(f"{server.url}/v1/chat/completions"), 405, "invalid_request_error")
    with pytest.raises(openai.NotFoundError):
        client.get("/nothing", cast_to=object)


def test_api_key(key_server):
    url = f"{key_server.url}/v1/models"
    assert httpx.get(f"{key_server.url}/health").status_code == 200  # public
    assert_error(httpx.get(url), 401, "authentication_error", "Invalid API Key")
    assert_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url, headers={"X-Api-Key": KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{key_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{key_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.chat.completions.create(model="any", messages=HELLO, max_tokens=2).choices[0].message.content


def test_body_too_large(key_server):
    url, auth = f"{key_server.url}/v1/completions", {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    assert_error(httpx.post(url, content=big, headers={**auth, "content-type": "application/json"}), 413, "invalid_request_error")
    chunked = httpx.post(url, content=iter([big[:40_000], big[40_000:]]), headers={**auth, "content-type": "application/json"})
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, "invalid_request_error")


def test_disabled_endpoints_are_501(key_server):
    auth = {"X-Api-Key": KEY}
    assert_error(httpx.get(f"{key_server.url}/slots", headers=auth), 501, "not_supported_error", "--slots")
    assert_error(httpx.get(f"{key_server.url}/metrics", headers=auth), 501, "not_supported_error", "--metrics")


def test_a_model_that_does_not_load_stops_the_server(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)  # the magic passes the path check; llama.cpp refuses it
    with pytest.raises(RuntimeError, match="exited during start-up"):
        launch.start("slots", "-m", str(bad), timeout=60)
