"""A thin typed layer over llama-cpp-python's low-level API.

Both servers stand on these objects, each owning one llama.cpp handle
and freeing it in ``close()``:

- ``Model``    a loaded GGUF: vocabulary, tokenizer, chat template   (llama_model)
- ``Context``  the KV cache and the compute graph, one sequence per slot (llama_context)
- ``Batch``    the tokens handed to one ``llama_decode`` call          (llama_batch)
- ``Sampler``  a sampler chain that picks the next token               (llama_sampler)
- ``GrammarSampler`` a grammar over the vocabulary, the only token mask (llama_sampler_init_grammar);
  ``Grammar`` holds GBNF text and its checked parse, which each slot's ``Sampler`` clones;
  ``Trigger`` holds a lazy grammar back until its word is written

Nothing here knows about HTTP, slots or requests. The same calls appear in
llama-server's ``server-context.cpp`` (``llama_decode``, ``common_batch_add``,
``common_sampler_sample``, ``llama_memory_seq_rm``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as lc
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from llmkit.text import utf8_tail

log = logging.getLogger("llmkit.llama")

# --- llama.cpp's own log lines go to Python logging (quiet unless asked) -----

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}  # ggml_log_level


_captured = threading.local()  # capture_errors' list on this thread (llama.cpp logs on the thread that called it)


@lc.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", "replace").rstrip()
    if level == 4 and message and (lines := getattr(_captured, "lines", None)) is not None:
        lines.append(message)
    # level 5 continues the previous line (progress dots): not worth a log record
    if level in _LEVELS and message and log.isEnabledFor(_LEVELS[level]):
        log.log(_LEVELS[level], "%s", message)


@contextlib.contextmanager
def capture_errors() -> Iterator[list[str]]:
    """The error lines llama.cpp writes on this thread inside the block (why it refused a grammar, ...)."""
    lines: list[str] = []
    _captured.lines = lines
    try:
        yield lines
    finally:
        _captured.lines = None


@functools.cache  # once per process
def _init_backend() -> None:
    lc.llama_log_set(_forward_log, ctypes.c_void_p(0))
    lc.llama_backend_init()


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


# --- Model --------------------------------------------------------------------


class Model:
    """A GGUF model loaded into memory, with its tokenizer and chat template (``chat_template``: another
    one in its place, as llama-server's ``--chat-template-file``)."""

    def __init__(self, path: str | os.PathLike[str], *, chat_template: str | None = None):
        _init_backend()
        self.path = Path(path)
        params = lc.llama_model_default_params()
        # No "extra" weight layouts (AMX tiles, repacked blocks): some VMs advertise AMX
        # but fault on its first instruction, and the plain CPU kernels are as fast on
        # a model this small.
        params.use_extra_bufts = False
        handle = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not handle:
            raise RuntimeError(f"llama.cpp could not load the model: {self.path}")
        self.handle = handle
        self.vocab = lc.llama_model_get_vocab(handle)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(handle)
        self.n_embd = lc.llama_model_n_embd(handle)
        self.add_bos = lc.llama_vocab_get_add_bos(self.vocab)
        self.name = self.meta("general.name") or self.path.stem
        self.chat_template = chat_template if chat_template is not None else self.meta("tokenizer.chat_template") or ""
        self._formatter = self._chat_formatter()
        self._utf8_masks: dict[bytes, np.ndarray] = {}
        self._word_masks: dict[bytes, list[np.ndarray]] = {}  # Trigger's, per word
        self.grammars = Grammars()  # the grammars parsed for this model, by text (llmkit.grammar.compile fills it)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = lc.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.handle, buf, len(buf))
        return buf.value.decode()

    def n_params(self) -> int:
        return lc.llama_model_n_params(self.handle)

    # tokens <-> text

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token: possibly half of a UTF-8 character."""
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT or any other end token of this vocabulary."""
        return lc.llama_vocab_is_eog(self.vocab, token)

    @functools.cached_property
    def eog_tokens(self) -> list[int]:
        return [t for t in range(self.n_vocab) if self.is_eog(t)]

    @functools.cached_property
    def pieces(self) -> list[bytes]:
        """Every token's bytes, by token id (what ``detokenize`` joins)."""
        return [self.token_to_piece(t) for t in range(self.n_vocab)]

    def utf8_continues(self, pending: bytes) -> np.ndarray:
        """Per token: do its bytes, after ``pending`` (the start of a character), keep the text UTF-8?"""
        mask = self._utf8_masks.get(pending)
        if mask is None:
            mask = np.array([utf8_tail(pending, piece) is not None for piece in self.pieces])
            if len(self._utf8_masks) >= 256:  # one per unfinished character seen: bounded
                self._utf8_masks.clear()
            self._utf8_masks[pending] = mask
        return mask

    def word_masks(self, word: bytes) -> list[np.ndarray]:
        """Per number n of ``word``'s bytes already written, per token: would its bytes write the rest of
        ``word`` only at their very end, or not write ``word`` at all? (``Trigger`` asks it; ~0.4 s once
        per word, so a caller reads them off the engine's step first.)"""
        masks = self._word_masks.get(word)
        if masks is None:

            def ends(n: int) -> np.ndarray:
                texts = (word[:n] + piece for piece in self.pieces)
                return np.array([(at := t.find(word)) < 0 or at + len(word) == len(t) for t in texts])

            masks = self._word_masks[word] = [ends(n) for n in range(len(word))]
        return masks

    # chat

    def _chat_formatter(self) -> Jinja2ChatFormatter | None:
        template = self.chat_template
        if not template:
            return None

        def text(tok: int) -> str:
            return self.token_to_piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

        return Jinja2ChatFormatter(
            template=template,
            eos_token=text(lc.llama_vocab_eos(self.vocab)),
            bos_token=text(lc.llama_vocab_bos(self.vocab)),
        )

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render messages with the model's own template (GGUF ``tokenizer.chat_template``);
        ``tools``: the template's ``tools`` variable, for a template that describes them itself."""
        if self._formatter is None:
            raise ValueError(f"model {self.name!r} has no chat template")
        return self._formatter(messages=messages, tools=tools).prompt  # type: ignore[arg-type]  # OpenAI-shaped dicts, not its TypedDicts

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        prompt = self.apply_chat_template(messages, tools)
        bos = self._formatter.bos_token if self._formatter else ""
        # A template that writes BOS itself must not get a second one from the tokenizer.
        add_special = not (bos and prompt.startswith(bos))
        return self.tokenize(prompt, add_special=add_special)

    def close(self) -> None:
        if self.handle:
            self.grammars.clear()  # their samplers point into this model's vocabulary
            lc.llama_model_free(self.handle)
            self.handle = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- Context ------------------------------------------------------------------


class DecodeError(RuntimeError):
    pass


class KVCacheFullError(DecodeError):
    """``llama_decode`` returned 1: no room in the KV cache for this batch (nothing was decoded)."""


class Context:
    """A llama_context: the KV cache (one sequence per slot) and the compute graph.

    ``n_ctx`` is the total context; with ``kv_unified=False`` every one of the
    ``n_seq_max`` sequences gets its own KV stream of ``n_ctx // n_seq_max``
    cells, as llama-server gives each slot ``n_ctx / n_parallel``.
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 2048,
        n_batch: int = 2048,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        embeddings: bool = False,
        kv_unified: bool = False,
    ):
        # The fields that matter to decode speed are already llama-server's and llama-batched-bench's
        # (common_context_params_to_llama): flash_attn_type "auto" (on the CPU: enabled), n_ubatch 512.
        # Those that differ (no_perf, swa_full; a ggml threadpool; Model's use_extra_bufts) gained
        # nothing measurable here: scripts/decode_path.py.
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads or default_threads()
        params.kv_unified = kv_unified
        params.embeddings = embeddings
        if embeddings:
            params.pooling_type = lc.LLAMA_POOLING_TYPE_MEAN
        handle = lc.llama_init_from_model(model.handle, params)
        if not handle:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.handle = handle
        self.model = model
        self.n_ctx = lc.llama_n_ctx(handle)
        self.n_ctx_seq = lc.llama_n_ctx_seq(handle)
        self.n_batch = lc.llama_n_batch(handle)
        self.memory = lc.llama_get_memory(handle)

    def decode(self, batch: Batch) -> None:
        rc = lc.llama_decode(self.handle, batch.handle)
        if rc == 1:
            raise KVCacheFullError(f"no room in the KV cache for {batch.n_tokens} tokens")
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} ({batch.n_tokens} tokens)")

    # KV cache, per sequence (llama_memory_*)

    def clear(self) -> None:
        lc.llama_memory_clear(self.memory, True)

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop sequence ``seq_id``'s cells at positions [p0, p1) (p1 < 0: to the end)."""
        return lc.llama_memory_seq_rm(self.memory, seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Sequence ``dst`` holds ``src``'s cells at positions [p0, p1) too. On a unified KV cache the cells only gain
        ``dst``'s id (llama_kv_cache::seq_cp: "no data copy is necessary"): one set of cells, two sequences."""
        lc.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        """The last position sequence ``seq_id`` holds in the KV cache (-1: none): how a test sees what is there."""
        return lc.llama_memory_seq_pos_max(self.memory, seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move sequence ``seq_id``'s cells at positions [p0, p1) by ``delta`` (their keys are re-rotated)."""
        lc.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """Whether cells can move to other positions (``seq_add``): context shift and cache reuse need it."""
        return bool(lc.llama_memory_can_shift(self.memory))

    def seq_state(self, seq_id: int) -> mmap.mmap:
        """A copy of sequence ``seq_id``'s KV cells (llama_state_seq_get_data): what the prompt cache keeps.

        The copy (MiBs: 23 KB a token for SmolLM2-135M) lives in a memory mapping of its own, whose pages go back
        to the OS as soon as it is dropped. In a bytearray it would come from malloc's heap, which keeps freed
        blocks of that size for reuse: with copies of many sizes saved and evicted, the server's resident memory
        grew past the cache's own bytes (--cache-ram 64: 75 MiB over 400 requests, 66 MiB with mappings)."""
        size = lc.llama_state_seq_get_size(self.handle, seq_id)
        data = mmap.mmap(-1, max(size, 1))  # (an empty mapping is not allowed)
        lc.llama_state_seq_get_data(self.handle, (ctypes.c_uint8 * size).from_buffer(data), size, seq_id)
        return data

    def set_seq_state(self, seq_id: int, data: mmap.mmap | bytearray) -> bool:
        """Replace sequence ``seq_id``'s cells with a copy made by ``seq_state`` (of any sequence, of any context of the model)."""
        buffer = (ctypes.c_uint8 * len(data)).from_buffer(data)
        return lc.llama_state_seq_set_data(self.handle, buffer, len(data), seq_id) == len(data)

    def logits(self, i: int) -> ctypes.Array:
        """Logits of the i-th output of the last decode, as a ctypes float array."""
        ptr = lc.llama_get_logits_ith(self.handle, i)
        return (ctypes.c_float * self.model.n_vocab).from_address(ctypes.addressof(ptr.contents))

    def logprobs(self, i: int, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
        """The log-probability of ``token`` at the i-th output of the last decode, and the ``n`` likeliest tokens
        with theirs, best first (a log-softmax of the raw logits, as llama-server's n_probs)."""
        logits = np.ctypeslib.as_array(self.logits(i))
        shifted = logits - logits.max()
        logp = shifted - np.log(np.exp(shifted).sum())
        top = np.argpartition(-logp, n)[:n]
        top = top[np.argsort(-logp[top])]
        return float(logp[token]), [(int(t), float(logp[t])) for t in top]

    def embedding(self, seq_id: int) -> list[float]:
        ptr = lc.llama_get_embeddings_seq(self.handle, seq_id)
        return ptr[: self.model.n_embd]

    def close(self) -> None:
        if self.handle:
            lc.llama_free(self.handle)
            self.handle = None


# --- Batch --------------------------------------------------------------------


class Batch:
    """A reusable llama_batch of at most ``capacity`` tokens (common_batch_add / _clear)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.handle = lc.llama_batch_init(capacity, 0, 1)

    @property
    def n_tokens(self) -> int:
        return self.handle.n_tokens

    def clear(self) -> None:
        self.handle.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        """Append one token; returns its index, which ``Sampler.sample`` needs when logits is set."""
        b, i = self.handle, self.handle.n_tokens
        if i >= self.capacity:
            raise OverflowError("batch is full")
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    def close(self) -> None:
        if self.handle is not None:
            lc.llama_batch_free(self.handle)
            self.handle = None


# --- Sampler --------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with llama-server's defaults (~ ``common_params_sampling``: ``ignore_eos`` is
    one of them there too, a -inf bias on the end tokens; how long to go and where to stop are the request's,
    ``llmkit.engine.RequestParams``)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # (token or text, bias): added to the logits (a text: its tokens)
    grammar: str | Grammar | None = None  # GBNF text (root rule "root"), or a Grammar: parsed and checked once (grammar.compile)
    grammar_trigger: str | None = None  # lazy grammar: free text until this word is written, then the grammar


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp: pick a random seed


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


class Grammars:
    """The grammars parsed for one model, by their text, so a grammar sent again is parsed once (each request's
    ``Sampler`` clones it). The oldest beyond ``limit`` are let go (a request still using one keeps it alive);
    all are freed when the model closes. Safe from several threads (the server compiles off its event loop)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._kept: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Grammar | None:
        with self._lock:
            if (grammar := self._kept.get(text)) is not None:
                self._kept.move_to_end(text)
            return grammar

    def keep(self, grammar: Grammar) -> Grammar:
        with self._lock:
            self._kept[grammar.text] = grammar
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        with self._lock:
            for grammar in self._kept.values():
                grammar.sampler.close()
            self._kept.clear()


class Sampler:
    """A llama.cpp sampler chain built from ``SamplingParams``.

    Order as llama-server's common_sampler: [grammar] -> penalties -> top_k ->
    top_p -> min_p -> temperature -> dist, or greedy when temperature <= 0.
    The chain owns its samplers: freeing the chain frees them all.

    The grammar sampler stays out of the chain, as in common_sampler: llama.cpp
    aborts the process when a grammar accepts a token it does not allow (which
    ``llama_sampler_sample`` does when the grammar leaves no token at all), so
    ``sample`` checks the token before the grammar accepts it. A ``Grammar`` is
    cloned (parsed and checked before the request was queued); GBNF text, or a Grammar
    parsed for another model, is parsed here.
    """

    live = 0  # chains not yet freed, across the process (tests count them to catch leaks)

    def __init__(self, model: Model, params: SamplingParams):
        self.handle = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        Sampler.live += 1
        self.grammar: GrammarSampler | None = None
        self.trigger: Trigger | None = None  # a lazy grammar's, until it fires
        try:
            grammar = params.grammar
            if isinstance(grammar, Grammar) and grammar.sampler.model is model:
                self.grammar = grammar.sampler.clone()
            elif grammar is not None:
                self.grammar = GrammarSampler(model, grammar.text if isinstance(grammar, Grammar) else grammar)
            if self.grammar is not None and params.grammar_trigger:
                self.trigger = Trigger(model, params.grammar_trigger)
            for sampler in self._stages(model, params):
                if not sampler:
                    raise ValueError("llama.cpp could not build a sampler stage")
                lc.llama_sampler_chain_add(self.handle, sampler)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _stages(model: Model, p: SamplingParams):
        # llama-server: the request's logit_bias, and with ignore_eos a -inf bias on every end-of-generation token
        def tokens(key: int | str) -> list[int]:
            return [key] if isinstance(key, int) else model.tokenize(key, add_special=False, parse_special=False)

        given = [(t, b) for key, b in p.logit_bias for t in tokens(key)]
        banned = [(t, float("-inf")) for t in (model.eog_tokens if p.ignore_eos else ())]
        bias = [lc.llama_logit_bias(t, b) for t, b in [*given, *banned] if 0 <= t < model.n_vocab]
        if bias:
            yield lc.llama_sampler_init_logit_bias(model.n_vocab, len(bias), (lc.llama_logit_bias * len(bias))(*bias))
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            yield lc.llama_sampler_init_penalties(  # this llama.h still takes n_vocab first
                model.n_vocab, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        if p.temperature <= 0:
            yield lc.llama_sampler_init_greedy()
            return
        if p.top_k > 0:
            yield lc.llama_sampler_init_top_k(p.top_k)
        yield lc.llama_sampler_init_top_p(p.top_p, 1)
        yield lc.llama_sampler_init_min_p(p.min_p, 1)
        yield lc.llama_sampler_init_temp(p.temperature)
        yield lc.llama_sampler_init_dist(LLAMA_DEFAULT_SEED if p.seed is None else p.seed & 0xFFFFFFFF)

    def sample(self, ctx: Context, i: int) -> int:
        """Pick a token from the logits of batch output ``i`` and accept it into the chain."""
        grammar = self.grammar
        if grammar is None:
            return lc.llama_sampler_sample(self.handle, ctx.handle, i)
        # common_sampler_sample: sample as if unconstrained and keep the token if the grammar
        # allows it (one token to check, not the whole vocabulary); else mask, sample again.
        logits = np.ctypeslib.as_array(ctx.logits(i))
        token = self._pick(grammar.candidates(logits))
        if (trigger := self.trigger) is not None:  # a lazy grammar: only the trigger word's end is checked
            if not trigger.allows(token):
                token = self._pick(grammar.candidates(logits, trigger.allowed()))
            trigger.accept(token)
            if trigger.fired:
                self.trigger = None  # the grammar applies from the next token
        else:
            if not grammar.allows(token):
                token = self._pick(grammar.masked(logits))
            grammar.accept(token)
        lc.llama_sampler_accept(self.handle, token)
        return token

    def _pick(self, cur: lc.llama_token_data_array) -> int:
        lc.llama_sampler_apply(self.handle, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size or cur.data[cur.selected].logit == float("-inf"):
            raise ValueError("no token is left to sample: the grammar and the sampling settings exclude them all")
        return int(cur.data[cur.selected].id)

    def close(self) -> None:
        if self.grammar:
            self.grammar.close()
            self.grammar = None
        if self.handle:
            lc.llama_sampler_free(self.handle)
            self.handle = None
            Sampler.live -= 1
