"""The embedding routes: mean-pooled, L2-normalised vectors from the loaded model.

    POST /v1/embeddings               OpenAI's shape (floats or base64)
    POST /embedding, /embeddings      the same vectors in llama-server's own shape

(~ llama-server's ``send_embedding`` in server-context.cpp, which pools in
llama.cpp and normalises with ``common_embd_normalize``.) The slot engine's
context computes logits, not embeddings, so this one has its own small
llama_context (``embeddings=True``, mean pooling), created on first use.
``embed`` blocks: call it from a worker thread; its lock lets one request
at a time use the context, never the event loop.
"""

from __future__ import annotations

import base64
import threading
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool

from llmkit.engine import ContextSizeError
from llmkit.llama import Batch, Context, Model
from llmkit.server.errors import off_loop
from llmkit.server.middleware import log_usage
from llmkit.server.protocol import ApiModel
from llmkit.server.state import State

router = APIRouter()

# inputs in one request, OpenAI's limit: each is a decode of its own under one lock, so more would hold the embedder
# (and a core) for minutes, with no way for the client to stop it
MAX_INPUTS = 2048
Inputs = str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(ApiModel):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class NativeEmbeddingRequest(EmbeddingRequest):
    """llama-server's own ``/embedding``: the text in ``input`` or ``content``."""

    input: Inputs | None = None  # type: ignore[assignment]  # or in content
    content: Inputs | None = None

    @model_validator(mode="after")
    def _input_or_content(self) -> NativeEmbeddingRequest:
        if self.input is None:
            if self.content is None:
                raise ValueError('"input" or "content" must be provided')
            self.input = self.content
        return self


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
            if self._ctx is None or self._batch is None:  # (both or neither)
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
            if self._ctx is not None and self._batch is not None:  # (both or neither)
                self._batch.close()
                self._ctx.close()
                self._ctx = self._batch = None


def embedder(request: Request) -> Embedder:
    """The app's embedder (``app.py`` makes it once the engine is ready): a route's dependency."""
    return request.app.state.embedder


EmbedderDep = Annotated[Embedder, Depends(embedder)]


async def embed(body: EmbeddingRequest, http_request: Request, embedder: Embedder) -> tuple[np.ndarray, int]:
    """The inputs' vectors, and how many tokens they were."""
    prompts = await off_loop(embedder.tokenize, body.texts)
    vectors = await run_in_threadpool(embedder.embed, prompts)
    n_tokens = sum(map(len, prompts))
    log_usage(http_request, n_tokens, 0, 0)
    return vectors, n_tokens


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http_request: Request, state: State, embedder: EmbedderDep) -> dict:
    vectors, n_tokens = await embed(body, http_request, embedder)
    return {
        "object": "list",
        "model": state.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }


@router.post("/embedding")
@router.post("/embeddings")
async def embeddings_native(body: NativeEmbeddingRequest, http_request: Request, embedder: EmbedderDep) -> list[dict]:
    """llama-server's own shape (handle_embeddings_impl, non-OAI): one vector per input, in a list of one."""
    vectors, _ = await embed(body, http_request, embedder)
    return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """An embedding as JSON numbers, or as base64 of little-endian float32 (OpenAI's two formats)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
