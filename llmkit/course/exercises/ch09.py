"""Chapter 9 (speculative decoding): the n-gram's size, a request's draft limit, a draft after an end of generation,
your own drafter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.course import tr
from llmkit.course.exercises import expect
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, SOURCE, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, quiet_engine, wait

CHAPTER = Chapter(9)
SOURCE_DIR = Path(__file__).resolve().parents[2]  # llmkit's own files: text to copy


def copy_of(name: str) -> str:
    """A file's first 30 lines, a blank line, then its first 8 lines again (the chapter's COPY, of another file)."""
    lines = (SOURCE_DIR / name).read_text().splitlines(keepends=True)
    return "".join(lines[:30]) + "\n\n" + "".join(lines[:8])


def speculating(drafter: Any = None, **params: Any) -> Any:
    """An engine that speculates with ngram-simple (its ``params``: the longest draft, the window), drafting with
    ``drafter`` if given (EngineConfig's seam), else with ngram-simple's own."""
    from llmkit.engine import Engine, EngineConfig
    from llmkit.engine.speculative import SpecParams, SpecType

    speculative = SpecParams(SpecType.NGRAM_SIMPLE, **params)
    return Engine(LAB.model(), EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, speculative=speculative, drafter=drafter))


# --- exercise 1: the size of the n-gram ----------------------------------------------------------------------------


def drafted_by_size() -> dict[int, tuple[int, int]]:
    """size_n -> (tokens drafted, accepted) on the chapter's COPY prompt, 96 tokens, greedy."""
    from llmkit.engine.speculative import NgramSimple

    out = {}
    for size_n in (12, 2):
        with speculating(NgramSimple(size_n, 48)) as engine:
            r = engine.complete(copy_of("text.py"), max_tokens=96, temperature=0, ignore_eos=True)
            r.result()
            assert r.outcome is not None
            out[size_n] = (r.outcome.timings.draft_n, r.outcome.timings.draft_n_accepted)
    return out


@CHAPTER.exercise(1, answers=("accepted_share",), compares=(LIVE, ENGINE), writes="a measurement (a dict: size_n -> a share)")
def q1(accepted_share) -> str:
    answer = expect.mapping("accepted_share", accepted_share)
    if set(answer) != {12, 2}:
        raise Wrong(tr("accepted_share should have exactly the keys 12 and 2 (the two size_n), not {got}", got=sorted(answer, key=repr)))
    measured = LAB.memo("ch9-size-n", drafted_by_size)
    share = {n: (a / d if d else 0.0) for n, (d, a) in measured.items()}
    for n in (12, 2):  # greedy, one slot, the chapter's prompt: the same drafts every run, up to the machine's arithmetic
        expect.near(
            f"accepted_share[{n}]",
            expect.number(f"accepted_share[{n}]", answer[n]),
            share[n],
            0.05,
            tr("the same prompt and engine as the chapter's, greedy: only a rare near tie can move it"),
        )
    return tr("on the COPY prompt just now: size_n 12 drafted {d12} tokens ({s12:.0%} accepted), size_n 2 drafted {d2} ({s2:.0%})",
              d12=measured[12][0], s12=share[12], d2=measured[2][0], s2=share[2])  # fmt: skip


# --- exercise 2: a request that drafts at most 4 tokens ---------------------------------------------------------------


def steps_by_limit() -> dict[int | None, tuple[int, int]]:
    """n_draft_max -> (steps for 48 tokens, longest draft), the prompt already cached."""
    prompt, out = copy_of("text.py"), {}
    with speculating() as engine:
        engine.complete(prompt, max_tokens=1, temperature=0).result()
        for limit in (4, None):
            engine.steps.clear()
            options = {} if limit is None else {"n_draft_max": limit}
            engine.complete(prompt, max_tokens=48, temperature=0, ignore_eos=True, **options).result()
            out[limit] = (len(engine.steps), max(share.n_draft for step in engine.steps for share in step.batch))
    return out


@CHAPTER.exercise(2, answers=("longest_draft", "more_steps"), compares=(LIVE, ENGINE), writes="two predictions: a number, True or False")
def q2(longest_draft, more_steps) -> str:
    expect.whole_number("longest_draft", longest_draft)
    expect.truth("more_steps", more_steps)
    measured = LAB.memo("ch9-limit", steps_by_limit)
    expect.same("longest_draft", longest_draft, measured[4][1])
    expect.same("more_steps", more_steps, measured[4][0] > measured[None][0])
    return tr("48 tokens of the COPY prompt: {steps4} steps with n_draft_max 4, {steps} with the engine's drafts "
              "(the longest {longest})", steps4=measured[4][0], steps=measured[None][0], longest=measured[None][1])  # fmt: skip


# --- exercise 3: a draft after an end of generation -------------------------------------------------------------------

EOG = 2  # an end-of-generation token, in these cases


def reference_kept(draft: list[int], sampled: list[int], is_eog: Callable[[int], bool]) -> list[int]:
    """common_sampler_sample_and_accept_n (common/sampling.cpp), line by line: the tokens a step keeps."""
    result = []
    for i, token in enumerate(draft):
        result.append(sampled[i])
        if token != sampled[i] or (is_eog(sampled[i]) and i + 1 < len(draft)):
            return result
    return [*result, sampled[len(draft)]]


KEPT_CASES = [
    ("no draft", [], [5]),
    ("a draft accepted whole", [5, 6, 7], [5, 6, 7, 8]),
    ("a draft rejected at once", [5, 6, 7], [9, 6, 7, 8]),
    ("a draft rejected at its second token", [5, 6, 7], [5, 9, 7, 8]),
    ("an end of generation in the middle of the draft", [5, EOG, 7], [5, EOG, 7, 8]),
    ("an end of generation as the draft's last token", [5, 6, EOG], [5, 6, EOG, 8]),
    ("the model ends where the draft goes on", [5, 6, 7], [5, EOG, 7, 8]),
    ("a draft of one token, an end of generation", [EOG], [EOG, 4]),
]


@CHAPTER.exercise(3, answers=("kept",), compares=(SOURCE, HIDDEN), writes="kept(draft, sampled, is_eog): llama-server's rule (a function)")
def q3(kept) -> str:
    fn = expect.function("kept", kept, 3)
    for case, draft, sampled in KEPT_CASES:
        yours = call(fn, list(draft), list(sampled), lambda t: t == EOG, case=case)
        if not isinstance(yours, list) or not all(expect.is_int(t) for t in yours):
            raise Wrong(tr("{case}: expected a list of tokens; got {got}", case=case, got=expect.shown(yours)))
        expected = reference_kept(draft, sampled, lambda t: t == EOG)
        if yours != expected:
            side = tr("too many") if len(yours) > len(expected) else tr("too few") if len(yours) < len(expected) else tr("different ones")
            raise Wrong(tr("{case}: yours keeps {yours}: {side}", case=case, yours=yours, side=side))
    return tr("the tokens llama-server's common_sampler_sample_and_accept_n keeps, in all {n} cases", n=len(KEPT_CASES))


# --- exercise 4: a drafter of your own -------------------------------------------------------------------------------


class ReferenceLookup:
    """Prompt lookup (as in vLLM and transformers): the last ``n`` tokens looked up in the request's prompt only, the
    latest match whose continuation is in the prompt; the tokens after it, up to ``n_max``."""

    def __init__(self, n: int = 3):
        self.n, self.prompts = n, dict[int, list[int]]()

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.prompts[seq] = list(prompt)

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        prompt, pattern = self.prompts.get(seq, []), [*tokens, last][-self.n :]
        for start in range(len(prompt) - len(pattern) - 1, -1, -1):
            if prompt[start : start + len(pattern)] == pattern:
                end = start + len(pattern)
                return prompt[end : end + n_max]
        return []

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        pass


# (what the case is, n, the prompt, the tokens so far, the last token, n_max): none of them in the notebook
DRAFT_CASES = [
    ("the last three tokens once in the prompt", 3, [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3], 4, 3),
    ("no match", 3, [1, 2, 3, 4], [1, 2, 3, 4, 9, 9], 9, 5),
    ("two matches: the later one", 2, [7, 1, 2, 8, 1, 2, 9, 6], [7, 1, 2, 8, 1, 2, 9, 6, 5, 1], 2, 3),
    ("the match at the prompt's very end: nothing follows", 2, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 4], 5, 4),
    ("n_max cuts the draft", 1, [3, 1, 2, 3, 4, 5, 6], [3, 1, 2, 3, 4, 5, 6, 0, 0], 3, 2),
    ("a longer n", 4, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7], [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1, 2, 3], 4, 8),
]


def check_drafts(cls: type) -> None:
    for case, n, prompt, tokens, last, n_max in DRAFT_CASES:
        drafter = call(cls, n, case=case)
        call(drafter.begin, 0, list(prompt), case=case)
        yours = call(drafter.draft, 0, list(tokens), last, n_max, case=case)
        expected = ReferenceLookup(n)
        expected.begin(0, prompt)
        if not isinstance(yours, list) or not all(expect.is_int(t) for t in yours):
            raise Wrong(tr("{case}: a draft is a list of tokens; yours is {got}", case=case, got=expect.shown(yours)))
        if len(yours) > n_max:
            raise Wrong(tr("{case}: your draft has {n} tokens, more than n_max", case=case, n=len(yours)))
        if yours != expected.draft(0, tokens, last, n_max):
            raise Wrong(tr("{case}: your draft is {yours}: not the tokens prompt lookup proposes", case=case, yours=yours))


class Watched:
    """A learner's drafter in the engine: its methods report their first error to ``guard``; drafts over ``n_max`` noted."""

    def __init__(self, inner: Any, guard: Guard):
        self.inner, self.guard, self.too_long = inner, guard, 0

    def begin(self, seq: int, prompt: list[int]) -> None:
        self.guard.wrap(self.inner.begin)(seq, prompt)

    def draft(self, seq: int, tokens: list[int], last: int, n_max: int) -> list[int]:
        drafted = list(self.guard.wrap(self.inner.draft)(seq, list(tokens), last, n_max))
        self.too_long += len(drafted) > n_max
        return drafted[:n_max]

    def accept(self, seq: int, n_drafted: int, n_accepted: int) -> None:
        self.guard.wrap(self.inner.accept)(seq, n_drafted, n_accepted)


def engine_drafts(drafter: Any) -> tuple[int, int, str]:
    """A copy prompt the notebook never used, greedy, 64 tokens, in a real engine with ``drafter``: drafted, accepted, the text."""
    with quiet_engine(), speculating(drafter) as engine:
        r = engine.complete(copy_of("engine/slot.py"), max_tokens=64, temperature=0, ignore_eos=True)
        wait(r)
        timings = r.outcome.timings if r.outcome is not None else None
        return (timings.draft_n, timings.draft_n_accepted, r.text) if timings is not None else (0, 0, r.text)


@CHAPTER.exercise(4, answers=("PromptLookup",), compares=(HIDDEN, ENGINE), writes="a drafter (a class), in the engine")
def q4(PromptLookup) -> str:
    cls = expect.klass("PromptLookup", PromptLookup)
    check_drafts(cls)
    guard = Guard(tr("in the engine"))
    watched = Watched(call(cls, 3, case=tr("in the engine")), guard)
    drafted, accepted, _ = engine_drafts(watched)
    guard.raise_first()
    if watched.too_long:
        raise Wrong(tr("in the engine, {n} of your drafts were longer than the n_max the engine asked for", n=watched.too_long))
    if not accepted:
        raise Wrong(tr("in the engine, on a prompt made to be copied, no token of your drafts was accepted ({n} drafted)", n=drafted))
    return tr("in a real engine, on a copy prompt the notebook never used: {drafted} tokens drafted, {accepted} accepted ({share:.0%})",
              drafted=drafted, accepted=accepted, share=accepted / drafted)  # fmt: skip
