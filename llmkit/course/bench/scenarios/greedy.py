"""Greedy drift: are the same greedy answers alike alone and batched (in-process, one KV stream per slot)?"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from llmkit.course.bench.config import GREEDY_SLOTS, Config
from llmkit.course.bench.prompts import QUESTION, REVIEWS
from llmkit.course.bench.scenario import Scenario, Stage
from llmkit.course.bench.targets import Target, info


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


# --- in a bench run: the scenario (``llmkit.course.bench.scenario``) --------------------


def run(cfg: Config, stage: Stage) -> GreedyDrift:
    return greedy_drift(cfg)


def table(g: GreedyDrift) -> str:
    """Per review: how many batched runs changed its greedy answer; then any review, and the alone-twice control."""
    lines = ["| review | batched runs whose answer differed from alone |", "|---|---|"]
    for r in g.reviews:
        text = r.review if len(r.review) <= 40 else r.review[:39] + "…"
        lines.append(f"| {text} | {r.differed} of {g.runs} |")
    lines.append(f"| any of the {len(g.reviews)} | {g.runs_with_difference} of {g.runs} |")
    return "\n".join(lines) + (
        f"\n\nControl, each review answered alone twice: {control(g)}. "
        f"The {g.runs} batched runs went through {g.batch_schedules} distinct batch schedule"
        f"{'s' * (g.batch_schedules != 1)} (tokens per step). {g.seconds:.0f} s in all."
    )


def section(g: GreedyDrift, cfg: Config) -> str:
    return (
        "## Greedy answers alone vs batched\n\n"
        f"Chapter 6's {len(g.reviews)} reviews, unconstrained, temperature 0, at most {g.max_tokens} tokens, on an "
        f"in-process Engine with {g.slots} slots of one KV stream each: every review answered alone, then "
        f"{g.runs} times all {len(g.reviews)} at once.\n\n" + table(g)
    )


def control(g: GreedyDrift) -> str:
    """The control: each review answered alone twice, identical or how many answers differed."""
    return "identical" if g.alone_twice_identical else f"{g.alone_twice_differed} of {len(g.reviews)} answers differed"


def targets(g: GreedyDrift | None, cfg: Config) -> list[Target]:
    """Information, not a target: where two tokens are nearly tied, a batch's shape can tip a greedy choice."""
    if g is None:
        return []
    name = f"greedy answers alone vs batched, {len(g.reviews)} requests on {g.slots} slots, one KV stream each"
    return [info(name, f"{g.runs_with_difference} of {g.runs} batched runs changed at least one answer; alone twice: {control(g)}")]


SCENARIO = Scenario("greedy", run, section, targets, wanted=lambda cfg: cfg.greedy_runs > 0)
