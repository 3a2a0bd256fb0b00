"""Chapter 4 (concurrency): a chunked prompt's steps, more requests than slots, a long prompt alone, a policy of your own."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, metric, quiet_engine
from llmkit.engine import testing
from llmkit.engine.policy import LlamaServerPolicy, Running
from llmkit.engine.request import Request, RequestParams
from llmkit.engine.scheduler import Scheduler, build_batch
from llmkit.engine.slot import Slot

CHAPTER = Chapter(4)


def prompt_steps(n_streams: int, budget: int = 64, n_prompt: int = 300) -> list[int]:
    """The prompt tokens of each step until a newcomer's prompt is read, beside ``n_streams`` generating slots."""
    busy = testing.running(*(testing.generating(i) for i in range(n_streams)), testing.reading(n_streams, n_prompt))
    newcomer, steps = busy[-1].job, []
    while newcomer.n_prompt_done < n_prompt:
        plan = build_batch(busy, 512, budget)
        Scheduler.commit(plan)
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
    outcomes = [r.outcome for r in six if r.outcome is not None]
    first_end = min(o.t_end for o in outcomes)
    return widest, sum(o.t_start > first_end for o in outcomes)


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


# --- exercise 4: a policy of your own --------------------------------------------------------------------------------


def tokens_asked(request: Request) -> float:
    """The key of the reference: max_tokens, fewest first; no limit (-1) last."""
    return math.inf if request.params.max_tokens < 0 else request.params.max_tokens


@dataclass(frozen=True)
class ReferenceFewTokensFirst(LlamaServerPolicy):
    """The reference: requests asking for the fewest tokens first, in the queue and in a step; no limit last; ties: arrival."""

    name: ClassVar[str] = "few-tokens-first"

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return sorted(waiting, key=lambda r: (tokens_asked(r), r.id))

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return sorted(reading, key=lambda running: (tokens_asked(running.job.request), running.job.request.id))


def asking(*limits: int) -> list[Request]:
    """Requests in arrival order, each asking for ``limit`` tokens."""
    return [Request([1, 2, 3], RequestParams(max_tokens=limit)) for limit in limits]


def reading(*limits: int) -> list[Running]:
    """Jobs reading their prompts, in slot order, each asking for ``limit`` tokens."""
    return testing.running(*(testing.reading(i, 10 + 5 * i, max_tokens=limit) for i, limit in enumerate(limits)))


# (what the case is, what the requests ask for): none of them is in the notebook
ORDER_CASES = [
    ("four requests, the second asks least", (64, 4, 16, 32)),
    ("a tie: arrival decides", (8, 8, 2, 8)),
    ("no limit (-1) goes last", (-1, 16, 1)),
    ("one request", (5,)),
    ("none", ()),
]
PROMPT_CASES = [("three prompts, the last asks least", (30, 20, 10)), ("a tie and no limit", (-1, 5, 5)), ("one prompt", (7,))]


def check_policy(policy: Any) -> None:
    missing = [name for name in ("order", "prompt_order", "choose_slot", "victim") if not callable(getattr(policy, name, None))]
    if missing:  # the engine calls all four (GuardedPolicy): say so before it fails on one
        raise Wrong(tr("your policy has no {methods}, which the engine calls: subclass LlamaServerPolicy", methods=tr(", ").join(missing)))
    reference = ReferenceFewTokensFirst()
    for case, limits in ORDER_CASES:
        waiting = asking(*limits)
        yours = call(policy.order, list(waiting), [], case=case)
        if not isinstance(yours, list) or sorted(id(r) for r in yours) != sorted(id(r) for r in waiting):
            raise Wrong(tr("{case}: order should return the same requests, reordered; got {got}", case=case, got=expect.shown(yours)))
        position = {id(r): i for i, r in enumerate(waiting)}
        if [position[id(r)] for r in yours] != [position[id(r)] for r in reference.order(waiting, [])]:
            got = [r.params.max_tokens for r in yours]
            raise Wrong(tr("{case}: order gives the requests asking for {got} tokens, in that order: not fewest first", case=case, got=got))
    for case, limits in PROMPT_CASES:
        jobs = reading(*limits)
        yours = call(policy.prompt_order, list(jobs), case=case)
        if not isinstance(yours, list) or not all(isinstance(r, tuple) and len(r) == 2 for r in yours):
            raise Wrong(tr("{case}: prompt_order should return (slot, job) pairs; got {got}", case=case, got=expect.shown(yours)))
        if [slot.id for slot, _ in yours] != [slot.id for slot, _ in reference.prompt_order(jobs)]:
            got = [job.request.params.max_tokens for _, job in yours]
            raise Wrong(
                tr("{case}: prompt_order reads the prompts asking for {got} tokens, in that order: not fewest first", case=case, got=got)
            )


class GuardedPolicy:
    """The learner's policy where the engine calls it: its methods' first error is kept by ``guard``."""

    name: ClassVar[str] = "yours"

    def __init__(self, inner: Any, guard: Guard):
        self.inner, self.guard = inner, guard

    def order(self, waiting: Sequence[Request], slots: Sequence[Slot]) -> list[Request]:
        return list(self.guard.wrap(self.inner.order)(waiting, slots))

    def choose_slot(self, slots: Sequence[Slot], request: Request, tokens: list[int]) -> Slot | None:
        return self.guard.wrap(self.inner.choose_slot)(slots, request, tokens)

    def victim(self, slots: Sequence[Slot], request: Request) -> Slot | None:
        return self.guard.wrap(self.inner.victim)(slots, request)

    def prompt_order(self, reading: Sequence[Running]) -> list[Running]:
        return list(self.guard.wrap(self.inner.prompt_order)(reading))


LIMITS = (12, 2, 40, 6)  # what the four waiting requests ask for, in arrival order


def start_order(policy: Any, guard: Guard | None = None) -> list[int]:
    """A real engine with one slot, a stream on it; four requests wait (asking for LIMITS tokens): the order they got
    the slot in, as indexes into LIMITS."""
    from llmkit.engine import Engine, EngineConfig
    from llmkit.engine.request import Status

    config = EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=0, policy=policy)
    with quiet_engine(), Engine(LAB.model(), config, start=False) as engine:
        tokenize = engine.model.tokenize
        stream = engine.submit(tokenize("Once upon a time"), RequestParams.of(max_tokens=4, ignore_eos=True, temperature=0))
        engine.step()
        waiting = [engine.submit(tokenize(f"Question {i}: name a river."), RequestParams.of(max_tokens=n, ignore_eos=True, temperature=0))
                   for i, n in enumerate(LIMITS)]  # fmt: skip
        started: list[int] = []
        for _ in range(200):
            if all(r.done for r in [stream, *waiting]):
                break
            engine.step()
            if guard is not None:
                guard.raise_first()
            started += [i for i, r in enumerate(waiting) if r.status is not Status.WAITING and i not in started]
    return started


@CHAPTER.exercise(
    4, answers=("FewTokensFirst",), compares=(HIDDEN, ENGINE), writes="a scheduling policy (a class): fewest tokens asked first"
)
def q4(FewTokensFirst) -> str:
    cls = expect.klass("FewTokensFirst", FewTokensFirst)
    policy = call(cls, case=tr("making your policy"))
    check_policy(policy)
    guard = Guard(tr("in the engine"))
    yours = start_order(GuardedPolicy(policy, guard), guard)
    reference, fifo = LAB.memo("ch4-start-order", lambda: (start_order(ReferenceFewTokensFirst()), start_order(LlamaServerPolicy())))
    if yours != reference:
        raise Wrong(tr("in the engine, the waiting requests got the slot in the order {yours} (as the tokens they asked for): "
                       "not fewest first", yours=[LIMITS[i] for i in yours]))  # fmt: skip
    return tr("in a real engine with one slot, the waiting requests started in the order {yours} of the tokens they asked for "
              "(llama-server's policy: {fifo})", yours=[LIMITS[i] for i in yours], fifo=[LIMITS[i] for i in fifo])  # fmt: skip
