"""Text helpers both servers share: incremental detokenizer, stop-string matcher, UTF-8 checks.

A token is a run of bytes, not of characters: SmolLM2 spells "日" as three
byte-tokens, so sending each token as it comes would put half a character
(U+FFFD on the client) on the wire. ``Detokenizer`` holds incomplete UTF-8
back until the character is whole (llama-server: ``validate_utf8`` in
server-common.cpp). ``StopMatcher`` holds back text that could still become
a stop string, so that a stop string split across tokens is never emitted
(llama-server: ``find_stopping_strings`` in server-context.cpp). ``utf8_tail``
tells whether a token's bytes keep the text UTF-8 (the grammar sampler asks it); ``is_unicode`` whether a
string from a client can be written as UTF-8 at all (a lone surrogate cannot).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class Detokenizer:
    """Turns token ids into text pieces that never end inside a UTF-8 character."""

    def __init__(self, token_to_piece: Callable[[int], bytes]):
        self._piece = token_to_piece
        # The standard library's incremental decoder keeps an incomplete
        # trailing sequence in its buffer until the next bytes complete it.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._piece(token))

    def flush(self) -> str:
        """End of stream: whatever is left (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text; never releases text that might start one."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.word = ""  # the stop string that matched (the earliest; at a tie, the first listed)
        self.after = ""  # the text that came after it, in the same push

    def push(self, text: str) -> str:
        """Add text; return the part that is safe to emit. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self._held += text
        hits = [(i, s) for s in self.stops if (i := self._held.find(s)) >= 0]
        if hits:
            at, self.word = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            out, self.after, self._held = self._held[:at], self._held[at + len(self.word) :], ""
            return out
        keep = max((self._partial_len(s) for s in self.stops), default=0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def _partial_len(self, stop: str) -> int:
        """Length of the longest tail of the held text that is a proper prefix of ``stop``."""
        for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
            if self._held.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        """End of generation without a match: the held-back text is real output."""
        out, self._held = self._held, ""
        return out


def utf8_tail(pending: bytes, piece: bytes) -> bytes | None:
    """The unfinished character at the end of ``pending + piece``, or None if those bytes cannot be UTF-8."""
    if not pending and piece.isascii():
        return b""
    if pending and piece and not 0x80 <= piece[0] < 0xC0:  # the unfinished character needs a continuation byte
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        decoder.decode(pending + piece)
        tail: bytes = decoder.getstate()[0]
        if len(tail) > 1:  # Python judges ED A0 (a surrogate) only at the last byte: finish the character
            size = 3 if tail[0] < 0xF0 else 4  # two bytes and unfinished: a 3- or 4-byte character
            (tail + b"\x80" * (size - len(tail))).decode()
    except UnicodeDecodeError:
        return None
    return tail


def is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate: JSON can say "\\ud800", UTF-8 (and so the tokenizer) cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
