"""``kv_share``'s decisions (llmkit's own, beyond llama-server): which sequence's cells a request takes, when it waits for
cells being read, which prefix stays resident and which is purged first. Pure functions over the KV cache's sequences
(``Scheduler.holders``: the slots, then the resident prefixes), each testable alone (``tests/test_kv_share.py``, on a
model of llama.cpp's unified cache); the scheduler acts on what they say.

On llama.cpp's unified KV cache a cell carries the set of sequences that hold it, and ``seq_cp`` only adds one to the
set: that set is the reference count SGLang's radix cache keeps per node, and a cell no sequence holds is free. The
index over token ids is the sequences' own ``cache_tokens``: a prefix of a request's prompt is found by comparing them.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmkit.engine.policy import held_prefix
from llmkit.engine.slot import Slot
from llmkit.engine.tokens import common_prefix


def prefix_donor(slots: Sequence[Slot], slot: Slot, tokens: list[int]) -> tuple[Slot, int] | None:
    """The other sequence, a slot busy or idle or a resident prefix, that holds the longest prefix of ``tokens``, and
    how many of its cells ``slot`` takes, if that is more than ``slot`` keeps of its own. A token is always left to
    read: the first token is sampled from its logits."""
    n_own = common_prefix(slot.cache_tokens, tokens)
    held = [(min(common_prefix(other.cache_tokens, tokens), len(tokens) - 1), other) for other in slots if other is not slot]
    n, donor = max(held, key=lambda h: h[0], default=(0, slot))
    return (donor, n) if n > n_own else None


def waits_for_cells(slots: Sequence[Slot], tokens: list[int], min_shared: int) -> bool:
    """Whether a request for ``tokens`` waits for a prefix that a slot is reading now rather than read it too (SGLang's
    in-batch prefix caching): when that slot will hold ``min_shared`` or more of its tokens beyond what any sequence
    holds already. It waits while that prefix is read, never longer than it would take to read it itself."""
    held = held_prefix(slots, tokens)
    reading = [s.job.context for s in slots if s.job is not None and not s.job.is_generating]
    return any(common_prefix(context, tokens) - held >= min_shared for context in reading)


def to_keep(slots: Sequence[Slot], slot: Slot, tokens: list[int], min_tokens: int) -> bool:
    """Whether ``slot``'s cells should stay resident before a request for ``tokens`` starts on it: it would drop
    ``min_tokens`` or more of them, and no other sequence holds all the tokens they hold."""
    held = slot.cache_tokens
    if len(held) - common_prefix(held, tokens) < min_tokens:
        return False
    return not any(other is not slot and common_prefix(other.cache_tokens, held) == len(held) for other in slots)


def resident_for(resident: Sequence[Slot], tokens: list[int]) -> Slot:
    """The resident sequence that keeps ``tokens`` next: one holding a prefix of them (it holds a longer one now, a
    leaf of SGLang's radix tree that grew), else an empty one, else the least recently used."""
    grown = [r for r in resident if r.cache_tokens and common_prefix(r.cache_tokens, tokens) == r.n_past]
    if grown:
        return max(grown, key=lambda r: r.n_past)
    return min(resident, key=lambda r: (r.n_past > 0, r.t_last_used))


def frees_cells(slots: Sequence[Slot], slot: Slot) -> bool:
    """Whether clearing ``slot`` frees a cell: one that no other sequence holds (its reference count is 1)."""
    others = {cell for other in slots if other is not slot for cell in other.cells}
    return any(cell not in others for cell in slot.cells)
