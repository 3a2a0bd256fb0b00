"""Disaggregated prefill and decode: one engine reads the prompt and samples the first token, another goes on from its
KV cells (``RequestParams.hand_off``, ``Engine.submit(..., kv=)``), and the text is the one engine's greedy text; then
the same through vllm-router's PD mode over two slot servers (``llmkit.server.handoff``), one router for the module."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmkit.course import fleet
from llmkit.engine import Engine, EngineConfig, KVState, RequestParams
from llmkit.server.handoff import Handoffs, tokens_sha256

MESSAGES = [{"role": "user", "content": "Write three sentences about the harbour at dawn."}]


def config(**kw) -> EngineConfig:
    return EngineConfig(n_ctx=2048, n_threads=1, **kw)


@pytest.fixture(scope="module")
def greedy(model) -> str:
    with Engine(model, config()) as alone:
        return alone.chat(MESSAGES, max_tokens=40, temperature=0).result()


def handed_over(model, prefill: EngineConfig, decode: EngineConfig, **params) -> tuple[str, object]:
    prompt = model.tokenize_chat(MESSAGES)
    with Engine(model, prefill) as first, Engine(model, decode) as second:
        request = first.submit(prompt, RequestParams.of(max_tokens=1, temperature=0, hand_off=True))
        request.result()
        kv = request.outcome.kv
        assert kv is not None and list(kv.tokens) == prompt and len(kv.output) == 1
        going_on = second.submit(prompt, RequestParams.of(max_tokens=40, temperature=0, **params), kv=kv)
        return going_on.result(), going_on.outcome


def test_the_decode_engine_goes_on_from_the_prefill_engines_cells_with_the_same_greedy_text(model, greedy):
    text, outcome = handed_over(model, config(), config())
    assert text == greedy
    assert outcome.timings.prompt_n == 0 and outcome.n_cached == len(model.tokenize_chat(MESSAGES))  # it read no prompt token


def test_cells_of_another_kv_layout_are_refused_and_the_prompt_is_read_instead(model, greedy):
    text, outcome = handed_over(model, config(n_parallel=2), config(n_parallel=1))  # two KV streams, then one
    assert text == greedy and outcome.timings.prompt_n == len(model.tokenize_chat(MESSAGES))


def test_a_state_of_another_prompt_is_an_error(model):
    prompt = model.tokenize_chat(MESSAGES)
    with Engine(model, config(), start=False) as engine:
        first = engine.submit(prompt, RequestParams.of(max_tokens=1, temperature=0, hand_off=True))
        while not first.done:
            engine.step()
        assert first.outcome is not None and first.outcome.kv is not None
        with pytest.raises(ValueError, match="not this prompt"):
            engine.submit(prompt[:-1], RequestParams(), kv=first.outcome.kv)


# --- through vllm-router's PD mode: a prefill worker and a decode worker, -t 1 each -----------------------------------


@pytest.fixture(scope="module")
def pd():
    """The router (vllm-router --vllm-pd-disaggregation), the prefill worker and the decode worker, -t 1 each."""
    with fleet.start(2, "slots", "round_robin", flags=("--temp", "0"), pd=True) as f:
        yield f.router, *f.replicas


BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "temperature": 0}


def content(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def streamed(url: str) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=BODY | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks


def test_through_the_router_the_answer_is_the_co_located_greedy_text_whole_and_streamed(pd):
    router, _, decode = pd
    alone = httpx.post(f"{decode.url}/v1/chat/completions", json=BODY, timeout=120).json()  # a server on its own
    whole = httpx.post(f"{router.url}/v1/chat/completions", json=BODY, timeout=120).json()
    assert content(whole) == content(alone) and whole["timings"]["prompt_n"] == 0  # the decode worker read no prompt token
    text, chunks = streamed(router.url)
    assert text == content(alone) and chunks[-1]["timings"]["prompt_n"] == 0
    assert decode.log().count("disaggregated decode: ") >= 2  # the cells came over, twice


def test_a_decode_worker_without_the_cells_reads_the_prompt_itself(pd):
    """Expired cells (a prefill worker that is gone, and one that is not a peer: tests/test_server_app.py)."""
    _, prefill, decode = pd
    host, port = prefill.url.removeprefix("http://").split(":")
    alone = content(httpx.post(f"{decode.url}/v1/chat/completions", json=BODY, timeout=120).json())
    tokens = httpx.post(f"{decode.url}/v1/chat/completions/render", json=BODY, timeout=60).json()["token_ids"]
    params = {"do_remote_prefill": True, "remote_host": host, "remote_port": int(port),
              "remote_block_ids": ["kv-1-0"], "first_tokens": [1], "tokens_sha256": tokens_sha256(tokens)}  # fmt: skip
    body = BODY | {"kv_transfer_params": params, "cache_prompt": False}  # (its slot holds the prompt already: not used)
    answer = httpx.post(f"{decode.url}/v1/chat/completions", json=body, timeout=120).json()
    assert content(answer) == alone and answer["timings"]["prompt_n"] == len(tokens)  # the same text, the prompt read here
    assert "no KV cells from the prefill worker" in decode.log()


def test_cells_are_taken_once_and_kept_for_a_while():
    kept, kv = Handoffs(ttl=0.2, max_bytes=8), KVState((1, 2), (3,), bytearray(4))
    key = kept.put(kv)
    assert kept.take(key) is kv and kept.take(key) is None  # once
    old, new = kept.put(kv), kept.put(kv)
    kept.put(kv)
    assert kept.take(old) is None and kept.take(new) is kv  # beyond max_bytes, the oldest goes first
    late = kept.put(kv)
    time.sleep(0.3)
    assert kept.take(late) is None  # expired
