"""One slot: a KV-cache sequence and the request using it (~ llama-server's ``server_slot``).

A slot's sequence id is its index. ``cache_tokens`` are exactly the tokens
whose keys and values sit in that sequence of the KV cache, position by
position; they outlive the request, which is what prefix reuse reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmkit.engine.request import Piece, Request, Status, TokenLogprob
from llmkit.llama import Context, Model, Sampler
from llmkit.text import Detokenizer, StopMatcher

if TYPE_CHECKING:
    from llmkit.engine.prompt_cache import PromptCache


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (llama-server: server_tokens::get_common_prefix)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Tools:
    """What a slot needs while a request runs: built by ``Slot.start``, dropped by ``Slot.release``."""

    sampler: Sampler
    detok: Detokenizer
    stops: StopMatcher
    pending_tokens: list[int] = field(default_factory=list)  # sampled, text still held back (half a character, maybe a stop string)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    def push(self, token: int, logprobs: TokenLogprob | None) -> str:
        """Take a sampled token; return the text now ready (whole characters, no part of a stop string)."""
        self.pending_tokens.append(token)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
        return self.stops.push(self.detok.push(token))

    def flush(self) -> str:
        """The text still held back, at the end of the request."""
        return self.stops.push(self.detok.flush()) + self.stops.flush()

    def take(self, text: str) -> Piece:
        """``text`` with the tokens (and logprobs) it came from; they are no longer pending."""
        piece = Piece(text, self.pending_tokens, self.pending_logprobs)
        self.pending_tokens, self.pending_logprobs = [], []
        return piece


class Slot:
    def __init__(self, slot_id: int, n_ctx: int):
        self.id = slot_id
        self.n_ctx = n_ctx  # this slot's share of the context
        self.cache_tokens: list[int] = []
        self.request: Request | None = None
        self.tools: Tools | None = None  # while a request runs
        self.n_prompt_done = 0  # prompt tokens already in the KV cache or in this step's batch
        self.last_token = -1  # sampled, not yet decoded
        self.i_batch = -1  # where this slot's logits are in the current batch (-1: none)
        self.t_last_used = 0.0
        self.n_restored = 0  # prompts brought back into this slot from the prompt cache

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
        n_past = common_prefix(self.cache_tokens, prompt) if request.cache_prompt else 0
        n_moved = self.reuse_chunks(ctx, prompt, n_past, request.n_cache_reuse) if request.cache_prompt and request.n_cache_reuse > 0 else 0
        n_keep = min(n_past + n_moved, len(prompt) - 1)  # evaluate at least one token: we need its logits
        if not ctx.seq_rm(self.id, n_keep, -1):
            n_keep = n_moved = 0  # this memory cannot cut a sequence in the middle: drop it all
            ctx.seq_rm(self.id, 0, -1)
        del self.cache_tokens[n_keep:]

        sampler = Sampler(model, request.params)  # may raise: the caller fails the request alone
        self.tools = Tools(sampler, Detokenizer(model.token_to_piece), StopMatcher(request.params.stop))
        self.request, self.n_prompt_done, self.i_batch = request, n_keep, -1
        request.start(self.id, n_cached=n_keep, n_moved=min(n_moved, n_keep))

    def reuse_chunks(self, ctx: Context, prompt: list[int], n_past: int, min_chunk: int) -> int:
        """After the common prefix, move cached chunks that the prompt repeats into their new places.

        (llama-server: the n_cache_reuse loop of update_slots, --cache-reuse.) An edited
        early message changes the prefix; the messages after it are still in the cache,
        only at other positions: a run of at least ``min_chunk`` matching tokens is
        moved (``seq_rm`` the gap, ``seq_add`` to shift its positions) instead of read
        again. Returns how many tokens were moved; ``cache_tokens`` follows the cells.
        """
        cache, n_moved = self.cache_tokens, 0
        head_c = head_p = n_past  # where we are in the cache, and in the prompt
        while head_c < len(cache) and head_p < len(prompt):
            n = 0
            while head_c + n < len(cache) and head_p + n < len(prompt) and cache[head_c + n] == prompt[head_p + n]:
                n += 1
            if n >= min_chunk:
                ctx.seq_rm(self.id, head_p, head_c)
                ctx.seq_add(self.id, head_c, head_c + n, head_p - head_c)
                cache[head_p : head_p + n] = cache[head_c : head_c + n]
                head_c, head_p, n_moved = head_c + n, head_p + n, n_moved + n
            else:
                head_c += 1
        return n_moved

    def shift_context(self, ctx: Context, add_bos: bool) -> None:
        """Make room in a full slot: drop half the tokens after the request's first ``n_keep``, move the rest back.

        (llama-server: the context shift at the top of pre_decode, --context-shift.)
        The generation goes on, having forgotten the middle of what it read.
        """
        request = self.request
        n_keep = len(request.prompt) if request.n_keep < 0 else request.n_keep
        n_keep = min(self.n_ctx - 4, n_keep + add_bos)
        n_left = self.n_past - n_keep
        n_discard = max(0, min(n_left // 2, n_left - 1))
        ctx.seq_rm(self.id, n_keep, n_keep + n_discard)
        ctx.seq_add(self.id, n_keep + n_discard, self.n_past, -n_discard)
        del self.cache_tokens[n_keep : n_keep + n_discard]
        request.truncated = True

    # --- the prompt cache (server_slot::prompt_save / prompt_load / prompt_clear) ----------

    def save_prompt(self, cache: PromptCache, ctx: Context) -> bool:
        return cache.save(ctx, self.id, self.cache_tokens)

    def load_prompt(self, cache: PromptCache, ctx: Context, prompt: list[int]) -> None:
        tokens = cache.load(ctx, self.id, self.cache_tokens, prompt)
        if tokens is not None:
            self.cache_tokens = tokens
            self.n_restored += 1

    def clear_prompt(self, ctx: Context) -> None:
        ctx.seq_rm(self.id, 0, -1)
        self.cache_tokens = []

    def release(self, ctx: Context, *, keep_cache: bool = True) -> None:
        """Free the slot. The KV cache stays for the next request unless ``keep_cache`` is False."""
        if self.tools is not None:
            self.tools.sampler.close()
        self.tools = self.request = None
        self.i_batch = -1
        self.t_last_used = time.perf_counter()
        if not keep_cache:
            self.clear_prompt(ctx)

    def to_dict(self) -> dict:
        """State for ``GET /slots``."""
        r = self.request  # read once: the engine thread may free the slot while an HTTP thread reads it
        state: dict[str, Any] = {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "is_processing": r is not None,
            "n_cached": self.n_past,
            "n_restored_from_cache": self.n_restored,
        }
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
