"""The scheduler's decisions and the prompt cache's rules, on slots in hand-made states (no model: milliseconds).

The same mechanisms run on the real model in test_engine.py and test_caching.py."""

from __future__ import annotations

import pytest

from llmkit.engine.prompt_cache import MIB, PromptCache
from llmkit.engine.request import Request, Status
from llmkit.engine.scheduler import build_batch, choose_slot, swaps_prompt
from llmkit.engine.slot import Slot, common_prefix
from llmkit.llama import Batch


def generating(slot_id: int, n_cached: int = 5) -> Slot:
    slot = Slot(slot_id, 4096)
    slot.request = Request(list(range(n_cached)))
    slot.request.status = Status.GENERATING
    slot.cache_tokens = list(range(n_cached))
    slot.last_token = 7
    return slot


def reading(slot_id: int, n_prompt: int) -> Slot:
    slot = Slot(slot_id, 4096)
    slot.request = Request(list(range(100, 100 + n_prompt)))
    slot.request.status = Status.PROMPT
    return slot


@pytest.fixture
def batch():
    b = Batch(512)
    yield b
    b.close()


def test_running_streams_first_then_prompt_chunks_up_to_the_budget(batch):
    streams = [generating(0), generating(1)]
    late = reading(2, 300)
    used = build_batch([*streams, late], batch, budget=64)
    assert used == [*streams, late]
    assert batch.n_tokens == 64  # 2 stream tokens + a 62-token chunk of the prompt
    assert late.n_prompt_done == 62 and late.i_batch == -1  # not the prompt's end: no logits, nothing to sample
    assert [s.i_batch for s in streams] == [0, 1]  # each stream still gets its token this step


def test_a_long_prompt_is_read_over_several_steps_and_asks_for_logits_at_its_end(batch):
    stream, late = generating(0), reading(1, 150)
    steps = []
    while late.n_prompt_done < 150:
        build_batch([stream, late], batch, budget=64)
        steps.append(batch.n_tokens - 1)  # prompt tokens beside the stream's one
    assert steps == [63, 63, 24]
    assert late.i_batch == 24  # the last token of the last chunk holds the logits to sample from
    assert late.cache_tokens == late.request.prompt


def test_oldest_request_first_whatever_the_slot_order(batch):
    first = reading(3, 100)  # submitted first, sits in the last slot
    second = reading(0, 100)
    build_batch([generating(1), second, first], batch, budget=121)
    assert first.n_prompt_done == 100 and second.n_prompt_done == 20


def test_with_no_running_stream_the_budget_does_not_split_prompts(batch):
    alone, next_one = reading(0, 300), reading(1, 300)
    build_batch([alone, next_one], batch, budget=64)  # nobody waits on this step: fill the batch
    assert alone.n_prompt_done == 300 and next_one.n_prompt_done == 212 and batch.n_tokens == batch.capacity


def test_no_budget_fills_the_batch_as_llama_server_does(batch):
    stream, late = generating(0), reading(1, 2000)
    build_batch([stream, late], batch, budget=0)
    assert batch.n_tokens == batch.capacity == 512 and late.n_prompt_done == 511


# --- choose_slot and swaps_prompt (get_available_slot) ---------------------------------------


def idle(slot_id: int, cached: list[int], t_last_used: float = 0.0) -> Slot:
    slot = Slot(slot_id, 4096)
    slot.cache_tokens, slot.t_last_used = list(cached), t_last_used
    return slot


PROMPT = list(range(100))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_the_longest_prefix_wins_when_it_covers_more_than_a_tenth_else_the_least_recently_used():
    slots = [idle(0, PROMPT[:30], t_last_used=1), idle(1, PROMPT[:60], t_last_used=2), idle(2, [], t_last_used=0)]
    assert choose_slot(slots, Request(PROMPT)) is slots[1]
    slots[1].cache_tokens = PROMPT[:10]  # exactly 10 %: not more than the threshold
    slots[0].cache_tokens = PROMPT[:10]
    assert choose_slot(slots, Request(PROMPT)) is slots[2]  # least recently used
    slots[0].cache_tokens = PROMPT[:11]
    assert choose_slot(slots, Request(PROMPT)) is slots[0]


def test_busy_slots_are_never_chosen_and_id_slot_waits_for_its_slot():
    slots = [idle(0, PROMPT), idle(1, [])]
    slots[0].request = Request([1])
    assert choose_slot(slots, Request(PROMPT)) is slots[1]
    assert choose_slot(slots, Request(PROMPT, id_slot=0)) is None
    slots[1].request = Request([1])
    assert choose_slot(slots, Request(PROMPT)) is None


def test_which_choices_go_through_the_prompt_cache():
    lru = idle(0, list(range(500, 600)))
    assert swaps_prompt(lru, Request(PROMPT))  # chosen as least recently used: its prompt is not this one
    assert not swaps_prompt(lru, Request(PROMPT, id_slot=0))  # named by id_slot, no similarity: kept as it is
    assert not swaps_prompt(lru, Request(PROMPT, cache_prompt=False))
    keeps_most = idle(0, PROMPT[:80] + [7] * 20)  # similar, and keeps 80 % of what it holds
    assert not swaps_prompt(keeps_most, Request(PROMPT))
    loses_most = idle(0, PROMPT[:20] + [7] * 80)  # similar (20 %), but would keep only 20 % of what it holds
    assert swaps_prompt(loses_most, Request(PROMPT))


# --- the prompt cache's rules (server_prompt_cache) ------------------------------------------


class FakeContext:
    """Sequences as byte strings: what PromptCache asks of llmkit.llama.Context."""

    def __init__(self, sizes: dict[int, int]):
        self.seqs = {seq: bytearray(n) for seq, n in sizes.items()}

    def seq_state(self, seq_id: int) -> bytearray:
        return bytearray(self.seqs[seq_id])

    def set_seq_state(self, seq_id: int, data: bytearray) -> bool:
        self.seqs[seq_id] = bytearray(data)
        return True

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        self.seqs[seq_id] = bytearray()
        return True


def test_save_skips_what_it_holds_drops_what_the_new_entry_contains_and_evicts_the_oldest():
    cache, ctx = PromptCache(limit_mib=3, limit_tokens=0), FakeContext({0: MIB})
    assert cache.save(ctx, 0, PROMPT[:50])
    assert not cache.save(ctx, 0, PROMPT[:40])  # a prefix of an entry: already held
    assert cache.save(ctx, 0, PROMPT)  # contains the first entry: it replaces it
    assert [len(e.tokens) for e in cache.entries] == [100]
    for start in (200, 300, 400):
        cache.save(ctx, 0, list(range(start, start + 10)))
    assert cache.size <= 3 * MIB and len(cache.entries) == 3 and cache.evictions == 1
    assert cache.entries[0].tokens[0] == 200  # PROMPT, the oldest, went first


def test_load_takes_an_entry_only_if_it_serves_the_prompt_better_and_keeps_a_quarter_of_itself():
    cache, ctx = PromptCache(limit_mib=0, limit_tokens=0), FakeContext({0: 10, 1: 20})
    cache.save(ctx, 1, PROMPT[:60] + [7] * 40)  # 60 of the prompt, 60 % of itself
    cache.save(ctx, 0, PROMPT[:20] + [9] * 80)  # 20 of the prompt, only 20 % of itself: never taken
    assert cache.load(ctx, 0, PROMPT[:70], PROMPT) is None and cache.misses == 1  # the slot holds more already
    restored = cache.load(ctx, 0, [5, 5], PROMPT)
    assert restored == PROMPT[:60] + [7] * 40 and cache.hits == 1 and len(ctx.seqs[0]) == 20
    assert len(cache.entries) == 1  # the entry moved into the slot
    assert cache.load(ctx, 1, [], PROMPT) is None  # an empty slot takes any entry that keeps a quarter: none left
