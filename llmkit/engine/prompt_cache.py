"""The host-RAM prompt cache (~ llama-server's ``server_prompt_cache``, server-task.cpp).

A slot's KV cache holds one prompt. Before a slot is given to a request that
will overwrite most of it, its cells are copied to RAM (``save``); a later
request whose prompt starts the same way gets them back, on whichever slot it
lands (``load``). So a prefix is read once, not once per slot.

    cache = PromptCache(limit_mib=8192, limit_tokens=n_ctx)
    cache.save(ctx, slot_id, tokens)          # copy the sequence's cells out
    tokens = cache.load(ctx, slot_id, tokens, prompt)  # the best entry, moved into the sequence

Entries are kept oldest first and evicted from the front when over the limit,
as llama-server's ``std::list`` of states.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass

from llmkit.engine.memory import KVMemory
from llmkit.engine.tokens import common_prefix

log = logging.getLogger(__name__)
MIB = 1024 * 1024
MIN_KEEP = 0.25  # server_prompt_cache::load: "don't trash large prompts" (an entry must keep a quarter of itself)


@dataclass
class CachedPrompt:
    tokens: list[int]
    state: mmap.mmap  # the cells of the sequence, as llama_state_seq_get_data wrote them (Context.seq_state)

    @property
    def size(self) -> int:
        return len(self.state)


Choice = Callable[[list[list[int]], list[int], list[int]], int | None]  # (entries, held, prompt) -> an entry's index, or None


def choose_entry(entries: list[list[int]], held: list[int], prompt: list[int]) -> int | None:
    """Which cached prompt serves ``prompt`` better than the ``held`` tokens its sequence holds: its index in
    ``entries`` (oldest first), or None (server_prompt_cache::load's rule). "Better" is more of the prompt (f_sim) AND
    more of itself kept (f_keep), and an entry that would keep under a quarter of itself is never taken."""
    lcp = common_prefix(held, prompt)
    keep_best = lcp / len(held) if held else -1.0  # an empty slot: any entry wins
    sim_best, best = lcp / len(prompt), None
    for i, tokens in enumerate(entries):
        lcp = common_prefix(tokens, prompt)
        keep, sim = lcp / len(tokens), lcp / len(prompt)
        if keep >= MIN_KEEP and keep > keep_best and sim > sim_best:
            best, keep_best, sim_best = i, keep, sim
    return best


class PromptCache:
    def __init__(self, limit_mib: int, limit_tokens: int, choose: Choice = choose_entry):
        self.choose = choose  # which entry comes back for a prompt (EngineConfig.cache_choice: llama-server's rule, or yours)
        self.limit_bytes = limit_mib * MIB if limit_mib > 0 else 0  # 0: no limit in bytes (--cache-ram -1)
        self.limit_tokens = limit_tokens  # llama-server passes n_ctx
        self.entries: list[CachedPrompt] = []  # oldest first
        self.hits = self.misses = self.saves = self.evictions = 0

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def save(self, ctx: KVMemory, seq_id: int, tokens: list[int]) -> bool:
        """Copy sequence ``seq_id`` (holding ``tokens``) to RAM (server_slot::prompt_save + alloc)."""
        if not tokens or any(common_prefix(e.tokens, tokens) == len(tokens) for e in self.entries):
            return False  # nothing to keep, or already kept
        state = ctx.seq_state(seq_id)
        if self.limit_bytes and len(state) > self.limit_bytes:
            return False  # one entry over the whole limit would empty the cache for nothing
        # entries that are a prefix of this one are obsolete: it holds them all
        self.entries = [e for e in self.entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        while self.entries and self.limit_bytes and self.size + len(state) > self.limit_bytes:
            self._evict_oldest()
        self.entries.append(CachedPrompt(list(tokens), state))
        self.saves += 1
        return True

    def load(self, ctx: KVMemory, seq_id: int, tokens: list[int], prompt: list[int]) -> list[int] | None:
        """Restore the entry that serves ``prompt`` better than the ``tokens`` the sequence holds (server_prompt_cache::load:
        ``choose``, then the move). The entry moves into the sequence: it leaves the cache. Returns the sequence's new
        tokens, or None when nothing beats what it holds ([] if llama.cpp failed to restore: the sequence is then empty).
        """
        i = self.choose([list(entry.tokens) for entry in self.entries], list(tokens), list(prompt))
        if i is None:
            self.misses += 1
            return None
        if not isinstance(i, int) or not 0 <= i < len(self.entries):
            raise ValueError(f"the prompt cache's choice returned {i!r}: an index of its {len(self.entries)} entries, or None")
        best = self.entries.pop(i)
        if not ctx.set_seq_state(seq_id, best.state):  # llama-server then clears the slot: so do we
            ctx.seq_rm(seq_id, 0, -1)
            return []
        self.hits += 1
        return best.tokens

    def update(self) -> None:
        """Evict the oldest entries while over the limits (server_prompt_cache::update)."""
        while self.entries and self.limit_bytes and self.size > self.limit_bytes:
            self._evict_oldest()
        # the token limit grows with what fits in the byte limit, as llama-server estimates it
        per_token = max(1.0, self.size / max(1, self.n_tokens))
        limit_tokens = max(self.limit_tokens, int(self.limit_bytes / per_token)) if self.limit_bytes else self.limit_tokens
        while self.entries and limit_tokens and self.n_tokens > limit_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Drop the oldest entry, and say so in the server's log in llama-server's words (a warning there; info here, so
        that a notebook's in-process engine prints nothing)."""
        oldest = self.entries.pop(0)
        self.evictions += 1
        log.info("prompt cache: removing oldest entry (size = %.3f MiB)", oldest.size / MIB)

    def to_dict(self) -> dict:
        """State for ``/slots``, ``/props`` and ``/metrics``."""
        return {
            "limit_bytes": self.limit_bytes,
            "bytes": self.size,
            "n_prompts": len(self.entries),
            "n_tokens": self.n_tokens,
            "hits": self.hits,
            "misses": self.misses,
            "saves": self.saves,
            "evictions": self.evictions,
        }
