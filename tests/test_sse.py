"""SSE framing (``llmkit.server.sse``) and each dialect's answers (``llmkit.server.dialects``), model-free: a hand-made
request in, dicts out."""

from __future__ import annotations

import json

from llmkit.engine import End, Outcome, Piece, Request, RequestParams
from llmkit.engine.request import TokenLogprob
from llmkit.server.dialects.blocks import Blocks
from llmkit.server.dialects.messages import MessagesFormatter
from llmkit.server.dialects.native import NativeFormatter
from llmkit.server.dialects.openai_chat import ChatFormatter
from llmkit.server.dialects.openai_text import TextFormatter
from llmkit.server.dialects.responses import ResponsesFormatter
from llmkit.server.sse import DONE, event, named_event
from llmkit.server.tools import CallParser, Delta, TextParser
from llmkit.timings import Timings

PIECES = {1: b"He", 2: b"llo", 3: b"\xe2\x82\xac"}  # token id -> bytes (3: the euro sign)


def text(pieces: list[Piece]) -> TextParser:
    answer = TextParser()
    for p in pieces:
        answer.push(p.text)
    return answer


def finished(output: list[int], end: End = End.EOS, stopping_word: str = "") -> Request:
    """A request for 3 prompt tokens (2 of them cached) on slot 0, ended with ``output``."""
    request = Request([7, 8, 9], RequestParams.of(temperature=0, max_tokens=16))
    request.start(0, n_cached=2)
    timings = Timings(cache_n=2, prompt_n=1, predicted_n=len(output))
    request.finish(Outcome(end, tuple(output), 3, 2, timings, stopping_word, id_slot=0, tokens_cached=5))
    return request


def ended(request: Request) -> Outcome:
    assert request.outcome is not None
    return request.outcome


def test_an_event_is_compact_utf8_and_ends_with_a_blank_line():
    assert event({"content": "€ ok", "n": [1, 2]}) == 'data: {"content":"€ ok","n":[1,2]}\n\n'
    assert DONE == "data: [DONE]\n\n"


def test_a_chat_stream_opens_with_the_role_and_closes_with_the_reason_then_usage():
    fmt = ChatFormatter("m", "fp", token_piece=PIECES.__getitem__, include_usage=True)
    request = finished([1, 2])
    (opening,) = fmt.opening(request)
    pieces = [Piece("He", [1]), Piece("llo", [2])]
    (first,), (second,) = (fmt.chunk(request, p, text([p]).push(p.text)) for p in pieces)
    reason, totals = fmt.closing(ended(request), text(pieces))

    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert [c["choices"][0]["delta"] for c in (first, second)] == [{"content": "He"}, {"content": "llo"}]
    assert reason["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert totals["choices"] == [] and "timings" not in reason and totals["timings"] == ended(request).timings.to_dict()
    assert totals["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
    chunks = [opening, first, second, reason, totals]
    assert {c["id"] for c in chunks} == {fmt.id} and fmt.id.startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["created"] for c in chunks} == {fmt.created}
    assert fmt.done == DONE


def test_without_usage_the_timings_ride_on_the_reason_chunk():
    (reason,) = ChatFormatter("m", "fp").closing(ended(finished([1], End.LIMIT)), TextParser())
    assert reason["choices"][0]["finish_reason"] == "length" and "timings" in reason and "usage" not in reason


def test_a_whole_text_completion():
    fmt = TextFormatter("m", "fp")
    pieces = [Piece("He", [1]), Piece("llo", [2])]
    request = finished([1, 2])
    body = fmt.response(ended(request), pieces, text(pieces))
    assert fmt.opening(request) == [] and fmt.id.startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 2 and body["model"] == "m" and body["system_fingerprint"] == "fp"


def test_logprobs_in_the_chat_shape_and_the_legacy_text_shape():
    items = [TokenLogprob(3, -0.5, [(3, -0.5), (1, -2.0)])]
    euro = {"id": 3, "token": "€", "bytes": [226, 130, 172], "logprob": -0.5}
    he = {"id": 1, "token": "He", "bytes": [72, 101], "logprob": -2.0}
    chat = ChatFormatter("m", "fp", n_top=1, token_piece=PIECES.__getitem__).logprobs(items)
    assert chat == {"content": [euro | {"top_logprobs": [euro]}]}
    text = TextFormatter("m", "fp", n_top=2, token_piece=PIECES.__getitem__).logprobs(items)
    assert text["tokens"] == ["€"] and text["token_logprobs"] == [-0.5]
    assert text["top_logprobs"] == [{"€": -0.5, "He": -2.0}] and text["content"] == [euro | {"top_logprobs": [euro, he]}]
    assert ChatFormatter("m", "fp").logprobs(items) is None  # not asked for


def test_a_native_stream_counts_its_tokens_and_ends_without_done():
    fmt = NativeFormatter("m", "<prompt>", params=RequestParams(stream=True))
    request = finished([1, 2, 3])
    chunks = [c for p in (Piece("He", [1]), Piece("llo€", [2, 3])) for c in fmt.chunk(request, p, [])]
    (last,) = fmt.closing(ended(request), TextParser())
    assert [(c["content"], c["tokens"], c["tokens_predicted"], c["stop"]) for c in chunks] == [
        ("He", [1], 1, False), ("llo€", [2, 3], 3, False)]  # fmt: skip
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == [] and last["tokens_predicted"] == 3
    assert last["prompt"] == "<prompt>" and last["generation_settings"]["stream"] is True and last["id_slot"] == 0
    assert fmt.opening(request) == [] and fmt.done is None
    assert json.loads(event(last).removeprefix("data: "))["timings"] == ended(request).timings.to_dict()


def test_a_whole_native_answer_lists_its_tokens_only_if_asked():
    request, pieces = finished([1, 2]), [Piece("He", [1]), Piece("llo", [2])]
    assert NativeFormatter("m", "p").response(ended(request), pieces, text(pieces))["tokens"] == []
    body = NativeFormatter("m", "p", return_tokens=True).response(ended(request), pieces, text(pieces))
    assert body["tokens"] == [1, 2] and body["content"] == "Hello" and body["tokens_evaluated"] == 3


# --- the Responses and Messages APIs: named events, typed items and blocks ---------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


def stream_of(fmt, request: Request, texts: list[str], answer) -> list[dict]:
    """Every event of a stream, as ``generation.stream`` asks for them."""
    events = fmt.opening(request)
    for t in texts:
        events += fmt.chunk(request, Piece(t, [1]), answer.push(t))
    return events + fmt.chunk(request, Piece("", []), answer.finish()) + fmt.closing(ended(request), answer)


def test_a_responses_stream_opens_items_and_parts_in_openais_order():
    fmt, request = ResponsesFormatter("m", {"tools": []}), finished([1, 2, 3])
    events = stream_of(fmt, request, ["Hi", " there", CALL[:20], CALL[20:]], CallParser())
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds[:5] == ["created", "in_progress", "output_item.added", "content_part.added", "output_text.delta"]
    assert kinds[5:] == [
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done",  # the message, closed by the call
        "output_item.added", *["function_call_arguments.delta"] * (kinds.count("function_call_arguments.delta")),
        "function_call_arguments.done", "output_item.done", "completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    message, call = done["output"]
    assert message["content"][0]["text"] == "Hi there" and message["status"] == "completed"
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "add", {"a": 1})
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["id"][3:] == call["call_id"][5:]
    assert {e.get("output_index") for e in events if "item" in e} == {0, 1}
    assert done["usage"]["input_tokens_details"]["cached_tokens"] == 2 and done["status"] == "completed" and done["tools"] == []
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    # cut by the budget: incomplete, and the whole answer says the same
    cut = finished([1, 2], End.LIMIT)
    body = ResponsesFormatter("m", {}).response(ended(cut), [], text([Piece("Hi", [1])]))
    assert (body["status"], body["incomplete_details"], body["output"][0]["status"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
        "incomplete",
    )


def test_a_messages_stream_numbers_its_blocks_and_ends_with_the_stop_reason():
    fmt, request = MessagesFormatter("m"), finished([1, 2, 3])
    events = stream_of(fmt, request, ["Hi", CALL], CallParser())
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", *["content_block_delta"] * (len(events) - 9), "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"] == {
        "input_tokens": 1, "cache_read_input_tokens": 2, "cache_creation_input_tokens": 0, "output_tokens": 0}  # fmt: skip
    blocks = [e for e in events if e["type"] == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [(0, "text"), (1, "tool_use")]
    tool_json = "".join(e["delta"]["partial_json"] for e in events if e.get("index") == 1 and e["type"] == "content_block_delta")
    assert json.loads(tool_json) == {"a": 1} and blocks[1]["content_block"]["id"].startswith("toolu_")
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and events[-2]["usage"] == {"output_tokens": 3}
    # whole: the same blocks; a stop string is the stop_sequence
    request = finished([1, 2, 3], End.WORD, "END")
    body = MessagesFormatter("m").response(ended(request), [], text([Piece("Hi", [1])]))
    assert body["content"] == [{"type": "text", "text": "Hi"}] and (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert named_event({"type": "ping"}) == 'event: ping\ndata: {"type":"ping"}\n\n'


class Written:
    """A dialect's block events, as names: what ``Blocks`` asked for, in order."""

    def started(self, index: int, delta: Delta) -> list[dict]:
        return [{"start": index, "kind": "text" if delta.index < 0 else delta.name}]

    def wrote(self, index: int, delta: Delta) -> list[dict]:
        return [{"write": index, "text": delta.content or delta.arguments}]

    def stopped(self, index: int, written: str, status: str) -> list[dict]:
        return [{"stop": index, "written": written, "status": status}]


def test_blocks_open_one_typed_block_at_a_time_and_close_it_when_the_kind_changes():
    blocks = Blocks(Written())
    events = blocks.push([Delta("Hi"), Delta(" there")])
    events += blocks.push([Delta(index=0, id="a", name="f"), Delta(index=0, arguments='{"x"'), Delta(index=0, arguments=": 1}")])
    events += blocks.push([Delta(index=1, id="b", name="g")])  # the next call: a block of its own, though of the same kind
    events += blocks.close("incomplete") + blocks.close("incomplete")  # a second close: nothing open
    assert events == [
        {"start": 0, "kind": "text"}, {"write": 0, "text": "Hi"}, {"write": 0, "text": " there"},
        {"stop": 0, "written": "Hi there", "status": "completed"},
        {"start": 1, "kind": "f"}, {"write": 1, "text": '{"x"'}, {"write": 1, "text": ": 1}"},
        {"stop": 1, "written": '{"x": 1}', "status": "completed"},
        {"start": 2, "kind": "g"}, {"stop": 2, "written": "", "status": "incomplete"},
    ]  # fmt: skip
