"""A grammar as llama.cpp's sampler takes it: its parse over one model's vocabulary, the only token mask.

- ``GrammarSampler`` a grammar over the vocabulary (llama_sampler_init_grammar)
- ``Grammar``        GBNF text and its checked parse, which each request's ``llmkit.sampling.Sampler`` clones
- ``Trigger``        holds a lazy grammar back until its word is written
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field

import llama_cpp as lc
import numpy as np

from llmkit.llama import Model, capture_errors
from llmkit.text import utf8_tail


class GrammarSampler:
    """llama.cpp's grammar sampler over one model's vocabulary (llama_sampler_init_grammar).

    The only code that masks the vocabulary: ``allows`` asks about one token,
    ``masked`` sets every token the grammar does not allow here to -inf, ``accept``
    moves the grammar on by one token. llama.cpp aborts the process when a grammar
    accepts a token it does not allow, so callers ask first (``Sampler.sample`` does).

    llmkit's own: a token must also keep the text UTF-8. llama.cpp's grammar reads a
    character one byte-token at a time and takes some that UTF-8 forbids (overlong
    F0 82 AA 83, a surrogate, past U+10FFFF); they decode to one U+FFFD per byte,
    and a string the grammar counted within ``maxLength`` comes out longer.
    """

    def __init__(self, model: Model, gbnf: str):
        self._own(model, lc.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root"))

    def _own(self, model: Model, handle: ctypes.c_void_p | None) -> None:
        if not handle:
            raise ValueError("the grammar does not parse (GBNF)")
        self.model, self.handle = model, handle
        self._free = weakref.finalize(self, lc.llama_sampler_free, handle)  # close() frees it, else the collector
        self._data: ctypes.Array | None = None  # the whole vocabulary as candidates (allocated on first use)
        self._pending = b""  # the bytes of an unfinished character, accepted so far
        self._one = (lc.llama_token_data * 1)()

    def clone(self) -> GrammarSampler:
        """A grammar sampler in this one's state, its own to move on (llama_sampler_clone: no second parse)."""
        twin = GrammarSampler.__new__(GrammarSampler)
        twin._own(self.model, lc.llama_sampler_clone(self.handle))
        twin._pending = self._pending
        return twin

    def allows(self, token: int) -> bool:
        one = self._one
        one[0].id, one[0].logit, one[0].p = token, 1.0, 0.0  # type: ignore[assignment]  # ctypes fields take ints
        lc.llama_sampler_apply(self.handle, ctypes.byref(lc.llama_token_data_array(one, 1, -1, False)))
        return one[0].logit != float("-inf") and utf8_tail(self._pending, self.model.pieces[token]) is not None

    def candidates(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> lc.llama_token_data_array:
        """Every token of the vocabulary with its logit, as llama.cpp's samplers take them (one buffer, refilled);
        with ``allowed`` (a mask over the vocabulary), the others at -inf.

        The ids are written again each time: the chain sorts the buffer in place (top_k), so
        after a pick the entry at position t no longer holds token t.
        """
        if self._data is None:
            self._data = (lc.llama_token_data * self.model.n_vocab)()
            self._view = np.ctypeslib.as_array(self._data)
            self._ids = np.arange(self.model.n_vocab, dtype=np.int32)
        self._view["id"], self._view["logit"], self._view["p"] = self._ids, logits, 0.0
        if allowed is not None:
            self._view["logit"][~allowed] = float("-inf")
        return lc.llama_token_data_array(self._data, self.model.n_vocab, -1, False)

    def masked(self, logits: np.ndarray) -> lc.llama_token_data_array:
        """The candidates with every token the grammar does not allow here at -inf."""
        cur = self.candidates(logits, self.model.utf8_continues(self._pending))
        lc.llama_sampler_apply(self.handle, ctypes.byref(cur))
        if not np.isfinite(self._view["logit"]).any():
            raise ValueError("the grammar allows no token here")
        return cur

    def accept(self, token: int) -> None:
        lc.llama_sampler_accept(self.handle, token)
        self._pending = utf8_tail(self._pending, self.model.pieces[token]) or b""

    def close(self) -> None:
        self._free()  # once: later calls do nothing


class Trigger:
    """Where a lazy grammar starts: the text runs free until ``word`` is written, and the grammar
    applies from the next token on (llama.cpp: ``grammar_lazy`` and its trigger words, which
    ``common/chat.cpp`` sets for a tool call that the model may or may not make).

    llmkit's own: ``word`` must end where a token ends. A token that would write past it (``>{"``
    after ``<tool_call``) is refused, and the sampler picks among the others, so the grammar
    starts on a token boundary. llama.cpp instead replays the rest of such a token into the
    grammar, and the process aborts when that rest does not fit it.
    """

    def __init__(self, model: Model, word: str):
        self.model, self.word = model, word.encode()
        self.n_written = 0  # how much of ``word`` the text ends with (a proper prefix of it)
        self.fired = False

    def allowed(self) -> np.ndarray:
        """Per token: may it come next? (every token but those that would write past ``word``)"""
        return self.model.word_masks(self.word)[self.n_written]

    def allows(self, token: int) -> bool:
        return bool(self.allowed()[token])

    def accept(self, token: int) -> None:
        text = self.word[: self.n_written] + self.model.pieces[token]
        self.fired = text.endswith(self.word)
        self.n_written = next((n for n in range(min(len(text), len(self.word) - 1), 0, -1) if text.endswith(self.word[:n])), 0)


@dataclass(frozen=True)
class Grammar:
    """GBNF ``text`` parsed once for one model: each request's ``Sampler`` clones ``sampler``
    instead of parsing the text again. ``llmkit.grammar.compile`` makes them, after the
    checks that keep llama.cpp from hanging or crashing on it.

    ``sampler`` owns a llama.cpp handle: share a Grammar, never copy it (``dataclasses.asdict``
    would: code that lists ``SamplingParams`` reads its fields with ``vars`` instead)."""

    text: str
    sampler: GrammarSampler = field(repr=False)

    def close(self) -> None:
        """Free the parse (``Model.grammars`` does, when the model closes: the parse points into its vocabulary)."""
        self.sampler.close()

    @classmethod
    def parse(cls, text: str, model: Model) -> Grammar:
        """``text`` parsed for ``model``; ValueError with llama.cpp's reason if it refuses it."""
        with capture_errors() as errors:
            try:
                sampler = GrammarSampler(model, text)
            except ValueError:
                raise ValueError("; ".join(line.strip() for line in errors) or "llama.cpp gave no reason") from None
        model.utf8_continues(b"")  # the vocabulary's bytes, read here (~0.4 s once), not in the engine's step
        return cls(text, sampler)
