"""SSE framing and the JSON of completion answers (``llmkit.server.sse``), model-free: a hand-made request in, dicts out."""

from __future__ import annotations

import json

from llmkit.engine import Piece, Request
from llmkit.engine.request import TokenLogprob
from llmkit.llama import SamplingParams
from llmkit.server.sse import DONE, Formatter, NativeFormatter, event

PIECES = {1: b"He", 2: b"llo", 3: b"\xe2\x82\xac"}  # token id -> bytes (3: the euro sign)


def finished(output: list[int], reason: str = "stop") -> Request:
    request = Request([7, 8, 9], SamplingParams(temperature=0, max_tokens=16))
    request.output, request.finish_reason, request.slot_id = output, reason, 0
    request.timings.cache_n = 2
    return request


def test_an_event_is_compact_utf8_and_ends_with_a_blank_line():
    assert event({"content": "€ ok", "n": [1, 2]}) == 'data: {"content":"€ ok","n":[1,2]}\n\n'
    assert DONE == "data: [DONE]\n\n"


def test_a_chat_stream_opens_with_the_role_and_closes_with_the_reason_then_usage():
    fmt = Formatter(True, "m", "fp", token_piece=PIECES.__getitem__)
    request = finished([1, 2])
    (opening,) = fmt.opening()
    first, second = fmt.chunk(request, Piece("He", [1])), fmt.chunk(request, Piece("llo", [2]))
    reason, totals = fmt.closing(request, include_usage=True)

    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert [c["choices"][0]["delta"] for c in (first, second)] == [{"content": "He"}, {"content": "llo"}]
    assert reason["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert totals["choices"] == [] and "timings" not in reason and totals["timings"] == request.timings.to_dict()
    assert totals["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
    chunks = [opening, first, second, reason, totals]
    assert {c["id"] for c in chunks} == {fmt.id} and fmt.id.startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["created"] for c in chunks} == {fmt.created}
    assert fmt.done == DONE


def test_without_usage_the_timings_ride_on_the_reason_chunk():
    (reason,) = Formatter(True, "m", "fp").closing(finished([1], "length"), include_usage=False)
    assert reason["choices"][0]["finish_reason"] == "length" and "timings" in reason and "usage" not in reason


def test_a_whole_text_completion():
    fmt = Formatter(False, "m", "fp")
    body = fmt.response(finished([1, 2]), [Piece("He", [1]), Piece("llo", [2])])
    assert fmt.opening() == [] and fmt.id.startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 2 and body["model"] == "m" and body["system_fingerprint"] == "fp"


def test_logprobs_in_the_chat_shape_and_the_legacy_text_shape():
    items = [TokenLogprob(3, -0.5, [(3, -0.5), (1, -2.0)])]
    euro = {"id": 3, "token": "€", "bytes": [226, 130, 172], "logprob": -0.5}
    he = {"id": 1, "token": "He", "bytes": [72, 101], "logprob": -2.0}
    chat = Formatter(True, "m", "fp", n_top=1, token_piece=PIECES.__getitem__).logprobs(items)
    assert chat == {"content": [euro | {"top_logprobs": [euro]}]}
    text = Formatter(False, "m", "fp", n_top=2, token_piece=PIECES.__getitem__).logprobs(items)
    assert text["tokens"] == ["€"] and text["token_logprobs"] == [-0.5]
    assert text["top_logprobs"] == [{"€": -0.5, "He": -2.0}] and text["content"] == [euro | {"top_logprobs": [euro, he]}]
    assert Formatter(True, "m", "fp").logprobs(items) is None  # not asked for


def test_a_native_stream_counts_its_tokens_and_ends_without_done():
    fmt = NativeFormatter("m", "<prompt>", stream=True)
    request = finished([1, 2, 3])
    chunks = [fmt.chunk(request, Piece("He", [1])), fmt.chunk(request, Piece("llo€", [2, 3]))]
    (last,) = fmt.closing(request, include_usage=True)
    assert [(c["content"], c["tokens"], c["tokens_predicted"], c["stop"]) for c in chunks] == [
        ("He", [1], 1, False), ("llo€", [2, 3], 3, False)]  # fmt: skip
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == [] and last["tokens_predicted"] == 3
    assert last["prompt"] == "<prompt>" and last["generation_settings"]["stream"] is True and last["id_slot"] == 0
    assert fmt.opening() == [] and fmt.done is None
    assert json.loads(event(last).removeprefix("data: "))["timings"] == request.timings.to_dict()


def test_a_whole_native_answer_lists_its_tokens_only_if_asked():
    request, pieces = finished([1, 2]), [Piece("He", [1]), Piece("llo", [2])]
    assert NativeFormatter("m", "p").response(request, pieces)["tokens"] == []
    body = NativeFormatter("m", "p", return_tokens=True).response(request, pieces)
    assert body["tokens"] == [1, 2] and body["content"] == "Hello" and body["tokens_evaluated"] == 3
