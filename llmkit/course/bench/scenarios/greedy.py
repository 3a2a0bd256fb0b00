"""Greedy drift: are the same greedy answers alike alone and batched (in-process, one KV stream per slot)?"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmkit.course.bench.config import GREEDY_SLOTS, Config
from llmkit.course.bench.prompts import QUESTION, REVIEWS

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ReviewDrift:
    """One review of ``greedy_drift``: its answer alone, and how the batched runs' answers differed from it."""

    review: str
    differed: int  # batched runs whose answer was not the one alone
    alone: str
    batched_differing: list[str]  # those answers, each once
    same_chars_before_difference: int | None  # the fewest characters any of them shared with the answer alone


@dataclass(frozen=True)
class GreedyDrift:
    """Chapter 6's reviews answered alone, alone again (the control) and ``runs`` times batched."""

    runs: int
    slots: int
    max_tokens: int
    reviews: list[ReviewDrift]
    runs_with_difference: int  # batched runs in which at least one answer differed from alone
    alone_twice_identical: bool
    alone_twice_differed: int  # answers that differed between the two runs alone
    batch_schedules: int  # distinct step sequences (prompt and generated tokens per step) among the batched runs
    seconds: float


def same_start(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share before they part."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def greedy_drift(cfg: Config) -> GreedyDrift:
    """Chapter 6's 8 reviews, unconstrained and greedy, on an in-process ``Engine`` with 4 slots of one
    KV stream each (explicit ``n_parallel``: ``kv_unified=False``), as chapter 6's ``-np 4 -c 4096`` server.

    Each review is answered alone (the reference), then alone again (the control: the same batch
    shapes, so the same answers expected); then ``cfg.greedy_runs`` times all 8 are submitted at once
    (8 requests on 4 slots: they share steps, and a request waits for a free slot) and every answer
    is compared with its reference. No prompt is reused from a slot or RAM (``cache_prompt=False``,
    no prompt cache): every run reads every prompt in full.
    ``batch_schedules`` counts the distinct step sequences (prompt and generated tokens per step)
    among the batched runs: how many different batch shapes the runs went through.
    """
    t0 = time.perf_counter()
    alone, again, batched, schedules = greedy_answers(cfg)
    return GreedyDrift(
        runs=cfg.greedy_runs,
        slots=GREEDY_SLOTS,
        max_tokens=cfg.greedy_tokens,
        reviews=[review_drift(review, alone[i], [run[i] for run in batched]) for i, review in enumerate(REVIEWS)],
        runs_with_difference=sum(any(run[i] != alone[i] for i in range(len(REVIEWS))) for run in batched),
        alone_twice_identical=again == alone,
        alone_twice_differed=sum(a != b for a, b in zip(alone, again, strict=True)),
        batch_schedules=schedules,
        seconds=time.perf_counter() - t0,
    )


def greedy_answers(cfg: Config) -> tuple[list[str], list[str], list[list[str]], int]:
    """The reviews' answers alone, alone again, and in each batched run; and the batched runs' distinct batch schedules."""
    from llmkit.engine import Engine, EngineConfig, RequestParams

    params = RequestParams.of(temperature=0, max_tokens=cfg.greedy_tokens, cache_prompt=False)
    config = EngineConfig(n_parallel=GREEDY_SLOTS, n_ctx=GREEDY_SLOTS * cfg.ctx_per_slot, n_threads=cfg.threads, cache_ram_mib=0)
    engine = Engine(cfg.model, config)
    starts: list[float] = []  # when each batched run was submitted: its steps are the ones recorded from then until the next
    with engine:
        prompts = [engine.model.tokenize_chat([{"role": "user", "content": QUESTION + review}]) for review in REVIEWS]

        def answer(batch: list[list[int]]) -> list[str]:
            requests = [engine.submit(p, params) for p in batch]  # tokenized already: submitted together
            return [r.result() for r in requests]

        alone = [answer([p])[0] for p in prompts]
        again = [answer([p])[0] for p in prompts]
        batched: list[list[str]] = []
        for _ in tqdm(range(cfg.greedy_runs), desc="greedy drift", unit="run", leave=False):
            starts.append(time.perf_counter())
            batched.append(answer(prompts))
    steps = list(engine.steps)  # closed: the engine thread has recorded its last step (it keeps the last 10,000)
    ends = [*starts[1:], float("inf")]
    schedules = {tuple((s.n_prompt, s.n_generated) for s in steps if a <= s.t < b) for a, b in zip(starts, ends, strict=True)}
    return alone, again, batched, len(schedules)


def review_drift(review: str, alone: str, batched: list[str]) -> ReviewDrift:
    """One review's answer alone against its answers in the batched runs."""
    differing = [answer for answer in batched if answer != alone]
    return ReviewDrift(
        review=review,
        differed=len(differing),
        alone=alone,
        batched_differing=sorted(set(differing)),
        same_chars_before_difference=min((same_start(answer, alone) for answer in differing), default=None),
    )
