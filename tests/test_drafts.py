"""Speculation's drafters and the plan with drafts, on hand-made token lists (no model: milliseconds).

The engine verifying drafts on the real model: test_speculative.py."""

from __future__ import annotations

import pytest
from test_scheduler import CAPACITY

from llmkit.engine.config import EngineConfig
from llmkit.engine.scheduler import build_batch
from llmkit.engine.speculative import NgramMod, NgramSimple, SpecParams, SpecType, make_drafter, rfind
from llmkit.engine.testing import generating, reading, running

TEXT = list(range(1000, 1100))  # 100 distinct tokens: a "file"


def test_ngram_simple_drafts_what_followed_the_last_tokens_before():
    tokens = [*TEXT, 5, 6, *TEXT[:30]]  # the file, then its start again: the next tokens are TEXT[30:]
    draft = NgramSimple(size_n=12, size_m=48).draft(0, tokens[:-1], tokens[-1], n_max=64)
    assert draft == TEXT[30:78]  # size_m tokens of what followed


def test_ngram_simple_drafts_nothing_without_a_match_and_obeys_n_max():
    drafter = NgramSimple(size_n=12, size_m=48)
    assert drafter.draft(0, TEXT[:-1], TEXT[-1], n_max=64) == []  # no earlier occurrence
    tokens = TEXT + TEXT[:30]
    assert drafter.draft(0, tokens[:-1], tokens[-1], n_max=5) == TEXT[30:35]


def test_rfind_keeps_only_token_aligned_hits():
    # little-endian int32: 0x00010000 is bytes 00 00 01 00, 0 is 00 00 00 00; the token 1 (01 00 00 00) sits
    # across them at byte 2, which is no token
    assert rfind([0x00010000, 0], [1], end=2) == -1
    assert rfind([1, 0x00010000, 0, 1], [1], end=4) == 3
    assert rfind([1, 0x00010000, 0, 1], [1], end=3) == 0  # the last one lies past end


def test_ngram_mod_learns_the_prompt_and_drafts_a_chain_at_least_n_min_long():
    drafter = NgramMod(n_match=4, n_min=8, n_max=16)
    drafter.begin(0, TEXT)
    tokens = [*TEXT, 5, *TEXT[:10]]
    assert drafter.draft(0, tokens[:-1], tokens[-1], n_max=64) == TEXT[10:26]
    assert drafter.draft(0, tokens[:-1], tokens[-1], n_max=3) == TEXT[10:13]  # a draft is cut to the slot's room
    drafter = NgramMod(n_match=4, n_min=8, n_max=16)
    drafter.begin(0, TEXT[:12])
    assert drafter.draft(0, TEXT[:5], TEXT[5], n_max=64) == []  # the chain TEXT[6:12] is under n_min


def test_ngram_mod_forgets_after_five_drafts_mostly_rejected():
    drafter = NgramMod(n_match=4, n_min=8, n_max=16)
    drafter.begin(0, TEXT)
    tokens = [*TEXT, 5, *TEXT[:10]]
    for _ in range(4):
        assert drafter.draft(0, tokens[:-1], tokens[-1], n_max=64)
        drafter.accept(0, n_drafted=16, n_accepted=1)
    assert drafter.used > 0
    drafter.accept(0, n_drafted=16, n_accepted=3)  # 3/16 < 1/4: the fifth in a row
    assert drafter.used == 0


def test_spec_params_are_checked_and_make_their_drafter():
    assert make_drafter(SpecParams()) is None
    assert isinstance(make_drafter(SpecParams(SpecType.NGRAM_SIMPLE)), NgramSimple)
    assert SpecParams(SpecType.NGRAM_MOD).n_max == 64
    with pytest.raises(ValueError, match="spec_type must be a SpecType"):
        EngineConfig(speculative=SpecParams("eagle")).resolved()


def test_slow_start_doubles_the_window_on_a_whole_draft_and_shrinks_it_to_the_kept_run():
    fixed, slow = SpecParams(SpecType.NGRAM_MOD), SpecParams(SpecType.NGRAM_MOD, slow_start=4)
    assert fixed.first_window == 64 and fixed.next_window(0) == 64  # llama-server's: always the mode's longest
    window, windows = slow.first_window, []
    for kept_all in (True, True, True, True, True, False):  # whole drafts, then one cut after 3 tokens
        window = slow.next_window(window if kept_all else 3)
        windows.append(window)
    assert windows == [8, 16, 32, 64, 64, 6]
    assert slow.next_window(0) == 4  # never below slow_start
    with pytest.raises(ValueError, match="slow_start"):
        SpecParams(SpecType.NGRAM_MOD, slow_start=-1).checked()


def test_a_draft_rides_behind_its_stream_token_and_asks_for_logits_at_every_position():
    stream, other = generating(0), generating(1)
    plan = build_batch(running(stream, other), CAPACITY, drafts={0: [8, 9, 10]})
    assert [(c.tokens, c.i_logits, list(c.logit_rows), c.draft) for c in plan] == [
        ([7, 8, 9, 10], 3, [0, 1, 2, 3], [8, 9, 10]),
        ([7], 4, [4], []),
    ]


def test_a_draft_takes_nothing_from_the_step_budget_of_prompts():
    stream, late = generating(0), reading(1, 300)
    drafts = {0: list(range(40))}
    plan = build_batch(running(stream, late), CAPACITY, budget=64, drafts=drafts)
    assert len(plan[1].tokens) == 63  # as without the draft: the budget counts the stream as one token
    plan = build_batch(running(stream, late), 50, budget=64, drafts=drafts)
    assert len(plan[1].tokens) == 9  # but the whole batch still fits its capacity
