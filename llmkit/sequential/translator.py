"""The tutorial's translation engine: one model, one request at a time.

This is the course's "before" picture, on purpose:

- a lock lets one translation run at a time (everyone else waits);
- the KV cache is cleared before every request, so every prompt is
  evaluated from scratch (the log line shows prompt tokens and prompt time);
- no batching, no prefix reuse, no grammar.

It shares the model layer (``llmkit.llama``) and the detokenizer
(``llmkit.text``) with the slot engine, so the difference between the two
servers is the scheduling, not the plumbing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path

from llmkit.llama import Batch, Context, Model
from llmkit.sampling import Sampler, SamplingParams
from llmkit.text import Detokenizer
from llmkit.timings import Timings  # llama-server's timings; cache_n stays 0 here

log = logging.getLogger("llmkit.sequential")

PROMPT = "Translate the following text to {lang}. Output only the translation, nothing else.\n\n{text}"


class PromptTooLong(ValueError):
    pass


class Translator:
    """Loads a model once and translates with it, one request at a time."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 2048,
        temperature: float = 0.3,
        seed: int | None = None,
        max_tokens: int = -1,
        n_threads: int | None = None,
    ):
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.sampling = SamplingParams(temperature=temperature, seed=seed)
        self.max_tokens = max_tokens  # -1: until the end token or a full context
        self.lock = threading.Lock()  # one translation (or model swap) at a time
        self.last = Timings()
        self.model, self.ctx = self._open(model_path)

    def _open(self, path: str | Path) -> tuple[Model, Context]:
        model = Model(path)
        try:
            ctx = Context(model, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_threads=self.n_threads)
        except BaseException:
            model.close()
            raise
        return model, ctx

    @property
    def model_path(self) -> Path:
        return self.model.path

    def swap_model(self, path: str | Path) -> None:
        """Load another model; if that fails, the current one stays loaded."""
        model, ctx = self._open(path)  # outside the lock: translations go on meanwhile
        with self.lock:
            old = self.model, self.ctx
            self.model, self.ctx = model, ctx
        old[1].close()
        old[0].close()

    def prompt_tokens(self, text: str, target_lang: str) -> list[int]:
        messages = [{"role": "user", "content": PROMPT.format(lang=target_lang, text=text)}]
        return self.model.tokenize_chat(messages)

    def translate(self, text: str, target_lang: str = "ja") -> str:
        return "".join(self.stream(text, target_lang))

    def stream(self, text: str, target_lang: str = "ja") -> Generator[str, None, None]:
        """Yield the translation piece by piece; closing the iterator stops generation.

        The lock is held from the first ``next()`` until the generator ends
        or is closed, so a client that goes away must close it (the HTTP
        layer does, in a ``finally``).
        """
        with self.lock:
            yield from self._generate(self.prompt_tokens(text, target_lang))

    def _generate(self, prompt: list[int]) -> Iterator[str]:
        model, ctx = self.model, self.ctx
        if len(prompt) >= ctx.n_ctx:
            raise PromptTooLong(f"the prompt is {len(prompt)} tokens, the context holds {ctx.n_ctx}")
        t0 = time.perf_counter()
        ctx.clear()  # the baseline: forget everything, evaluate the whole prompt again
        batch = Batch(max(len(prompt), 1))
        sampler = Sampler(model, self.sampling)
        detok = Detokenizer(model.token_to_piece)
        n_past, n_out, t1 = 0, 0, t0
        try:
            for pos, token in enumerate(prompt):
                batch.add(token, pos, 0, logits=pos == len(prompt) - 1)
            ctx.decode(batch)
            n_past = len(prompt)
            t1 = time.perf_counter()
            while True:
                token = sampler.sample(ctx, batch.n_tokens - 1)
                if model.is_eog(token):
                    break
                n_out += 1
                piece = detok.push(token)
                if piece:
                    yield piece
                if n_out == self.max_tokens or n_past >= ctx.n_ctx:
                    break
                batch.clear()
                batch.add(token, n_past, 0, logits=True)
                ctx.decode(batch)
                n_past += 1
            tail = detok.flush()
            if tail:
                yield tail
        finally:
            sampler.close()
            batch.close()
            t2 = time.perf_counter()
            self.last = Timings(prompt_n=len(prompt), prompt_ms=(t1 - t0) * 1e3, predicted_n=n_out, predicted_ms=(t2 - t1) * 1e3)
            log.info(
                "prompt %d tokens in %.0f ms (cache cleared, 0 reused) | generated %d tokens in %.0f ms",
                len(prompt),
                (t1 - t0) * 1e3,
                n_out,
                (t2 - t1) * 1e3,
            )

    def close(self) -> None:
        with self.lock:
            self.ctx.close()
            self.model.close()
