"""The scheduler's decisions and the prompt cache's rules, on slots in hand-made states (no model: milliseconds).

The same mechanisms run on the real model in test_engine.py and test_caching.py."""

from __future__ import annotations

import logging

import pytest

from llmkit.engine.policy import FairShare, LlamaServerPolicy, LongestPrefixMatch, PriorityPolicy, ShortestPromptFirst, choose_slot
from llmkit.engine.prompt_cache import MIB, PromptCache
from llmkit.engine.request import Request, RequestParams
from llmkit.engine.scheduler import Scheduler, admission, build_batch, swaps_prompt
from llmkit.engine.slot import Slot
from llmkit.engine.testing import busy, generating, reading, running
from llmkit.engine.tokens import common_prefix

CAPACITY = 512  # the batch's (llama-server's n_batch)


commit = Scheduler.commit  # what the engine does with a plan once it is decoded


def test_running_streams_first_then_prompt_chunks_up_to_the_budget():
    streams = [generating(0), generating(1)]
    late = reading(2, 300)
    plan = build_batch(running(*streams, late), CAPACITY, budget=64)
    assert [c.slot for c in plan] == [*streams, late]
    assert sum(len(c.tokens) for c in plan) == 64  # 2 stream tokens + a 62-token chunk of the prompt
    assert plan[2].tokens == late.job.context[:62] and plan[2].i_logits == -1  # not the prompt's end: nothing to sample
    assert [(c.tokens, c.pos, c.i_logits) for c in plan[:2]] == [([7], 5, 0), ([7], 5, 1)]  # each stream gets its token


def test_the_plan_changes_nothing():
    stream, late = generating(0), reading(1, 150)
    before = [(s.cache_tokens.copy(), s.job.n_prompt_done, s.job.last_token) for s in (stream, late)]
    build_batch(running(stream, late), CAPACITY, budget=64)
    assert [(s.cache_tokens, s.job.n_prompt_done, s.job.last_token) for s in (stream, late)] == before


def test_a_long_prompt_is_read_over_several_steps_and_asks_for_logits_at_its_end():
    stream, late = generating(0), reading(1, 150)
    steps = []
    while late.job.n_prompt_done < 150:
        plan = build_batch(running(stream, late), CAPACITY, budget=64)
        steps.append(len(plan[1].tokens))  # prompt tokens beside the stream's one
        commit(plan)
    assert steps == [63, 63, 24]
    assert plan[1].i_logits == 24  # the last token of the last chunk holds the logits to sample from
    assert late.cache_tokens == late.job.context


def test_oldest_request_first_whatever_the_slot_order():
    first = reading(3, 100)  # submitted first, sits in the last slot
    second = reading(0, 100)
    plan = build_batch(running(generating(1), second, first), CAPACITY, budget=121)
    assert [(c.slot.id, len(c.tokens)) for c in plan] == [(1, 1), (3, 100), (0, 20)]


def test_with_no_running_stream_the_budget_does_not_split_prompts():
    alone, next_one = reading(0, 300), reading(1, 300)
    plan = build_batch(running(alone, next_one), CAPACITY, budget=64)  # nobody waits on this step: fill the batch
    assert [len(c.tokens) for c in plan] == [300, 212] and sum(len(c.tokens) for c in plan) == CAPACITY


def test_no_budget_fills_the_batch_as_llama_server_does():
    stream, late = generating(0), reading(1, 2000)
    plan = build_batch(running(stream, late), CAPACITY, budget=0)
    assert sum(len(c.tokens) for c in plan) == CAPACITY and len(plan[1].tokens) == 511


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
    assert choose_slot(slots, RequestParams(), PROMPT) is slots[1]
    slots[1].cache_tokens = PROMPT[:10]  # exactly 10 %: not more than the threshold
    slots[0].cache_tokens = PROMPT[:10]
    assert choose_slot(slots, RequestParams(), PROMPT) is slots[2]  # least recently used
    slots[0].cache_tokens = PROMPT[:11]
    assert choose_slot(slots, RequestParams(), PROMPT) is slots[0]


def test_busy_slots_are_never_chosen_and_id_slot_waits_for_its_slot():
    slots = [busy(idle(0, PROMPT), [1]), idle(1, [])]
    assert choose_slot(slots, RequestParams(), PROMPT) is slots[1]
    assert choose_slot(slots, RequestParams(id_slot=0), PROMPT) is None
    busy(slots[1], [1])
    assert choose_slot(slots, RequestParams(), PROMPT) is None


def test_which_choices_go_through_the_prompt_cache():
    lru = idle(0, list(range(500, 600)))
    assert swaps_prompt(lru, PROMPT, RequestParams())  # chosen as least recently used: its prompt is not this one
    assert swaps_prompt(lru, PROMPT, RequestParams(id_slot=0))  # named by id_slot, not similar: f_keep = 0 < 0.5
    assert not swaps_prompt(idle(0, []), PROMPT, RequestParams(id_slot=0))  # named and empty: f_keep = 0/0, no update
    assert not swaps_prompt(lru, PROMPT, RequestParams(cache_prompt=False))
    keeps_most = idle(0, PROMPT[:80] + [7] * 20)  # similar, and keeps 80 % of what it holds
    assert not swaps_prompt(keeps_most, PROMPT, RequestParams())
    loses_most = idle(0, PROMPT[:20] + [7] * 80)  # similar (20 %), but would keep only 20 % of what it holds
    assert swaps_prompt(loses_most, PROMPT, RequestParams())


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


def test_save_skips_what_it_holds_drops_what_the_new_entry_contains_and_evicts_the_oldest(caplog):
    caplog.set_level(logging.INFO, logger="llmkit.engine.prompt_cache")
    cache, ctx = PromptCache(limit_mib=3, limit_tokens=0), FakeContext({0: MIB})
    assert cache.save(ctx, 0, PROMPT[:50])
    assert not cache.save(ctx, 0, PROMPT[:40])  # a prefix of an entry: already held
    assert cache.save(ctx, 0, PROMPT)  # contains the first entry: it replaces it
    assert [len(e.tokens) for e in cache.entries] == [100]
    for start in (200, 300, 400):
        cache.save(ctx, 0, list(range(start, start + 10)))
    assert cache.size <= 3 * MIB and len(cache.entries) == 3 and cache.evictions == 1
    assert cache.entries[0].tokens[0] == 200  # PROMPT, the oldest, went first
    assert [r.getMessage() for r in caplog.records] == ["prompt cache: removing oldest entry (size = 1.000 MiB)"]  # as llama-server's log


def test_load_takes_an_entry_only_if_it_serves_the_prompt_better_and_keeps_a_quarter_of_itself():
    cache, ctx = PromptCache(limit_mib=0, limit_tokens=0), FakeContext({0: 10, 1: 20})
    cache.save(ctx, 1, PROMPT[:60] + [7] * 40)  # 60 of the prompt, 60 % of itself
    cache.save(ctx, 0, PROMPT[:20] + [9] * 80)  # 20 of the prompt, only 20 % of itself: never taken
    assert cache.load(ctx, 0, PROMPT[:70], PROMPT) is None and cache.misses == 1  # the slot holds more already
    restored = cache.load(ctx, 0, [5, 5], PROMPT)
    assert restored == PROMPT[:60] + [7] * 40 and cache.hits == 1 and len(ctx.seqs[0]) == 20
    assert len(cache.entries) == 1  # the entry moved into the slot
    assert cache.load(ctx, 1, [], PROMPT) is None  # an empty slot takes any entry that keeps a quarter: none left


# --- the scheduling policies: admission order, slot choice, preemption, prompt order -------------------------


def queue(*prompts: int, **params) -> list[Request]:
    """Waiting requests, in arrival order, with prompts of the given lengths."""
    return [Request(list(range(200, 200 + n)), RequestParams(**params)) for n in prompts]


def admit_all(waiting: list[Request], slots: list[Slot], policy) -> list[tuple[int, int]]:
    """What the engine's admit loop does with the policy, without a model: (request index, slot) in order."""
    order, waiting = [], list(waiting)
    index = {r.id: i for i, r in enumerate(waiting)}
    while (found := admission(waiting, slots, policy, lambda r: r.prompt)) is not None:
        waiting.remove(found.request)
        busy(found.slot, found.request.prompt, priority=found.request.params.priority, tenant=found.request.params.tenant)
        order.append((index[found.request.id], found.slot.id))
    return order


def test_llama_servers_policy_is_first_come_first_served_and_a_busy_named_slot_waits_alone():
    slots = [idle(0, []), idle(1, [])]
    waiting = queue(5, 50, 3)
    assert admit_all(waiting, slots, LlamaServerPolicy()) == [(0, 0), (1, 1)]  # the third waits for a slot
    slots = [busy(idle(0, []), [1]), idle(1, [])]
    named = queue(5, id_slot=0) + queue(7)  # the first wants slot 0, which is busy: the second goes on
    assert admit_all(named, slots, LlamaServerPolicy()) == [(1, 1)]


def test_shortest_prompt_first_admits_and_reads_the_shortest_first():
    assert admit_all(queue(50, 5, 20), [idle(0, []), idle(1, [])], ShortestPromptFirst()) == [(1, 0), (2, 1)]
    long, short = reading(0, 300), reading(1, 10)
    plan = build_batch(running(generating(2), long, short), CAPACITY, budget=64, prompt_order=ShortestPromptFirst().prompt_order)
    assert [(c.slot.id, len(c.tokens)) for c in plan] == [(2, 1), (1, 10), (0, 53)]


def test_fair_share_admits_the_tenant_holding_the_fewest_slots_first():
    def slots() -> list[Slot]:
        return [busy(idle(0, []), [1], tenant="a"), idle(1, []), idle(2, [])]

    waiting = queue(5, 5, tenant="a") + queue(5, tenant="b") + queue(5, tenant="c")
    # a holds a slot already: b and c go first, though a's two came earlier; llama-server's order serves a's burst
    assert admit_all(waiting, slots(), FairShare()) == [(2, 1), (3, 2)]
    assert admit_all(waiting, slots(), LlamaServerPolicy()) == [(0, 1), (1, 2)]


def test_longest_prefix_match_admits_the_request_with_the_most_of_its_prompt_cached_first():
    system = list(range(500, 540))
    slots = [busy(idle(0, [*system, 1, 2]), [*system, 1, 2], 42), idle(1, system[:10]), idle(2, [])]
    cold, warm, warmer = (Request(tokens, RequestParams()) for tokens in ([9, 9, 9], [*system[:10], 7], [*system, 8]))
    # 40 tokens held by the busy slot 0, 10 by the idle slot 1, none: warmer, warm, cold, where llama-server serves arrival
    assert [r.id for r in LongestPrefixMatch().order([cold, warm, warmer], slots)] == [warmer.id, warm.id, cold.id]
    assert [r.id for r in LlamaServerPolicy().order([cold, warm, warmer], slots)] == [cold.id, warm.id, warmer.id]


def test_priority_goes_first_and_takes_the_slot_of_the_latest_lowest_priority_job():
    slots = [busy(idle(0, []), [1], priority=5), busy(idle(1, []), [1], priority=5), busy(idle(2, []), [1], priority=1)]
    assert PriorityPolicy().order(queue(5, priority=3) + queue(5, priority=0), slots)[0].params.priority == 0
    (found,) = [admission(queue(5, priority=0), slots, PriorityPolicy(), lambda r: r.prompt)]
    assert found is not None and found.preempt and found.slot is slots[1]  # priority 5, and started after slot 0's
    assert admission(queue(5, priority=5), slots, PriorityPolicy(), lambda r: r.prompt) is None  # none lower: it waits
    assert admission(queue(5, priority=0), slots, LlamaServerPolicy(), lambda r: r.prompt) is None  # llama-server never preempts


def test_a_policy_is_loaded_by_name_or_as_module_colon_class(tmp_path, monkeypatch):
    from llmkit.engine import plugins
    from llmkit.engine.policy import POLICIES

    (tmp_path / "mine.py").write_text("from llmkit.engine import LlamaServerPolicy\nclass Mine(LlamaServerPolicy):\n    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(plugins.find("lpm", POLICIES, "scheduling policy")(), LongestPrefixMatch)
    assert plugins.find("mine:Mine", POLICIES, "scheduling policy")().name == "mine"
    for wrong, said in (("nope", "one of llama-server"), ("mine:Other", "cannot be loaded"), ("absent:X", "cannot be loaded")):
        with pytest.raises(ValueError, match=said):
            plugins.find(wrong, POLICIES, "scheduling policy")
