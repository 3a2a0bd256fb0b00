"""``/v1/embeddings``: mean-pooled, L2-normalised vectors from the loaded model.

(~ llama-server's ``send_embedding`` in server-context.cpp, which pools in
llama.cpp and normalises with ``common_embd_normalize``.) The slot engine's
context computes logits, not embeddings, so this one has its own small
llama_context (``embeddings=True``, mean pooling), created on first use.
``embed`` blocks: call it from a worker thread; its lock lets one request
at a time use the context, never the event loop.
"""

from __future__ import annotations

import threading

import numpy as np

from llmkit.engine import ContextSizeError
from llmkit.llama import Batch, Context, Model

N_CTX = 512  # the longest input; also llama.cpp's n_ubatch here, which a pooled sequence must fit


class Embedder:
    def __init__(self, model: Model, *, n_ctx: int = N_CTX, n_threads: int | None = None):
        self.model = model
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._ctx: Context | None = None
        self._batch: Batch | None = None
        self._lock = threading.Lock()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Tokens of each input; raises ``ValueError`` / ``ContextSizeError`` for an empty or too long one."""
        prompts = [self.model.tokenize(text) for text in texts]
        for i, tokens in enumerate(prompts):
            if not tokens:
                raise ValueError(f"input {i} is empty")
            if len(tokens) > self.n_ctx:
                raise ContextSizeError(len(tokens), self.n_ctx)
        return prompts

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """One unit-length vector per tokenized input, shape (len(prompts), n_embd)."""
        with self._lock:
            if self._ctx is None:
                self._ctx = Context(self.model, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_threads=self.n_threads, embeddings=True)
                self._batch = Batch(self.n_ctx)
            vectors = np.empty((len(prompts), self.model.n_embd), dtype=np.float32)
            for i, tokens in enumerate(prompts):
                self._batch.clear()
                for pos, token in enumerate(tokens):
                    self._batch.add(token, pos, 0, logits=True)
                self._ctx.clear()  # each input on its own: no KV from the previous one
                self._ctx.decode(self._batch)
                vectors[i] = self._ctx.embedding(0)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._batch.close()
                self._ctx.close()
                self._ctx = self._batch = None
