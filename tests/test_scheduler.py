"""The batch builder with a token budget, on slots in hand-made states (no model: runs in milliseconds)."""

from __future__ import annotations

import pytest

from llmkit.engine.request import Request, Status
from llmkit.engine.scheduler import build_batch
from llmkit.engine.slot import Slot
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
    late = reading(0, 150)
    steps = []
    while late.n_prompt_done < 150:
        build_batch([late], batch, budget=64)
        steps.append(batch.n_tokens)
    assert steps == [64, 64, 22]
    assert late.i_batch == 21  # the last token of the last chunk holds the logits to sample from
    assert late.cache_tokens == late.request.prompt


def test_oldest_request_first_whatever_the_slot_order(batch):
    first = reading(3, 100)  # submitted first, sits in the last slot
    second = reading(0, 100)
    build_batch([second, first], batch, budget=120)
    assert first.n_prompt_done == 100 and second.n_prompt_done == 20


def test_no_budget_fills_the_batch_as_llama_server_does(batch):
    stream, late = generating(0), reading(1, 2000)
    build_batch([stream, late], batch, budget=0)
    assert batch.n_tokens == batch.capacity == 512 and late.n_prompt_done == 511
