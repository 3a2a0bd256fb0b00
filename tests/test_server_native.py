"""llama-server's own dialect on the slot server, over real HTTP: the paths without ``/v1``
and the native ``POST /completion`` (request fields, answer keys in llama-server's order,
stop types, the stream without ``[DONE]``, probabilities, prompt cache, bad input).

One server for the module: 2 slots of 1024 tokens, greedy, one CPU thread.
Expected values come from the server itself (the OpenAI routes, /tokenize, a
first answer), never from numbers written here.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from llmkit.course import launch

from helpers import post, wait_until

COUNT = "Count: 1, 2, 3, 4,"
HELLO = [{"role": "user", "content": "Say hello."}]

# server-task.cpp, server_task_result_cmpl_final::to_json_non_oaicompat, in order
FINAL_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"]  # fmt: skip
# server_task_result_cmpl_partial::to_json_non_oaicompat
PARTIAL_KEYS = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"]
PROB_KEYS = ["id", "token", "bytes", "logprob", "top_logprobs"]


@pytest.fixture(scope="module")
def server():
    with launch.serve("slots", "-np", "2", "-c", "2048", "--temp", "0", "-t", "1") as s:
        yield s


def complete(server, **body) -> dict:
    r = post(server, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, text: str, add_special: bool = True) -> list[int]:
    return post(server, "/tokenize", {"content": text, "add_special": add_special}).json()["tokens"]


def detokenize(server, tokens: list[int]) -> str:
    return post(server, "/detokenize", {"tokens": tokens}).json()["content"]


def stream_events(server, path: str, body: dict) -> tuple[httpx.Response, list[bytes]]:
    """The raw events of a stream, checking the framing: each is ``data: ...\\n\\n``."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        raw = r.read()
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
    return r, [e.removeprefix(b"data: ") for e in events]


# --- the paths without /v1 ----------------------------------------------------------


def test_chat_and_models_without_v1_answer_like_v1(server):
    body = {"messages": HELLO, "max_tokens": 8}
    v1, bare = post(server, "/v1/chat/completions", body).json(), post(server, "/chat/completions", body).json()
    assert bare["object"] == v1["object"] == "chat.completion"
    assert bare["choices"][0]["message"] == v1["choices"][0]["message"]
    assert (bare["usage"]["prompt_tokens"], bare["usage"]["completion_tokens"]) == (
        v1["usage"]["prompt_tokens"],
        v1["usage"]["completion_tokens"],
    )
    models = [httpx.get(f"{server.url}{path}", timeout=10).json() for path in ("/v1/models", "/models")]
    assert [m["id"] for m in models[0]["data"]] == [m["id"] for m in models[1]["data"]]
    assert httpx.get(f"{server.url}/v1/health", timeout=10).json() == {"status": "ok"}
    # an OpenAI client pointed at the bare URL uses /chat/completions and /models
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    assert client.chat.completions.create(model="any", **body).choices[0].message.content == v1["choices"][0]["message"]["content"]
    assert client.models.list().data[0].id == models[0]["data"][0]["id"]


def test_completions_and_embeddings_without_v1_are_llama_server_dialect(server):
    """As in llama-server's server.cpp: /completions is /completion, /embeddings is /embedding (not OpenAI's)."""
    body = {"prompt": COUNT, "n_predict": 6}
    native, bare = complete(server, **body), post(server, "/completions", body).json()
    assert list(bare) == list(native) == FINAL_KEYS
    assert bare["content"] == native["content"] == post(server, "/v1/completions", body).json()["choices"][0]["text"]
    texts = ["The cat sat on the mat.", "Stock prices fell."]
    oai = [d["embedding"] for d in post(server, "/v1/embeddings", {"input": texts}).json()["data"]]
    for path, field in (("/embeddings", "input"), ("/embedding", "content")):
        answer = post(server, path, {field: texts}).json()
        assert [a["index"] for a in answer] == [0, 1] and all(len(a["embedding"]) == 1 for a in answer)
        assert np.allclose([a["embedding"][0] for a in answer], oai, atol=1e-6)


def test_apply_template_then_completion_is_the_chat_answer(server):
    prompt = post(server, "/apply-template", {"messages": HELLO}).json()["prompt"]
    assert "Say hello." in prompt and prompt != "Say hello."
    chat = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 12}).json()
    native = complete(server, prompt=prompt, n_predict=12)
    assert native["content"] == chat["choices"][0]["message"]["content"]
    assert native["tokens_evaluated"] == chat["usage"]["prompt_tokens"]


# --- /completion, whole ----------------------------------------------------------------


def test_completion_answer_limit(server):
    r = complete(server, prompt=COUNT, n_predict=6, return_tokens=True)
    assert list(r) == FINAL_KEYS  # llama-server's keys, in its order; no probabilities unless asked
    assert r["stop"] is True and r["index"] == 0 and r["id_slot"] in (0, 1)
    assert r["stop_type"] == "limit" and r["stopping_word"] == "" and r["truncated"] is False
    assert r["tokens_predicted"] == len(r["tokens"]) == 6 == r["timings"]["predicted_n"]
    assert detokenize(server, r["tokens"]) == r["content"]
    assert r["content"] == post(server, "/v1/completions", {"prompt": COUNT, "max_tokens": 6}).json()["choices"][0]["text"]
    prompt_tokens = tokenize(server, COUNT)
    assert r["tokens_evaluated"] == len(prompt_tokens) == r["timings"]["prompt_n"] + r["timings"]["cache_n"]
    assert r["prompt"] == detokenize(server, prompt_tokens) and r["prompt"].endswith(COUNT)
    # the slot holds the prompt and every token but the last (sampled, never decoded)
    assert r["tokens_cached"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1
    assert r["has_new_line"] == ("\n" in r["content"])
    assert r["model"] == httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    settings = r["generation_settings"]
    assert settings["n_predict"] == settings["max_tokens"] == 6 and settings["temperature"] == 0 and settings["stream"] is False
    assert settings["stop"] == [] and settings["n_probs"] == 0 and settings["grammar"] == ""
    assert complete(server, prompt=COUNT, n_predict=6)["tokens"] == []  # tokens only with return_tokens


def test_completion_stop_word(server):
    full = complete(server, prompt=COUNT, n_predict=12)["content"]
    word = full[full.index(",", 3) : full.index(",", 3) + 3]  # e.g. ", 7": taken from the answer itself
    r = complete(server, prompt=COUNT, n_predict=12, stop=["never appears", word], return_tokens=True)
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    assert r["content"] == full[: full.index(word)] and r["tokens_predicted"] < 12
    assert r["tokens_predicted"] == len(r["tokens"]) and detokenize(server, r["tokens"]).startswith(r["content"] + word)
    assert r["generation_settings"]["stop"] == ["never appears", word]


def test_completion_eos(server):
    prompt = post(server, "/apply-template", {"messages": HELLO}).json()["prompt"]
    chat = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 200}).json()
    assert chat["choices"][0]["finish_reason"] == "stop"  # the model ends its answer
    r = complete(server, prompt=prompt, n_predict=200)
    assert r["stop_type"] == "eos" and r["stopping_word"] == "" and r["tokens_predicted"] < 200
    assert r["content"] == chat["choices"][0]["message"]["content"]


def test_completion_probabilities(server):
    r = complete(server, prompt=COUNT, n_predict=5, n_probs=3, return_tokens=True)
    probs = r["completion_probabilities"]
    assert list(r) == [*FINAL_KEYS, "completion_probabilities"]
    assert len(probs) == r["tokens_predicted"] and [p["id"] for p in probs] == r["tokens"]
    for p in probs:
        assert list(p) == PROB_KEYS and p["logprob"] <= 0 and len(p["top_logprobs"]) == 3
        assert list(p["top_logprobs"][0]) == PROB_KEYS[:-1]
        assert [t["logprob"] for t in p["top_logprobs"]] == sorted((t["logprob"] for t in p["top_logprobs"]), reverse=True)
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the sampled token is the most likely one
    assert b"".join(bytes(p["bytes"]) for p in probs).decode() == r["content"]
    assert r["generation_settings"]["n_probs"] == 3


def test_response_fields_picks_by_slash_path(server):
    """llama-server's ``response_fields``: only the listed fields, keyed by their path; a path to nothing is left out."""
    whole = complete(server, prompt=COUNT, n_predict=4)
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no/such/field", "content/not_an_object"]
    picked = complete(server, prompt=COUNT, n_predict=4, response_fields=fields)
    assert picked == {"content": whole["content"], "generation_settings/n_predict": 4, "timings/predicted_n": 4}
    _, events = stream_events(server, "/completion", {"prompt": COUNT, "n_predict": 4, "response_fields": ["stop", "tokens_predicted"]})
    assert json.loads(events[-1]) == {"stop": True, "tokens_predicted": 4}  # a stream's last object too, as llama-server
    assert "content" in json.loads(events[0])  # its chunks are whole


@pytest.mark.parametrize("shape", ["pairs of text", "object of ids", "pairs of ids, false"])
def test_logit_bias_bans_tokens(server, shape):
    """llama-server's ``logit_bias`` forms: [[text or id, bias], ...] or {"id or text": bias}; false bans a token."""
    free = complete(server, prompt=COUNT, n_predict=4, return_tokens=True)
    banned = free["tokens"][0]
    bias = {"pairs of text": [[detokenize(server, [banned]), -100]], "object of ids": {str(banned): -100},
            "pairs of ids, false": [[banned, False]]}[shape]  # fmt: skip
    r = complete(server, prompt=COUNT, n_predict=4, return_tokens=True, logit_bias=bias)
    assert banned not in r["tokens"] and r["tokens"] != free["tokens"]
    favoured = tokenize(server, " banana", add_special=False)[0]
    assert complete(server, prompt=COUNT, n_predict=1, return_tokens=True, logit_bias={str(favoured): 100})["tokens"] == [favoured]


def test_prompt_cache(server):
    prompt = "A long shared preamble about serving language models in slots. " * 8
    first = complete(server, prompt=prompt, n_predict=4, id_slot=1)
    again = complete(server, prompt=prompt, n_predict=4, id_slot=1)
    n = again["tokens_evaluated"]
    assert first["id_slot"] == again["id_slot"] == 1 and n > 60
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1  # the last token is read again
    assert again["tokens_cached"] == n + again["tokens_predicted"] - 1
    cold = complete(server, prompt=prompt, n_predict=4, id_slot=1, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == n
    assert first["content"] == again["content"] == cold["content"]


def test_context_full_is_truncated(server):
    n_ctx = httpx.get(f"{server.url}/props", timeout=10).json()["default_generation_settings"]["n_ctx"]
    prompt = (tokenize(server, "hello " * n_ctx) * 2)[: n_ctx - 4]
    r = complete(server, prompt=prompt, n_predict=-1, ignore_eos=True)
    assert r["stop_type"] == "limit" and r["truncated"] is True and r["tokens_evaluated"] == n_ctx - 4
    assert r["tokens_cached"] == n_ctx == r["tokens_evaluated"] + r["tokens_predicted"] - 1


def test_prompt_shapes(server):
    head, tail = "Count: 1, 2,", " 3, 4,"
    ids = tokenize(server, head) + tokenize(server, tail, add_special=False)
    by_ids = complete(server, prompt=ids, n_predict=6)
    assert by_ids["tokens_evaluated"] == len(ids)
    for prompt in ([head, *ids[len(tokenize(server, head)) :]], [ids], {"prompt_string": [head, *ids[len(tokenize(server, head)) :]]}):
        r = complete(server, prompt=prompt, n_predict=6)
        assert (r["tokens_evaluated"], r["content"]) == (len(ids), by_ids["content"]), prompt
    by_text = complete(server, prompt=COUNT, n_predict=6)["content"]
    for prompt in ([COUNT], {"prompt_string": COUNT}):
        assert complete(server, prompt=prompt, n_predict=6)["content"] == by_text


# --- /completion, streamed --------------------------------------------------------------


def test_completion_stream(server):
    body = {"prompt": COUNT, "n_predict": 8, "n_probs": 2}
    whole = complete(server, **body, return_tokens=True)
    r, events = stream_events(server, "/completion", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert b"[DONE]" not in events  # llama-server ends its native stream without it
    *chunks, final = [json.loads(e) for e in events]
    assert chunks and all(list(c) == [*PARTIAL_KEYS, "completion_probabilities"] and c["stop"] is False for c in chunks)
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    streamed = [p for c in chunks for p in c["completion_probabilities"]]
    assert [(p["id"], [t["id"] for t in p["top_logprobs"]]) for p in streamed] == [
        (p["id"], [t["id"] for t in p["top_logprobs"]]) for p in whole["completion_probabilities"]
    ]
    assert np.allclose([p["logprob"] for p in streamed], [p["logprob"] for p in whole["completion_probabilities"]], atol=1e-3)
    counts = [c["tokens_predicted"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == final["tokens_predicted"] == 8
    assert all(c["tokens_evaluated"] == whole["tokens_evaluated"] and c["id_slot"] == final["id_slot"] for c in chunks)
    assert list(final) == FINAL_KEYS  # the totals; content and tokens were in the chunks, probabilities too
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert final["stop_type"] == "limit" and final["generation_settings"]["stream"] is True
    assert final["timings"]["predicted_n"] == 8


def test_completion_stream_stop_word(server):
    full = complete(server, prompt=COUNT, n_predict=12)["content"]
    word = full[full.index(",", 3) : full.index(",", 3) + 3]
    _, events = stream_events(server, "/completions", {"prompt": COUNT, "n_predict": 12, "stop": [word]})
    *chunks, final = [json.loads(e) for e in events]
    assert "".join(c["content"] for c in chunks) == full[: full.index(word)]
    assert (final["stop_type"], final["stopping_word"]) == ("word", word)


def test_several_prompts_are_several_completions(server):
    """As llama-server's test_completion_with_tokens_input: a list of prompts is answered with a list, one
    completion each, in order; token ids and text for the same prompt give the same greedy answer."""
    text = "I believe the meaning of life is"
    tokens = tokenize(server, text)
    (alone,) = [complete(server, prompt=tokens, n_predict=8)]
    for prompt in ([tokens, tokens], [tokens, text], [tokens, {"prompt_string": text}]):
        r = post(server, "/completion", {"prompt": prompt, "n_predict": 8})
        assert r.status_code == 200, r.text
        answers = r.json()
        assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1]
        assert [a["content"] for a in answers] == [alone["content"]] * 2
    _, events = stream_events(server, "/completion", {"prompt": [tokens, text], "n_predict": 8})
    chunks = [json.loads(e) for e in events]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert "".join(c["content"] for c in mine) == alone["content"] and [c["stop"] for c in mine][-1] is True


def test_a_refused_prompt_in_a_list_cancels_the_ones_before_it(server):
    """The first prompt is queued before the second is found too long: it must not run on with no reader
    (this server has no default budget, so it would generate until its slot is full)."""
    r = post(server, "/completion", {"prompt": ["Tell a story.", "hello " * 1200]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    wait_until(lambda: not any(s["is_processing"] for s in httpx.get(f"{server.url}/slots").json()), timeout=5, interval=0.05)


def test_the_generation_rate_excludes_the_first_token(server):
    """As llama-server (test_metrics_generation_rate_excludes_first_token): the first token comes from the
    prompt's last step, so the rate counts decode steps, one fewer than tokens."""
    one = complete(server, prompt="I believe", n_predict=1)["timings"]
    assert (one["predicted_n"], one["predicted_per_second"], one["predicted_per_token_ms"]) == (1, 0.0, 0.0)
    many = complete(server, prompt="I believe", n_predict=16)["timings"]
    assert many["predicted_n"] == 16
    assert many["predicted_per_second"] == pytest.approx(1e3 / many["predicted_ms"] * 15)
    assert many["predicted_per_token_ms"] == pytest.approx(many["predicted_ms"] / 15)


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": 42}, ["'prompt'", "a string, a list of token ids"]),
        ({"prompt": {"text": "hi"}}, ["'prompt'", "prompt_string"]),
        ({"prompt": [1.5, 2]}, ["'prompt'"]),
        ({"prompt": [True, 2]}, ["'prompt'"]),
        ({"prompt": ["one"] * 65}, ["'prompt'", "at most 64 prompts"]),
        ({"prompt": ["one", 42.5]}, ["'prompt'", "a string, a list of token ids"]),
        ({"prompt": []}, ["'prompt'", "empty"]),
        ({"prompt": {"prompt_string": "hi", "multimodal_data": ["AAAA"]}}, ["'prompt'", "multimodal_data"]),
        ({"prompt": [1, 10**9]}, ["'prompt'", "vocabulary"]),
        ({"prompt": [[]]}, ["empty"]),
        ({}, ["'prompt'"]),
        ({"prompt": "hi", "n_predict": -2}, ["'n_predict'"]),
        ({"prompt": "hi", "n_predict": "5"}, ["'n_predict'"]),
        ({"prompt": "hi", "id_slot": 2}, ["id_slot", "between 0 and 1"]),
        ({"prompt": "hi", "n_probs": 99}, ["'n_probs'"]),
        ({"prompt": "hi", "grammar": 'root ::= "a', "stream": True}, ["grammar"]),
    ],
)
def test_bad_input_is_400(server, body, words):
    for path in ("/completion", "/completions"):
        r = post(server, path, body)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        error = r.json()["error"]
        assert list(error) == ["code", "message", "type"] and error["code"] == 400 and error["type"] == "invalid_request_error"
        assert all(w in error["message"] for w in words), error


def test_prompt_longer_than_the_slot_context(server):
    r = post(server, "/completion", {"prompt": "hello " * 1200})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024
