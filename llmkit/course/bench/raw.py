"""The engine limit: batched decode on ``llmkit.llama`` with no server, the same prompts and token counts as the servers get."""

from __future__ import annotations

import time

from llmkit import models
from llmkit.course.bench.config import RAW, Config
from llmkit.course.bench.prompts import TEXTS, chat_prompt
from llmkit.course.bench.scenarios import Row


class RawDecoder:
    """``raw(n)``: prefill n translation prompts, then decode max_tokens - 1 steps of n tokens.

    Same context shape as the slot server (``max(concurrency)`` sequences of
    ``ctx_per_slot`` tokens, one KV stream each), the same prompts and token counts,
    so its row reads like a server's: wall time from the start of the prefill to
    the last token, TTFT = the prefill of the n prompts (one batch), per-stream
    tok/s = the decode phase alone. That is the "engine limit" of the targets.
    ``texts`` (default: the bench's) are wrapped in the sequential server's prompt.
    """

    def __init__(self, cfg: Config, texts: list[str] = TEXTS):
        from llmkit.llama import Batch, Context, Model

        self.cfg, n_max = cfg, max(cfg.concurrency)
        self.model = Model(models.resolve_model(cfg.model))
        self.ctx = Context(self.model, n_ctx=n_max * cfg.ctx_per_slot, n_batch=2048, n_seq_max=n_max, n_threads=cfg.threads)
        chats = [[{"role": "user", "content": chat_prompt(texts[i % len(texts)])}] for i in range(n_max)]
        self.prompts = [self.model.tokenize_chat(chat) for chat in chats]
        self.batch = Batch(max(2048, sum(map(len, self.prompts))))

    def __call__(self, n: int) -> Row:
        from llmkit.sampling import Sampler, SamplingParams

        ctx, batch, steps = self.ctx, self.batch, self.cfg.max_tokens - 1  # the prefill gives the first token
        ctx.clear()
        samplers = [Sampler(self.model, SamplingParams(temperature=0, ignore_eos=True)) for _ in range(n)]
        try:
            tp = time.perf_counter()
            batch.clear()
            last = []
            for seq, prompt in enumerate(self.prompts[:n]):
                for pos, token in enumerate(prompt):
                    i = batch.add(token, pos, seq, logits=pos == len(prompt) - 1)
                last.append(i)
            ctx.decode(batch)
            prefill_ms = (time.perf_counter() - tp) * 1e3
            n_past = [len(p) for p in self.prompts[:n]]
            t0, decode_s = time.perf_counter(), 0.0
            for _ in range(steps):
                tokens = [s.sample(ctx, i) for s, i in zip(samplers, last, strict=True)]
                batch.clear()
                last = [batch.add(t, n_past[seq], seq, logits=True) for seq, t in enumerate(tokens)]
                n_past = [p + 1 for p in n_past]
                td = time.perf_counter()
                ctx.decode(batch)
                decode_s += time.perf_counter() - td
            step_s = time.perf_counter() - t0
        finally:
            for s in samplers:
                s.close()
        seconds = prefill_ms / 1e3 + step_s
        row = Row(
            RAW, n, n * (steps + 1), seconds, n * (steps + 1) / seconds, prefill_ms, prefill_ms, steps / step_s, busy_slots_per_decode=n
        )
        row.python_share = 1 - decode_s / step_s
        return row

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()
