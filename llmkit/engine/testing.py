"""Slots and jobs in hand-made states, for the engine's pure parts (``build_batch``, a policy, ``choose_slot``): tests
and exercises plan steps with them, with no model and no sampler (nothing samples).

    stream, newcomer = generating(0), reading(1, 300)     # a slot that generates, one with a 300-token prompt to read
    plan = build_batch(running(stream, newcomer), 512, budget=64)
    Scheduler.commit(plan)                                 # what the engine does once the step's decode succeeded
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from llmkit.engine.job import Job
from llmkit.engine.policy import Running
from llmkit.engine.request import Request, RequestParams
from llmkit.engine.slot import Slot
from llmkit.sampling import Sampler
from llmkit.text import Detokenizer, StopMatcher

N_CTX = 4096  # a slot's context, unless said


def job(prompt: Iterable[int], n_prompt_done: int = 0, **params: Any) -> Job:
    """The job of a request for ``prompt`` (``RequestParams(**params)``), ``n_prompt_done`` of its tokens read; no
    sampler and a detokenizer of no model: nothing samples or writes text."""
    request = Request(list(prompt), RequestParams(**params))
    return Job(request, cast(Sampler, None), Detokenizer(bytes), StopMatcher(), request.prompt, n_prompt_done)


def busy(slot: Slot, prompt: Iterable[int], n_prompt_done: int = 0, **params: Any) -> Slot:
    """``slot`` running the ``job`` of ``prompt``; its cells as they were."""
    slot.job = job(prompt, n_prompt_done, **params)
    return slot


def reading(slot_id: int, n_prompt: int, *, n_ctx: int = N_CTX, **params: Any) -> Slot:
    """A slot whose request has just come: an ``n_prompt``-token prompt (100, 101, ...), none of it read yet."""
    return busy(Slot(slot_id, n_ctx), range(100, 100 + n_prompt), **params)


def generating(slot_id: int, n_prompt: int = 5, *, n_ctx: int = N_CTX, last_token: int = 7, **params: Any) -> Slot:
    """A slot whose request has read its ``n_prompt``-token prompt (0, 1, ..., in the slot's cells) and sampled
    ``last_token``, which the next step decodes."""
    prompt = list(range(n_prompt))
    slot = busy(Slot(slot_id, n_ctx), prompt, n_prompt, **params)
    slot.append(prompt)
    cast(Job, slot.job).last_token = last_token
    return slot


def running(*slots: Slot) -> list[Running]:
    """The busy ones of ``slots`` and their jobs, as the scheduler hands them to ``build_batch`` and a policy."""
    return [Running(slot, slot.job) for slot in slots if slot.job is not None]
