"""One slot: a KV-cache sequence and the request using it (~ llama-server's ``server_slot``).

A slot's sequence id is its index. ``cache_tokens`` are exactly the tokens
whose keys and values sit in that sequence of the KV cache, position by
position; they outlive the request, which is what prefix reuse reads.
"""

from __future__ import annotations

import time

from llmkit.engine.request import Request, Status
from llmkit.llama import Context, Model, Sampler
from llmkit.text import Detokenizer, StopMatcher


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (llama-server: server_tokens::get_common_prefix)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Slot:
    def __init__(self, slot_id: int, n_ctx: int):
        self.id = slot_id
        self.n_ctx = n_ctx  # this slot's share of the context
        self.cache_tokens: list[int] = []
        self.request: Request | None = None
        self.sampler: Sampler | None = None
        self.detok: Detokenizer | None = None
        self.stops: StopMatcher | None = None
        self.n_prompt_done = 0  # prompt tokens already in the KV cache or in this step's batch
        self.last_token = -1  # sampled, not yet decoded
        self.i_batch = -1  # where this slot's logits are in the current batch (-1: none)
        self.pending_tokens: list[int] = []  # sampled, text still held back (half a character, maybe a stop string)
        self.pending_logprobs: list = []
        self.t_last_used = 0.0

    @property
    def is_idle(self) -> bool:
        return self.request is None

    @property
    def is_generating(self) -> bool:
        return self.request is not None and self.request.status is Status.GENERATING

    @property
    def prompt_left(self) -> list[int]:
        return self.request.prompt[self.n_prompt_done :] if self.request else []

    @property
    def n_past(self) -> int:
        """Tokens in this slot's KV cache: the next token goes at this position."""
        return len(self.cache_tokens)

    def similarity(self, prompt: list[int]) -> float:
        """How much of ``prompt`` this slot already holds, 0..1 (lcp / len(prompt))."""
        return common_prefix(self.cache_tokens, prompt) / len(prompt) if prompt else 0.0

    def start(self, request: Request, ctx: Context, model: Model) -> None:
        """Take ``request``: keep the cached common prefix, drop the rest of the KV, build the sampler.

        (llama-server: launch_slot_with_task + the n_past logic of pre_decode)
        """
        prompt = request.prompt
        n_keep = common_prefix(self.cache_tokens, prompt) if request.cache_prompt else 0
        n_keep = min(n_keep, len(prompt) - 1)  # evaluate at least one token: we need its logits
        if not ctx.seq_rm(self.id, n_keep, -1):
            n_keep = 0  # this memory cannot cut a sequence in the middle: drop it all
            ctx.seq_rm(self.id, 0, -1)
        del self.cache_tokens[n_keep:]

        self.sampler = Sampler(model, request.params)  # may raise: the caller fails the request alone
        self.detok = Detokenizer(model.token_to_piece)
        self.stops = StopMatcher(request.params.stop)
        self.request = request
        self.n_prompt_done = n_keep
        self.i_batch = -1
        self.pending_tokens, self.pending_logprobs = [], []
        request.slot_id = self.id
        request.status = Status.PROMPT
        request.timings.cache_n = n_keep
        request.timings.prompt_n = len(prompt) - n_keep
        request.t_start = time.perf_counter()

    def release(self, ctx: Context, *, keep_cache: bool = True) -> None:
        """Free the slot. The KV cache stays for the next request unless ``keep_cache`` is False."""
        if self.sampler is not None:
            self.sampler.close()
        self.sampler = self.detok = self.stops = None
        self.request = None
        self.i_batch = -1
        self.t_last_used = time.perf_counter()
        if not keep_cache:
            ctx.seq_rm(self.id, 0, -1)
            self.cache_tokens.clear()

    def to_dict(self) -> dict:
        """State for ``GET /slots``."""
        r = self.request  # read once: the engine thread may free the slot while an HTTP thread reads it
        state = {"id": self.id, "n_ctx": self.n_ctx, "is_processing": r is not None, "n_cached": self.n_past}
        if r is not None:
            state.update(
                id_task=r.id,
                status=r.status.value,
                n_prompt_tokens=len(r.prompt),
                n_prompt_tokens_cache=r.timings.cache_n,
                n_prompt_tokens_processed=self.n_prompt_done - r.timings.cache_n,
                n_decoded=len(r.output),
                params={k: v for k, v in vars(r.params).items() if k != "grammar"} | {"has_grammar": r.params.grammar is not None},
            )
        return state
