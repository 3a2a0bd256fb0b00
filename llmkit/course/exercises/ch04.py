"""Chapter 4 (concurrency): a chunked prompt's steps, more requests than slots, a long prompt alone, your own prompt order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast
from unittest import mock

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, metric, quiet_engine
from llmkit.engine.job import Job
from llmkit.engine.request import Request, Status
from llmkit.engine.scheduler import Chunk, build_batch
from llmkit.engine.slot import Slot
from llmkit.text import Detokenizer, StopMatcher

CHAPTER = Chapter(4)


def busy_slot(slot_id: int, status: Status, n_prompt: int, *, n_ctx: int = 1024) -> Slot:
    """A slot running a request with an ``n_prompt``-token prompt: reading it (``Status.PROMPT``) or generating."""
    slot, request = Slot(slot_id, n_ctx), Request(list(range(100 + 1000 * slot_id, 100 + 1000 * slot_id + n_prompt)))
    request.status = status
    n_done = n_prompt if status is Status.GENERATING else 0
    slot.job = Job(request, slot, cast(Any, None), Detokenizer(bytes), StopMatcher(), n_done)  # no sampler: nothing samples here
    if status is Status.GENERATING:
        slot.cache_tokens, slot.job.last_token = list(request.prompt), 7
    return slot


def commit(plan: list[Chunk]) -> None:
    """What ``Engine.commit`` does once the decode has succeeded."""
    for chunk in plan:
        chunk.job.slot.cache_tokens.extend(chunk.tokens)
        chunk.job.n_prompt_done += len(chunk.tokens) if chunk.is_prompt else 0


def prompt_steps(n_streams: int, budget: int = 64, n_prompt: int = 300) -> list[int]:
    """The prompt tokens of each step until a newcomer's prompt is read, beside ``n_streams`` generating slots."""
    slots = [busy_slot(i, Status.GENERATING, 5) for i in range(n_streams)] + [busy_slot(n_streams, Status.PROMPT, n_prompt)]
    newcomer, steps = slots[-1].job, []
    assert newcomer is not None
    while newcomer.n_prompt_done < n_prompt:
        plan = build_batch(slots, 512, budget)
        commit(plan)
        steps.append(sum(len(chunk.tokens) for chunk in plan if chunk.is_prompt))
    return steps


@CHAPTER.exercise(1, answers=("steps_beside_two", "steps_alone"), compares=(LIVE,), writes="the prompt tokens of each step (two lists)")
def q1(steps_beside_two, steps_alone) -> str:
    measured = {"steps_beside_two": prompt_steps(2), "steps_alone": prompt_steps(0)}
    for name, answer in (("steps_beside_two", steps_beside_two), ("steps_alone", steps_alone)):
        steps = expect.whole_numbers(name, answer)
        if sum(steps) != 300:
            raise Wrong(tr("{name} adds up to {n} prompt tokens: the prompt has 300", name=name, n=sum(steps)))
        expect.same_list(name, steps, measured[name])
    return tr("build_batch planned {n} steps beside two streams and {m} alone, as you said", n=len(measured["steps_beside_two"]),
              m=len(measured["steps_alone"]))  # fmt: skip


QUESTIONS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Give three tips for learning a language.",
             "Describe a busy market.", "Name three rivers in Europe.", "What is a prime number?"]  # fmt: skip


def six_on_two() -> tuple[int, int]:
    """An engine with 2 slots, 6 requests of 8 tokens at once: (the most slots in one step, requests started after the first ended)."""
    from llmkit.engine import Engine, EngineConfig

    with Engine(LAB.model(), EngineConfig(n_parallel=2, n_ctx=1024, n_threads=1)) as engine:
        six = [engine.chat([{"role": "user", "content": q}], max_tokens=8, ignore_eos=True, temperature=0, cache_prompt=False)
               for q in QUESTIONS]  # fmt: skip
        for r in six:
            r.result()
        widest = max(s.n_slots for s in engine.steps)
    first_end = min(r.t_first + r.timings.predicted_ms / 1e3 for r in six)
    return widest, sum(r.t_start > first_end for r in six)


@CHAPTER.exercise(2, answers=("widest", "waited"), compares=(LIVE,), writes="two counts: slots in the widest step, requests that waited")
def q2(widest, waited) -> str:
    measured = LAB.memo("ch4-six-on-two", six_on_two)
    expect.whole_number("widest", widest)
    expect.whole_number("waited", waited)
    expect.same("widest", widest, measured[0])
    expect.same("waited", waited, measured[1])
    return tr("an engine with 2 slots served 6 requests: at most {widest} a step, {waited} waited for a slot", widest=measured[0],
              waited=measured[1])  # fmt: skip


SERVER_NAMES = ("llama-server -b 2048", "llama-server -b 128", "slot server")
LONE_FLAGS = {"llama-server -b 2048": ("llama-server", ()), "llama-server -b 128": ("llama-server", ("-b", "128", "-ub", "128")),
              "slot server": ("slots", ())}  # fmt: skip


def lone_decodes() -> dict[str, tuple[int, int]]:
    """Each server: (llama_decode calls, prompt tokens) for one prompt of about 1,400 tokens, alone, one token asked."""
    from llmkit.course.bench import long_text

    measured = {}
    for name, (kind, flags) in LONE_FLAGS.items():
        server = LAB.server(kind, "-np", "1", "-c", "2048", "-t", "1", "--metrics", *flags)
        before = metric(server.url, "n_decode_total")
        body = {"messages": [{"role": "user", "content": long_text(None, 1400, f"Check {name}")}], "max_tokens": 1,
                "temperature": 0, "cache_prompt": False}  # fmt: skip
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).json()
        measured[name] = (round(metric(server.url, "n_decode_total") - before), answer["usage"]["prompt_tokens"])
    return measured


@CHAPTER.exercise(3, answers=("decodes_alone",), compares=(LIVE,), writes="llama_decode calls per server for a long prompt alone (a dict)")
def q3(decodes_alone) -> str:
    expect.mapping("decodes_alone", decodes_alone, SERVER_NAMES)
    for name in SERVER_NAMES:
        expect.whole_number(f"decodes_alone[{name!r}]", decodes_alone[name])
    measured = LAB.memo("ch4-lone-decodes", lone_decodes)
    for name in SERVER_NAMES:
        n_decodes, n_prompt = measured[name]
        if name == "llama-server -b 128":  # the prompt is "about 1,400 tokens": a few more or less can move one decode
            expect.near(f"decodes_alone[{name!r}]", decodes_alone[name], n_decodes, 1,
                        tr("the prompt's exact length in tokens, {n}, is known only once it is tokenized", n=n_prompt))  # fmt: skip
        else:
            expect.same(f"decodes_alone[{name!r}]", decodes_alone[name], n_decodes)
    shown = ", ".join(f"{name}: {n}" for name, (n, _) in measured.items())
    return tr("measured on the three servers just now: {decodes}", decodes=shown)


# --- exercise 4: your own prompt order --------------------------------------------------------------------------


def reference_order(slots: list[Slot], capacity: int, budget: int = 0) -> list[Chunk]:
    """The reference: ``build_batch``'s plan, its prompts taken fewest tokens left first (ties: the oldest request)."""
    plan = [chunk for chunk in build_batch(slots, capacity, budget) if not chunk.is_prompt]  # the streams, as llmkit's
    n_tokens = sum(len(chunk.tokens) for chunk in plan)
    n_drafted = n_tokens - len(plan)
    limit = min(budget + n_drafted if budget else capacity, capacity) if plan else capacity
    prompts = [s.job for s in slots if s.job is not None and s.job.request.status is Status.PROMPT]
    for job in sorted(prompts, key=lambda job: (len(job.prompt_left), job.request.id)):
        room = limit - n_tokens
        if room <= 0:
            break
        tokens = job.prompt_left[:room]
        last = job.n_prompt_done + len(tokens) == len(job.request.prompt)
        n_tokens += len(tokens)
        plan.append(Chunk(job, tokens, job.slot.n_past, n_tokens - 1 if last else -1, True))
    return plan


def layout(streams: int, prompts: list[int], done: list[int] | None = None) -> list[Slot]:
    """Slots: ``streams`` generating, then one reading each prompt (``done``: tokens of it already read)."""
    slots = [busy_slot(i, Status.GENERATING, 5) for i in range(streams)]
    for k, n in enumerate(prompts):
        slot = busy_slot(streams + k, Status.PROMPT, n)
        if done and done[k]:
            assert slot.job is not None
            slot.job.n_prompt_done = done[k]
            slot.cache_tokens = list(slot.job.request.prompt[: done[k]])
        slots.append(slot)
    return slots


# (what the case is, the slots, capacity, budget): none of them is in the notebook
CASES: list[tuple[str, Callable[[], list[Slot]], int, int]] = [
    ("two prompts, the shorter second, no stream, no budget", lambda: layout(0, [300, 40]), 512, 0),
    ("two prompts beside one stream, budget 64", lambda: layout(1, [200, 30]), 512, 64),
    ("three prompts beside two streams, budget 32", lambda: layout(2, [90, 10, 50]), 512, 32),
    ("a prompt half read is now the shorter one, budget 64", lambda: layout(1, [100, 80], done=[60, 0]), 512, 64),
    ("equal lengths: the older request first, budget 16", lambda: layout(1, [40, 40]), 512, 16),
    ("a batch smaller than the prompts, no stream", lambda: layout(0, [700, 600]), 256, 0),
]


def plan_of(plan: list[Chunk]) -> list[tuple[int, int, int, int, bool]]:
    return [(c.job.slot.id, len(c.tokens), c.pos, c.i_logits, c.is_prompt) for c in plan]


def steps_until_read(rule: Callable[..., list[Chunk]], make: Callable[[], list[Slot]], capacity: int, budget: int, case: str) -> list:
    """Every step's plan, committed, until every prompt is read (the rule is the learner's: their errors are theirs)."""
    slots, plans = make(), list[list[tuple[int, int, int, int, bool]]]()
    while any(s.job is not None and s.job.request.status is Status.PROMPT and s.job.prompt_left for s in slots) and len(plans) < 100:
        plan = call(rule, slots, capacity, budget, case=case)
        if not isinstance(plan, list) or not all(isinstance(c, Chunk) for c in plan):
            raise Wrong(tr("{case}: the plan should be a list of Chunk, not {got}", case=case, got=expect.shown(plan)))
        plans.append(plan_of(plan))
        commit(plan)
        for slot in slots:
            if slot.job is not None and not slot.job.prompt_left:
                slot.job.request.status = Status.GENERATING  # read: it generates from the next step on
    return plans


@contextmanager
def prompt_order(rule: Callable[..., list[Chunk]]) -> Iterator[None]:
    """The engine plans its steps with ``rule`` while the block runs (``Engine.update_slots`` calls ``build_batch``)."""
    with mock.patch("llmkit.engine.engine.build_batch", rule):
        yield


def first_token_steps(rule: Callable[..., list[Chunk]], guard: Guard | None = None) -> list[int]:
    """In a real engine stepped by hand, a stream running: a 300-token prompt arrives, then two of 20 at once. The step
    (counted from their arrival) of each newcomer's first token."""
    from llmkit.engine import Engine, EngineConfig
    from llmkit.engine.request import RequestParams

    config = EngineConfig(n_parallel=4, n_ctx=4 * 512, n_threads=1, step_tokens=64, cache_ram_mib=0)
    with quiet_engine(), prompt_order(rule), Engine(LAB.model(), config, start=False) as engine:
        tokenize = engine.model.tokenize
        stream = engine.submit(tokenize("Once upon a time"), RequestParams.of(max_tokens=40, ignore_eos=True, temperature=0))
        for _ in range(20):
            if stream.output or stream.done:
                break
            engine.step()
        texts = ["Ship logs: " + "the tide came in and went out again. " * 40, "Name a colour.", "Name a river."]
        params = RequestParams.of(max_tokens=2, ignore_eos=True, temperature=0)
        newcomers = [engine.submit(tokenize(text)[: 300 if i == 0 else 20], params) for i, text in enumerate(texts)]
        firsts, step = [0, 0, 0], 0
        while not all(r.done for r in newcomers) and step < 100:
            engine.step()
            step += 1
            firsts = [first or (step if r.output or r.done else 0) for first, r in zip(firsts, newcomers, strict=True)]
        stream.cancel()
        engine.step()  # the stream leaves its slot
        if guard is not None:
            guard.raise_first()
        failed = [r.error for r in newcomers if r.error is not None]
        if failed:
            raise Wrong(tr("in the engine, a request failed with your plans: {error}", error=failed[0]))
    return firsts


@CHAPTER.exercise(
    4, answers=("shortest_first",), compares=(HIDDEN, ENGINE), writes="build_batch with the shortest prompt first (a function)"
)
def q4(shortest_first) -> str:
    rule = expect.function("shortest_first", shortest_first, 3)
    for case, make, capacity, budget in CASES:
        yours = steps_until_read(rule, make, capacity, budget, case)
        expected = steps_until_read(reference_order, make, capacity, budget, case)
        for k, (a, b) in enumerate(zip(yours, expected, strict=False), 1):
            if a != b:
                raise Wrong(tr("{case}: step {k} differs (slot, tokens, position, logits row, prompt?): yours {yours}",
                               case=case, k=k, yours=a))  # fmt: skip
        if len(yours) != len(expected):
            raise Wrong(tr("{case}: your plans read the prompts in {n} steps, a different number", case=case, n=len(yours)))
    guard = Guard(tr("in the engine"))
    yours = first_token_steps(guard.wrap(rule), guard)
    reference, oldest_first = LAB.memo("ch4-first-tokens", lambda: (first_token_steps(reference_order), first_token_steps(build_batch)))
    if yours != reference:
        raise Wrong(tr("in the engine, the first tokens came at steps {yours}: not those of the shortest-first rule", yours=yours))
    return tr("in a real engine the two short prompts got their first token at steps {short} (oldest first: {oldest}), "
              "the long one at step {long} (oldest first: {long_oldest})", short=yours[1:], oldest=oldest_first[1:], long=yours[0],
              long_oldest=oldest_first[0])  # fmt: skip
