"""Detokenizer and stop matcher: the pieces both servers use to turn tokens into safe text."""

from llmkit.text import Detokenizer, StopMatcher, utf8_tail


def feed(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.push(p) for p in pieces)


def test_detokenizer_holds_back_incomplete_utf8():
    pieces = {1: "日".encode()[:1], 2: "日".encode()[1:], 3: "本".encode()}
    detok = Detokenizer(pieces.__getitem__)
    assert detok.push(1) == ""  # first byte of a 3-byte character: nothing to send yet
    assert detok.push(2) == "日"
    assert detok.push(3) == "本"
    assert detok.flush() == ""


def test_detokenizer_flush_marks_an_unfinished_character():
    detok = Detokenizer({1: b"ok\xe6"}.__getitem__)
    assert detok.push(1) == "ok"
    assert detok.flush() == "\ufffd"


def test_stop_string_split_across_pieces_is_never_emitted():
    m = StopMatcher(["</end>"])
    out = feed(m, ["Hello </", "en", "d> ignored"])
    assert out == "Hello "
    assert m.stopped
    assert m.push("more") == ""


def test_partial_match_that_turns_out_not_to_be_a_stop_is_released():
    m = StopMatcher(["STOP"])
    out = feed(m, ["a ST", "OCK"])
    assert out == "a STOCK"
    assert not m.stopped
    assert m.flush() == ""


def test_held_text_comes_out_at_flush():
    m = StopMatcher(["###"])
    assert m.push("x #") == "x "
    assert m.flush() == "#"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert feed(m, ["hello world"]) == "hel"
    assert m.word == "lo w"  # the stop that matched, as llama-server's stopping_word


def test_no_stops_passes_everything():
    m = StopMatcher([])
    assert feed(m, ["a", "b"]) == "ab"
    assert StopMatcher([""]).push("x") == "x"


def test_utf8_tail_keeps_an_unfinished_character_and_refuses_what_utf8_forbids():
    assert utf8_tail(b"", b"abc") == b"" and utf8_tail(b"", "あ".encode()[:2]) == b"\xe3\x81"
    assert utf8_tail(b"\xe3\x81", b"\x82") == b""  # あ finished
    assert utf8_tail(b"\xe3", b"a") is None  # an unfinished character cut short
    for pending, piece in ((b"", b"\x80"), (b"", b"\xf0\x82"), (b"\xed", b"\xa0"), (b"\xf4", b"\x90"), (b"", b"\xc1")):
        assert utf8_tail(pending, piece) is None, (pending, piece)  # stray, overlong, surrogate, past U+10FFFF, overlong
