"""Speculative decoding without a draft model: guess a slot's next tokens from n-grams of its own text.

(llama-server: ``--spec-type ngram-simple`` and ``ngram-mod``; ``common/speculative.cpp``,
``common/ngram-map.cpp``'s ``common_ngram_simple_draft``, ``common/ngram-mod.cpp``.)

When an answer repeats text the slot has seen (code being edited, a document being quoted, JSON being
rewritten), the tokens after the last few are easy to guess: find where those last tokens occurred
before and propose what followed them. The engine puts the guess (the *draft*) in the step's batch
behind the token the slot sampled last, asking for logits at every position; after the decode, the job
samples position by position and keeps each draft token that equals what it sampled
(``Engine.sample``). The first token that differs is the step's own new token, and the draft after it
leaves the KV cache. One decode then yields ``1 + n_accepted`` tokens. A decode of a few dozen tokens
costs less per token than a decode of one, but on a CPU not much less: a long draft pays only if much of it
is kept (``SpecParams.next_window``).

The tokens are those the model would sample one step at a time: the same sampler sees the same
logits, in order. Only the numerics move: a batch of 40 tokens is not computed exactly like 40 batches
of one, so where two tokens are nearly tied, a greedy answer can change (chapter 9 shows where).

``Drafter`` is the interface; ``NgramSimple`` and ``NgramMod`` are llama-server's two draft-free modes.
"""

from __future__ import annotations

import enum
import logging
from array import array
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class SpecType(enum.Enum):
    """A speculation mode, by its ``--spec-type`` name (llama-server: ``common_speculative_type``, the draft-free ones)."""

    NONE = "none"
    NGRAM_SIMPLE = "ngram-simple"
    NGRAM_MOD = "ngram-mod"


@dataclass(frozen=True)
class SpecParams:
    """The server's speculation settings (~ llama-server's ``common_params_speculative``, the draft-free part),
    each named after its flag, with its default."""

    type: SpecType = SpecType.NONE  # --spec-type
    ngram_simple_size_n: int = 12  # --spec-ngram-simple-size-n: tokens that must match
    ngram_simple_size_m: int = 48  # --spec-ngram-simple-size-m: tokens drafted at most
    ngram_mod_n_match: int = 24  # --spec-ngram-mod-n-match: tokens hashed to find the next one
    ngram_mod_n_min: int = 48  # --spec-ngram-mod-n-min: a shorter chain is no draft
    ngram_mod_n_max: int = 64  # --spec-ngram-mod-n-max: tokens drafted at most
    slow_start: int = 0  # --spec-slow-start (llmkit's own): see next_window; 0: every draft as long as the mode drafts

    def checked(self) -> SpecParams:
        if not isinstance(self.type, SpecType):
            raise ValueError(f"spec_type must be a SpecType ({', '.join(t.value for t in SpecType)}), not {self.type!r}")
        if min(self.ngram_simple_size_n, self.ngram_simple_size_m, self.ngram_mod_n_match, self.ngram_mod_n_max) < 1:
            raise ValueError("the n-gram sizes and draft lengths must be at least 1")
        if self.slow_start < 0:
            raise ValueError(f"slow_start must be 0 (off) or a number of tokens, not {self.slow_start}")
        return self

    @property
    def n_max(self) -> int:
        """The longest draft this mode proposes (0: no speculation)."""
        return {SpecType.NONE: 0, SpecType.NGRAM_SIMPLE: self.ngram_simple_size_m, SpecType.NGRAM_MOD: self.ngram_mod_n_max}[self.type]

    @property
    def first_window(self) -> int:
        """The longest first draft of a request: as after a draft that kept nothing."""
        return self.next_window(0)

    def next_window(self, n_accepted: int, n_max: int | None = None) -> int:
        """The longest next draft of a request whose last draft kept ``n_accepted`` tokens (``n_max``: the drafter's
        longest, when it is your own; else the mode's).

        llama-server drafts as long as the mode finds tokens, every time. On a CPU, verifying a draft of 48
        tokens costs about as much as 20 one-token steps, so a long draft that is rejected early loses time
        that short ones would not. With ``slow_start`` (as TCP's): a request's first draft is at most
        ``slow_start`` tokens, and each next one at most twice the run the last one kept (at least
        ``slow_start``): a draft accepted whole doubles the window, one cut early shrinks it to what
        the text has been repeating.
        """
        n_max = self.n_max if n_max is None else n_max
        return min(max(2 * n_accepted, self.slow_start), n_max) if self.slow_start else n_max


class Drafter(Protocol):
    """What the engine asks of a speculation mode (~ ``common_speculative_impl``); your own goes in
    ``EngineConfig(drafter=...)`` (or ``--drafter package.module:Class``). An ``n_max`` attribute, if it has one, is the
    longest draft it proposes (``longest_draft``); without, the ``--spec-type`` mode's."""

    def begin(self, seq: int, prompt: list[int]) -> None:
        """A slot has read its prompt (``begin``)."""

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        """Up to ``n_max`` tokens to follow ``tokens`` (the slot's KV cache) and ``last`` (sampled, not yet decoded)."""
        ...

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        """How the last draft fared (``accept``)."""


class Checked:
    """A drafter of your own (``EngineConfig.drafter``), checked: a method that raises, or a draft the model cannot
    decode (more than asked for, or not token ids of its vocabulary), costs that draft alone, said once per kind in the
    log, never a request or the step of the others."""

    def __init__(self, inner: Drafter, n_vocab: int):
        self.inner, self.n_vocab, self.faults = inner, n_vocab, set[str]()
        if hasattr(inner, "n_max"):
            self.n_max = inner.n_max

    def fault(self, kind: str, detail: str) -> None:
        if kind not in self.faults:
            self.faults.add(kind)
            logging.getLogger("llmkit.engine").warning("drafter %s %s (%s); no draft instead", type(self.inner).__name__, kind, detail)

    def begin(self, seq: int, prompt: list[int]) -> None:
        try:
            self.inner.begin(seq, prompt)
        except Exception as exc:  # noqa: BLE001 -- a plug-in's bug costs its own drafts
            self.fault("raised in begin", repr(exc))

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        try:
            drafted = list(self.inner.draft(seq, tokens, last, n_max))
        except Exception as exc:  # noqa: BLE001 -- as in begin
            self.fault("raised in draft", repr(exc))
            return []
        if len(drafted) > n_max or not all(type(t) is int and 0 <= t < self.n_vocab for t in drafted):
            self.fault("drafted what cannot be decoded", repr(drafted[:8]))
            return []
        return drafted

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        try:
            self.inner.accept(seq, n_drafted, n_accepted)
        except Exception as exc:  # noqa: BLE001 -- as in begin
            self.fault("raised in accept", repr(exc))


def longest_draft(drafter: Drafter | None, params: SpecParams) -> int:
    """The longest draft the engine asks ``drafter`` for: its own ``n_max`` if it says one, else the mode's."""
    return int(getattr(drafter, "n_max", params.n_max))


def make_drafter(params: SpecParams) -> Drafter | None:
    """The drafter of ``--spec-type`` (None: no speculation)."""
    if params.type is SpecType.NGRAM_SIMPLE:
        return NgramSimple(params.ngram_simple_size_n, params.ngram_simple_size_m)
    if params.type is SpecType.NGRAM_MOD:
        return NgramMod(params.ngram_mod_n_match, params.ngram_mod_n_min, params.ngram_mod_n_max)
    return None


class NgramSimple:
    """The last ``size_n`` tokens (``last`` included) looked up in the slot's own tokens, newest match
    first; the tokens that followed it, up to ``size_m``, are the draft (``common_ngram_simple_draft``).
    Nothing is kept between steps."""

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.size_n, self.size_m = size_n, size_m
        self.n_max = size_m

    def begin(self, seq: int, prompt: list[int]) -> None:
        pass

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        n, m = self.size_n, self.size_m
        if len(tokens) <= n + m + 1:
            return []
        pattern = [*tokens[len(tokens) - n + 1 :], last]
        j = rfind(tokens, pattern, end=len(tokens) - 1)  # an earlier occurrence, not the one ending with ``last``
        if j <= 0:  # llama-server's "position 0 == no match"
            return []
        n_copy = min(m, len(tokens) - (j + n))
        return tokens[j + n : j + n + n_copy][:n_max] if n_copy >= n else []

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        pass


def rfind(tokens: list[int], pattern: list[int], end: int) -> int:
    """Where the last occurrence of ``pattern`` inside ``tokens[:end]`` starts (-1: none). A byte search over
    the int32 tokens (C speed: a slot's tokens are searched every step), keeping only token-aligned hits."""
    hay, needle = array("i", tokens).tobytes(), array("i", pattern).tobytes()
    stop = 4 * end
    while (i := hay.rfind(needle, 0, stop)) >= 0:
        if i % 4 == 0:
            return i // 4
        stop = i + len(needle) - 1
    return -1


class NgramMod:
    """One table for every slot: the hash of ``n_match`` tokens -> the token that followed them, in a fixed
    array of 4 Mi entries where a collision overwrites (``common_ngram_mod``). A draft is the chain of
    lookups from the slot's last tokens, kept only if at least ``n_min`` long.

    The table learns every prompt (``begin``) and each slot's new tokens, 32 at a time. It is emptied
    when a quarter of it is used, and after 5 drafts in a row with under a quarter accepted.
    """

    SIZE = 4 * 1024 * 1024
    EMPTY = -1

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64):
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.entries = np.full(self.SIZE, self.EMPTY, dtype=np.int32)
        self.used = 0
        self.i_last: dict[int, int] = {}  # per slot: where its tokens are learned up to
        self.n_low: dict[int, int] = {}  # per slot: drafts in a row mostly rejected

    def index(self, window: list[int]) -> int:
        h = 0
        for token in window:  # common_ngram_mod::idx: res = res * 6364136223846793005 + token, in 64 bits
            h = (h * 6364136223846793005 + token) & 0xFFFF_FFFF_FFFF_FFFF
        return h % self.SIZE

    def learn(self, tokens: list[int], start: int) -> None:
        """Each n-gram of ``tokens`` from ``start`` -> the token after it."""
        for i in range(start, len(tokens) - self.n):
            k = self.index(tokens[i : i + self.n])
            self.used += int(self.entries[k] == self.EMPTY)
            self.entries[k] = tokens[i + self.n]

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0
        self.i_last.clear()

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.n_low[seq] = 0
        if len(prompt) < self.n:
            self.i_last[seq] = 0
            return
        self.learn(prompt, 0)
        self.i_last[seq] = len(prompt) - self.n
        if self.used > self.SIZE // 4:
            self.reset()

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        n = self.n
        if len(tokens) < n:
            return []
        if self.i_last.get(seq, 0) + 32 < len(tokens):  # learn the slot's new tokens, in chunks
            self.learn(tokens, self.i_last.get(seq, 0))
            self.i_last[seq] = len(tokens) - n
        chain = [*tokens[len(tokens) - n + 1 :], last]
        for _ in range(self.n_max):
            token = int(self.entries[self.index(chain[-n:])])
            if token == self.EMPTY:
                break
            chain.append(token)
        drafted = chain[n:]
        return drafted[:n_max] if len(drafted) >= self.n_min else []

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        if n_accepted / n_drafted >= 0.25:
            self.n_low[seq] = 0
            return
        self.n_low[seq] = self.n_low.get(seq, 0) + 1
        if self.n_low[seq] >= 5:  # the table predicts this text badly: start over
            self.reset()
            self.n_low[seq] = 0
