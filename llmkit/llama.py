"""A thin typed layer over llama-cpp-python's low-level API.

Both servers stand on these objects, each owning one llama.cpp handle
and freeing it in ``close()``:

- ``Model``    a loaded GGUF: vocabulary, tokenizer, chat template   (llama_model)
- ``Context``  the KV cache and the compute graph, one sequence per slot (llama_context)
- ``Batch``    the tokens handed to one ``llama_decode`` call          (llama_batch)

The sampler chain that picks the next token is ``llmkit.sampling``'s; the grammar a
sampler masks the vocabulary with is ``llmkit.grammar``'s (``llmkit.grammar.sampler``).

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
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, TypeVar

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


# --- The grammars parsed for a model ------------------------------------------------------------------------------------


class Parsed(Protocol):
    """What ``Grammars`` keeps: a parse of ``text`` holding a llama.cpp handle into the model's vocabulary."""

    @property
    def text(self) -> str: ...

    def close(self) -> None: ...


P = TypeVar("P", bound=Parsed)


class Grammars:
    """The grammars parsed for one model (``llmkit.grammar.Grammar``, which ``llmkit.grammar.check`` keeps here), by their
    text, so a grammar sent again is parsed once (each request's sampler clones it). The oldest beyond ``limit`` are let go
    (a request still using one keeps it alive); all are freed when the model closes. Safe from several threads (the
    server compiles off its event loop)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._kept: OrderedDict[str, Parsed] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Parsed | None:
        with self._lock:
            if (grammar := self._kept.get(text)) is not None:
                self._kept.move_to_end(text)
            return grammar

    def keep(self, grammar: P) -> P:
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
                grammar.close()
            self._kept.clear()
