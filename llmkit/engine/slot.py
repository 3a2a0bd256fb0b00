"""One slot: a sequence of the KV cache (~ llama-server's ``server_slot``, its KV half).

A slot's sequence id is its index. ``cache_tokens`` are exactly the tokens
whose keys and values sit in that sequence of the KV cache, position by
position, at every moment outside a step (a step appends to them only after
its decode has succeeded: ``Scheduler.commit``); they outlive the job, which is
what prefix reuse reads. Only the slot's own methods change them, and each marks the first position it
changed (``changed_from``): the KV events (``llmkit.engine.kv_events``) read only what changed since they last looked.

``job`` is the run of the request on it (``llmkit.engine.job``), None when idle;
the job does not point back.
"""

from __future__ import annotations

import itertools
import mmap
import time
from typing import TYPE_CHECKING

from llmkit.engine.memory import KVMemory
from llmkit.engine.tokens import common_prefix

if TYPE_CHECKING:
    from llmkit.engine.job import Job
    from llmkit.engine.prompt_cache import PromptCache


_CELL_IDS = itertools.count()  # one id per KV cell ever written: slots that hold the same ids share those cells


def new_cells(n: int) -> list[int]:
    return list(itertools.islice(_CELL_IDS, n))


class Slot:
    def __init__(self, slot_id: int, n_ctx: int):
        self.id = slot_id
        self.n_ctx = n_ctx  # this slot's share of the context
        self.cache_tokens: list[int] = []
        self.cells: list[int] = []  # which KV cell holds each of them (kv_share: a shared prefix's cells are another slot's)
        self.job: Job | None = None  # the run on it (None: idle)
        self.t_last_used = 0.0
        self.n_restored = 0  # prompts brought back into this slot from the prompt cache
        self.changed_from: int | None = None  # the first position whose token changed since take_changes (None: none)
        self.n_shared = 0  # its first cells that another sequence may hold too (kv_share): they never move (seq_add)

    @property
    def is_idle(self) -> bool:
        return self.job is None

    @property
    def n_past(self) -> int:
        """Tokens in this slot's KV cache: the next token goes at this position."""
        return len(self.cache_tokens)

    def changed(self, pos: int) -> None:
        """The tokens from ``pos`` on are not what they were (every method below that changes ``cache_tokens`` says so)."""
        self.changed_from = pos if self.changed_from is None else min(self.changed_from, pos)

    def take_changes(self) -> int | None:
        """The first position changed since the last call (None: nothing changed), and forget it (the KV events' reader)."""
        changed, self.changed_from = self.changed_from, None
        return changed

    def similarity(self, tokens: list[int]) -> float:
        """How much of ``tokens`` this slot already holds, 0..1 (lcp / len(tokens))."""
        return common_prefix(self.cache_tokens, tokens) / len(tokens) if tokens else 0.0

    def reuse(self, ctx: KVMemory, tokens: list[int], cache_prompt: bool, n_cache_reuse: int | None) -> tuple[int, int]:
        """Keep what this slot holds of ``tokens`` (with ``cache_prompt``: the common prefix, and with ``n_cache_reuse``
        chunks moved into place), drop the rest of its KV: returns (tokens kept, of which moved). At least one
        token is left to evaluate: the next token is sampled from its logits.

        (llama-server: the n_past logic of pre_decode, with its n_cache_reuse loop)
        """
        n_past = common_prefix(self.cache_tokens, tokens) if cache_prompt else 0
        n_moved = self.reuse_chunks(ctx, tokens, n_past, n_cache_reuse) if cache_prompt and n_cache_reuse else 0
        n_keep = min(n_past + n_moved, len(tokens) - 1)
        if not self.truncate(ctx, n_keep):
            self.clear_prompt(ctx)  # this memory cannot cut a sequence in the middle: drop it all
            return 0, 0
        return n_keep, min(n_moved, n_keep)

    def reuse_chunks(self, ctx: KVMemory, prompt: list[int], n_past: int, min_chunk: int) -> int:
        """After the common prefix, move cached chunks that the prompt repeats into their new places.

        (llama-server: the n_cache_reuse loop of pre_decode, --cache-reuse.) An edited
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
            if n >= min_chunk and head_c >= self.n_shared:  # a shared cell stays put: moving it moves it for its other holders
                self.changed(head_p)
                ctx.seq_rm(self.id, head_p, head_c)
                ctx.seq_add(self.id, head_c, head_c + n, head_p - head_c)
                cache[head_p : head_p + n] = cache[head_c : head_c + n]
                self.cells[head_p : head_p + n] = self.cells[head_c : head_c + n]  # the same cells, at new positions
                head_c, head_p, n_moved = head_c + n, head_p + n, n_moved + n
            else:
                head_c += 1
        return n_moved

    def append(self, tokens: list[int]) -> None:
        """A decode wrote ``tokens`` at the end of this slot's sequence (``Scheduler.commit``)."""
        self.changed(len(self.cache_tokens))
        self.cache_tokens.extend(tokens)
        self.cells.extend(new_cells(len(tokens)))

    def shift_context(self, ctx: KVMemory, n_keep: int) -> None:
        """Make room in a full slot: drop half the tokens after the first ``n_keep``, move the rest back.

        (llama-server: the context shift at the top of pre_decode, --context-shift.)
        The generation goes on, having forgotten the middle of what it read. Cells it shares stay where they are (it
        keeps at least those).
        """
        n_keep = min(self.n_ctx - 4, max(n_keep, self.n_shared))
        n_left = self.n_past - n_keep
        n_discard = max(0, min(n_left // 2, n_left - 1))
        ctx.seq_rm(self.id, n_keep, n_keep + n_discard)
        ctx.seq_add(self.id, n_keep + n_discard, self.n_past, -n_discard)
        self.changed(n_keep)
        del self.cache_tokens[n_keep : n_keep + n_discard]
        del self.cells[n_keep : n_keep + n_discard]

    def truncate(self, ctx: KVMemory, n: int) -> bool:
        """Keep the first ``n`` tokens in this slot's KV cache (a request's new prompt, a rejected draft).
        False: this memory cannot cut a sequence in the middle, and nothing changed."""
        if not ctx.seq_rm(self.id, n, -1):
            return False
        if n < len(self.cache_tokens):
            self.changed(n)
        del self.cache_tokens[n:]
        del self.cells[n:]
        self.n_shared = min(self.n_shared, n)
        return True

    def share_from(self, ctx: KVMemory, donor: Slot, n: int) -> None:
        """Hold ``donor``'s first ``n`` cells instead of what this slot held (kv_share, llmkit's own): ``seq_cp`` on a
        unified KV cache, no compute and no copy; neither slot moves those cells from now on (``n_shared``)."""
        ctx.seq_rm(self.id, 0, -1)
        ctx.seq_cp(donor.id, self.id, 0, n)
        self.changed(0)
        self.cache_tokens, self.cells = donor.cache_tokens[:n], donor.cells[:n]
        self.n_shared, donor.n_shared = n, max(donor.n_shared, n)

    # --- the prompt cache (server_slot::prompt_save / prompt_load / prompt_clear) ----------

    def save_prompt(self, cache: PromptCache, ctx: KVMemory) -> bool:
        return cache.save(ctx, self.id, self.cache_tokens)

    def load_prompt(self, cache: PromptCache, ctx: KVMemory, tokens: list[int]) -> None:
        restored = cache.load(ctx, self.id, self.cache_tokens, tokens)
        if restored is not None:
            self.replaced(restored)
            self.n_restored += 1

    def load_cells(self, ctx: KVMemory, tokens: list[int], cells: mmap.mmap | bytearray) -> bool:
        """KV cells another context wrote for ``tokens`` (``KVState``) replace this slot's. False: this context could not
        take them, and the slot is empty (disaggregated prefill: llmkit's own)."""
        if not ctx.set_seq_state(self.id, cells):
            self.clear_prompt(ctx)
            return False
        self.replaced(tokens)
        return True

    def replaced(self, tokens: list[int]) -> None:
        """The sequence's cells were replaced by a copy that holds ``tokens`` (from RAM, or from another context)."""
        self.changed(0)
        self.cache_tokens, self.cells, self.n_shared = list(tokens), new_cells(len(tokens)), 0

    def clear_prompt(self, ctx: KVMemory) -> None:
        ctx.seq_rm(self.id, 0, -1)
        self.changed(0)
        self.cache_tokens, self.cells = [], []
        self.n_shared = 0

    def release(self, ctx: KVMemory, *, keep_cache: bool = True) -> None:
        """The job leaves (it ended, or was preempted). The KV cache stays for the next request unless ``keep_cache`` is False."""
        self.job = None
        self.t_last_used = time.perf_counter()
        if not keep_cache:
            self.clear_prompt(ctx)
