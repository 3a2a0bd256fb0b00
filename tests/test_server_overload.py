"""The slot server under hostile input the model has to judge, and under ten times the load it has slots for, a third
of the clients leaving: nothing lost, nothing stalled.

One real server, conftest's ``slot_server`` (4 slots of 512 tokens, greedy, /metrics), shared with test_server.py.
What the body models refuse on their own (every route, every field) is tests/test_hostile.py's, over a scripted engine.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until

HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = "/v1/chat/completions"


def chat(**fields: object) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


def native(**fields: object) -> dict:
    return {"prompt": "Hi", "n_predict": 2, **fields}


WORDS = "the cat sat on the mat " * 120  # ~720 tokens: more than a slot's 512

HOSTILE = [  # (path, body, words the 4xx message holds): what only the model, the tokenizer or the grammar can judge
    ("/completion", native(prompt=[1, 49152]), "token 49152 is not in the vocabulary"),
    ("/completion", native(prompt=["Hi", -1]), "token -1 is not in the vocabulary"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, "not in the vocabulary"),
    ("/detokenize", {"tokens": [5, 2**40]}, "not in the vocabulary"),
    ("/completion", native(prompt=WORDS), "exceeds the available context size"),
    (CHAT, chat(messages=[{"role": "user", "content": WORDS}]), "exceeds the available context size"),
    ("/v1/embeddings", {"input": ["Hi", WORDS]}, "exceeds the available context size"),
    ("/v1/embeddings", {"input": ["Hi"] * 2049}, "'input'"),
    ("/v1/embeddings", {"input": ["Hi", ""]}, "empty"),
    ("/completion", native(n_predict=-2), "'n_predict'"),
    ("/completion", native(n_predict=2**64), "'n_predict'"),
    (CHAT, chat(max_tokens=2**63), "'max_tokens'"),
    ("/completion", native(n_probs=10**6), "'n_probs'"),
    (CHAT, chat(logprobs=True, top_logprobs=10**6), "'top_logprobs'"),
    ("/completion", native(id_slot=99), "id_slot"),
    ("/completion", native(logit_bias=[["Hi", "much"]]), "'logit_bias'"),
    ("/completion", b'{"prompt": "Hi", "n_predict": 2, "logit_bias": {"Hi": NaN}}', "'logit_bias'"),
    ("/completion", native(logit_bias=[[{"token": 5}, 1]]), "'logit_bias'"),
    ("/completion", native(logit_bias=[[5]]), "'logit_bias'"),
    ("/completion", native(grammar="root ::= root"), "left recursion"),
    ("/completion", native(grammar='root ::= "a'), "grammar"),
    ("/completion", native(grammar="root ::= [a-"), "grammar"),
    ("/completion", native(json_schema={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "'json_schema'"),
    ("/completion", native(json_schema={"$ref": "https://example.com/schema.json"}), "remote"),
    ("/completion", native(json_schema={"type": "nonsense"}), "'json_schema'"),
    ("/completion", native(json_schema={"type": "integer", "minimum": 1e308}), "'minimum'"),
    (CHAT, chat(response_format={"type": "json_schema"}), "'response_format.json_schema' is required"),
    (CHAT, chat(ignore_eos=True, json_schema={}), "ignore_eos"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "two words"}}]), "tool name"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "type 'object'"),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "'g'"),
    (CHAT, chat(tools=[TOOL, TOOL]), "unique"),
    (CHAT, chat(tools=[TOOL], grammar='root ::= "a"'), "with tools"),
    (CHAT, chat(tools=[{"type": "web_search"}]), "'tools.0'"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, "text only"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 2}, "text only"),
    ("/v1/messages", {"messages": HI, "max_tokens": 2, "tool_choice": {"type": "tool"}}, "'tool_choice'"),
    ("/v1/messages", {"messages": HI, "max_tokens": 2, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "client tools"),
    (CHAT, chat(kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 80,
                                    "remote_block_ids": ["../../x"], "first_tokens": [1], "tokens_sha256": "0"}), "kv_transfer_params"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "words"), HOSTILE, ids=[f"{i}:{p}" for i, (p, _, _) in enumerate(HOSTILE)])
def test_what_the_model_refuses_is_a_4xx_that_says_why(slot_server, path, body, words):
    with httpx.Client(base_url=slot_server.url, timeout=120) as client:
        r = client.post(path, content=body if isinstance(body, bytes) else json.dumps(body), headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert words in r.json()["error"]["message"], r.text[:300]
        again = client.post(CHAT, json=chat())  # the same connection, right after
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] in ("length", "stop")


# --- ten times the load, a third of the clients leaving --------------------------------

N_SLOTS = 4
N_CLIENTS = 10 * N_SLOTS
N_OUTPUT = 8  # tokens each staying client asks for
N_LEAVING = 256  # tokens each leaving client asks for: run to the end, the leavers alone would take minutes
LONG = {"ignore_eos": True}  # ... and all of them (Messages has no such field: its leavers may end sooner)

DIALECTS = {  # name: (path, the body asking for n tokens, whether a stream's last event ends a whole answer)
    "chat": (CHAT, lambda n: {"messages": HI, "max_tokens": n}, lambda last: last == "[DONE]"),
    "text": ("/v1/completions", lambda n: {"prompt": "Once upon a time", "max_tokens": n}, lambda last: last == "[DONE]"),
    "native": ("/completion", lambda n: {"prompt": "Once upon a time", "n_predict": n}, lambda last: json.loads(last)["stop"] is True),
    "responses": ("/v1/responses", lambda n: {"input": "Hi", "max_output_tokens": n},
                  lambda last: json.loads(last)["type"] in ("response.completed", "response.incomplete")),
    "messages": ("/v1/messages", lambda n: {"messages": HI, "max_tokens": n}, lambda last: json.loads(last)["type"] == "message_stop"),
}  # fmt: skip


def is_whole(dialect: str, answer: dict) -> bool:
    """A whole (not streamed) answer that ran to its end, in its dialect's words."""
    if dialect in ("chat", "text"):
        return answer["choices"][0]["finish_reason"] in ("length", "stop") and answer["usage"]["completion_tokens"] >= 1
    if dialect == "native":
        return answer["stop"] is True and answer["tokens_predicted"] >= 1
    if dialect == "responses":
        return answer["status"] in ("completed", "incomplete") and answer["usage"]["output_tokens"] >= 1
    return answer["stop_reason"] in ("end_turn", "max_tokens") and answer["usage"]["output_tokens"] >= 1


def stay(url: str, dialect: str, stream: bool) -> bool:
    """Ask, read the whole answer; whether it is whole."""
    path, body, finished = DIALECTS[dialect]
    with httpx.Client(base_url=url, timeout=300) as client:
        if not stream:
            r = client.post(path, json=body(N_OUTPUT))
            return r.status_code == 200 and is_whole(dialect, r.json())
        with client.stream("POST", path, json={**body(N_OUTPUT), "stream": True}) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code == 200 and len(events) >= 2 and finished(events[-1])


def leave_mid_stream(url: str, dialect: str) -> None:
    """Read the stream's first event, then close the connection."""
    path, body, _ = DIALECTS[dialect]
    asked = {**body(N_LEAVING), **LONG, "stream": True}
    with httpx.Client(base_url=url, timeout=300) as client, client.stream("POST", path, json=asked) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))


def leave_at_once(url: str, dialect: str, stream: bool) -> None:
    """Send the request on a bare socket and close it: the server finds the client gone before its first token."""
    path, body, _ = DIALECTS[dialect]
    content = json.dumps({**body(N_LEAVING), **LONG, "stream": stream}).encode()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n"
    with socket.create_connection((host, port)) as s:
        s.sendall(head.encode() + content)


def leave(url: str, j: int) -> None:
    """The j-th client that leaves: in turn mid-stream, before its stream's first token, before its whole answer."""
    dialect = list(DIALECTS)[j % len(DIALECTS)]
    if j % 3 == 0:
        leave_mid_stream(url, dialect)
    else:
        leave_at_once(url, dialect, stream=j % 3 == 1)


def wait_idle(url: str) -> None:
    """Until no slot is processing: fails after two minutes (a request that never ends)."""
    wait_until(lambda: not any(s["is_processing"] for s in httpx.get(f"{url}/slots", timeout=30).json()), 120, interval=0.1)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_ten_times_the_load_with_a_third_leaving_loses_nothing_and_stalls_nothing(slot_server):
    """40 clients on 4 slots, across the five dialects, streamed and whole; every third leaves mid-stream or before its
    first token. Every one that stays gets its whole answer; /health answers all through; then every slot is free,
    /metrics shows nothing processing or deferred, the leavers' tokens stopped with them, and a request completes."""
    url = slot_server.url
    wait_idle(url)
    before = metrics(url)["llamacpp:tokens_predicted_total"]
    health: list[int] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            health.append(httpx.get(f"{url}/health", timeout=60).status_code)
            done.wait(0.05)

    dialects = list(DIALECTS)
    staying = [(dialects[i % len(dialects)], i % 2 == 0) for i in range(N_CLIENTS) if i % 3 != 2]  # a third leave
    n_leaving = N_CLIENTS - len(staying)
    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with ThreadPoolExecutor(N_CLIENTS) as pool:
            asked = [(d, s, pool.submit(stay, url, d, s)) for d, s in staying]
            left = [pool.submit(leave, url, j) for j in range(n_leaving)]
            answers = [(d, s, f.result()) for d, s, f in asked]
            for f in left:
                f.result()
        assert [(d, s) for d, s, whole in answers if not whole] == []  # every client that stayed got a whole answer
        wait_idle(url)
    finally:
        done.set()
        poller.join()
    assert health and set(health) == {200}, health  # /health answered all through
    after = metrics(url)
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    # the leavers stopped with their clients: the stayers' tokens and a few more (had the leavers' whole answers run to
    # their end, they alone would be over 1,000 tokens)
    assert after["llamacpp:tokens_predicted_total"] - before < len(answers) * N_OUTPUT + n_leaving * N_LEAVING / 8
    assert stay(url, "chat", stream=True) and stay(url, "messages", stream=False)  # and the server still serves
