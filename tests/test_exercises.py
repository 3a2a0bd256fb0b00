"""Exercises that answer back, model-free: the pattern (a verdict, never the answer), hints and solutions read from a
notebook, progress kept across restarts, the student edition, and the checks that need no model (on the hidden
solution, a plausible wrong answer and an empty answer cell).

The checks that measure with the model or a server are tests/test_exercise_checks.py's; grading a class's notebooks
in fresh kernels is tests/test_classroom.py's.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import ClassVar

import nbformat
import pytest

from llmkit.course import exercises
from llmkit.course.exercises import ch04, ch05, ch07, ch08, ch09, done, notebook
from llmkit.course.exercises.classroom import student_edition
from llmkit.course.exercises.core import ENGINE, LLAMA, SERVER, Exercise, Wrong, extra_chapter, unanswered
from llmkit.course.exercises.verdict import ERROR, FAIL, PASS, UNANSWERED, VERDICT_KEY
from llmkit.engine.policy import LlamaServerPolicy, choose_slot
from llmkit.engine.prompt_cache import choose_entry
from llmkit.text import StopMatcher

import wrong_answers as wrong
from exercise_demo import demo_notebook
from solutions import NOTEBOOKS, answers_of


@pytest.fixture(autouse=True)
def progress_file(tmp_path, monkeypatch):
    """Every test records its progress in a file of its own, never the user's."""
    path = tmp_path / "progress.json"
    monkeypatch.setenv(done.ENV, str(path))
    return path


@pytest.fixture
def demo():
    with extra_chapter(99, "exercise_demo"):
        yield exercises.chapter(99)


# --- the registry --------------------------------------------------------------------------------------------------


def test_every_chapter_has_three_exercises_and_one_whose_code_runs_in_the_engine_or_against_a_server():
    for ch in exercises.chapters():
        assert len(ch) >= 3, f"chapter {ch.number} has {len(ch)} exercises"
        assert [ex.number for ex in ch] == list(range(1, len(ch) + 1))
        assert any({ENGINE, SERVER, LLAMA} & set(ex.compares) and ex.learner_writes for ex in ch), f"chapter {ch.number}"
    assert sum(len(ch) for ch in exercises.chapters()) >= 36


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_every_exercise_is_in_its_notebook_with_hints_an_answer_cell_a_check_and_its_solution(lang):
    """The notebook is the exercise's one source: its statement and hints (closed), its answer cell (the template: not
    answered yet as it comes), the one line that checks it, and the hidden solution the tests run."""
    for ch in exercises.chapters():
        cells = notebook.cells(notebook.chapter_notebook(ch.number, NOTEBOOKS / lang))
        loaders = [c for c in cells if notebook.SECTION in notebook.tags(c)]
        assert len(loaders) == 1 and f"exercises.chapter({ch.number})" in notebook.source(loaders[0]), f"{lang} chapter {ch.number}"
        for ex in ch:
            where = f"{lang} exercise {ch.number}.{ex.number}"
            part = notebook.exercise_cells(cells, ex.number)
            markdown = "\n".join(notebook.source(c) for c in part if c["cell_type"] == "markdown")
            assert notebook.DETAILS.findall(markdown), f"{where}: no hint"
            by_tag = {tag: [c for c in part if tag in notebook.tags(c)] for tag in (notebook.ANSWER, notebook.CHECK, notebook.SOLUTION)}
            assert [len(found) for found in by_tag.values()] == [1, 1, 1], where
            assert notebook.source(by_tag[notebook.CHECK][0]) == f"ex.{ex.name}.check({', '.join(ex.answers)})", where
            assert by_tag[notebook.SOLUTION][0]["metadata"]["jupyter"]["source_hidden"], f"{where}: the solution is not hidden"
            namespace: dict = {"__name__": "__main__"}  # as in a notebook's kernel
            exec(notebook.source(by_tag[notebook.ANSWER][0]), namespace)  # the template, as it comes
            assert ex.verdict(*(namespace[name] for name in ex.answers)).status == UNANSWERED, where


# --- not answered yet ------------------------------------------------------------------------------------------------


def stub(x):
    """The answer cell's template."""


def passing(x):
    pass


class StubClass:
    def __init__(self, n): ...

    def push(self, text):
        """Your code."""


@dataclass(frozen=True)
class StubPolicy(LlamaServerPolicy):
    name: ClassVar[str] = "stub"

    def order(self, waiting, slots): ...


class RealClass:
    def push(self, text):
        return text


def keeps_what_the_slot_holds(entries, held, prompt):
    """None is an answer here (5.4, 7.5): said, not left as the template."""
    return None


def test_an_answer_is_not_given_while_it_is_the_templates_ellipsis():
    for value in (
        ...,
        stub,
        passing,
        StubClass,
        StubClass.__new__(StubClass),
        lambda x: None,
        StubPolicy,
        {"a": ..., "b": ...},
        [..., ...],
    ):
        assert unanswered(value), value
    for value in (
        0,
        None,
        False,
        [],
        "",
        {},
        {"a": ..., "b": True},
        RealClass,
        RealClass(),
        lambda x: x,
        len,
        StopMatcher,
        LlamaServerPolicy,
        keeps_what_the_slot_holds,
    ):
        assert not unanswered(value), value


def test_a_check_stops_code_that_loops_forever_with_a_verdict(demo):
    def double(x):
        while True:  # swallows what it can: the time limit is no Exception
            with contextlib.suppress(Exception):
                time.sleep(0.05)

    demo.q2.timeout = 0.5
    try:
        verdict = demo.q2.verdict(double)
    finally:
        demo.q2.timeout = Exercise.timeout
    assert verdict.status == ERROR and "loop forever" in verdict.message, verdict


def test_an_empty_answer_is_not_answered_yet_and_records_nothing(demo, progress_file, capsys):
    verdict = demo.q1.verdict(...)
    assert verdict.status == UNANSWERED and "answer" in verdict.message and not verdict
    demo.q1.check(...)  # what the check cell does: shown (printed outside a notebook), nothing recorded
    assert "not answered yet" in capsys.readouterr().out
    assert not progress_file.exists()


def test_a_verdict_shows_in_a_notebook_and_carries_its_status_for_a_grader(demo):
    bundle, metadata = demo.q1.verdict(42)._repr_mimebundle_()
    assert metadata[VERDICT_KEY] == {"chapter": 99, "number": 1, "status": PASS, "message": "six times seven"}
    assert "✓" in bundle["text/plain"] and "llmkit-pass" in bundle["text/html"]


def test_a_wrong_answer_says_what_differs_not_the_answer(demo):
    verdict = demo.q1.verdict(41)
    assert verdict.status == FAIL and "too low" in verdict.message and "42" not in verdict.message
    assert "ex.q1.hint()" in verdict.message  # where the next step is
    kind = demo.q1.verdict("forty-two")
    assert kind.status == FAIL and "whole number" in kind.message and "str" in kind.message
    assert demo.q2.verdict(lambda x: x + x + 1).status == FAIL
    assert demo.q1.verdict(1, 2).status == FAIL and "takes 1 answers" in demo.q1.verdict(1, 2).message


def learners_double(x):
    return {}[x]  # the learner's own bug


def test_a_crash_in_the_learners_code_is_shown_as_theirs(demo):
    verdict = demo.q2.verdict(learners_double)
    assert verdict.status == ERROR and verdict.theirs and "double(0)" in verdict.message and "KeyError" in verdict.message
    assert "learners_double" in verdict.detail and "return {}[x]" in verdict.detail  # their frame, their line
    assert "core.py" not in verdict.detail and "exercise_demo.py" not in verdict.detail  # not the kit's


def test_a_check_that_cannot_run_does_not_blame_the_answer(demo, monkeypatch):
    def broken(answer):
        raise ConnectionError("the server did not start")

    monkeypatch.setattr(demo.q1, "judge", broken)
    verdict = demo.q1.verdict(42)
    assert verdict.status == ERROR and not verdict.theirs and "not your answer" in verdict.message


# --- hints and solutions, read from the notebook ------------------------------------------------------------------------


def test_hints_come_one_at_a_time_and_the_solution_from_the_notebook(demo, tmp_path, monkeypatch):
    nbformat.write(demo_notebook(), tmp_path / "99_demo.ipynb")
    monkeypatch.chdir(tmp_path)
    shown = [str(notebook.next_hint(demo.q1)) for _ in range(3)]
    assert shown == ["Hint 1 of 2\nMultiply.", "Hint 2 of 2\nSix sevens.", "Hint 2 of 2\nSix sevens."]
    assert str(notebook.next_hint(demo.q2)) == "Hint 1 of 1\ntwice `x`."  # a notebook's *Hint:* paragraph
    solution = notebook.solution_view(demo.q1)
    assert solution.body == "answer = 6 * 7\nprint(answer)" and "answer" in solution._repr_mimebundle_()["text/html"]
    nbformat.write(nbformat.read(tmp_path / "99_demo.ipynb", 4), tmp_path / "elsewhere.ipynb")
    student_edition(tmp_path / "student", tmp_path.parent, editions=(tmp_path.name,))
    monkeypatch.chdir(tmp_path / "student" / tmp_path.name)
    assert "no solutions" in str(notebook.solution_view(demo.q1))  # a student edition has none to show
    assert str(notebook.next_hint(demo.q2)).startswith("Hint 1 of 1")  # but its hints


def test_no_hint_or_solution_without_the_chapters_notebook(demo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "not in this folder" in str(notebook.next_hint(demo.q1)) and "not in this folder" in str(notebook.solution_view(demo.q1))


# --- progress ----------------------------------------------------------------------------------------------------------


def test_progress_is_kept_across_restarts_and_done_stays_done(demo, progress_file):
    demo.q2.check(lambda x: 2 * x)
    demo.q1.check(40)
    saved = json.loads(progress_file.read_text())
    assert saved["99"]["2"]["done"] and saved["99"]["2"]["status"] == PASS and not saved["99"]["1"]["done"]
    demo.q2.check(lambda x: 3 * x)  # a later failed try: the exercise stays done
    assert done.status_of(done.load(), 99, 2) == (FAIL, True)
    assert done.summary([demo]) == [(99, 1, 2, "✗✓")]
    view = demo.progress()
    bundle = view._repr_mimebundle_()
    assert "1 of 2" in bundle["text/plain"] and "q1" in bundle["text/html"] and "q2" in view.widget.value
    demo.q1.check(42)
    assert "2 of 2" in view.widget.value  # a widget on show redraws when a check records


def test_progress_of_every_chapter_as_a_table():
    text = done.text(exercises.chapters())
    assert "0 of" in text and all(f"\n{n:>7}" in text for n in range(1, 10))


# --- the student edition -----------------------------------------------------------------------------------------------


def test_the_student_edition_has_no_solutions_in_either_language(tmp_path):
    written = student_edition(tmp_path)
    assert {p.parent.name for p in written} == {"en", "ja"} and (tmp_path / "ja" / "locale" / "exercises.po").exists()
    for path in written:
        original = nbformat.read(NOTEBOOKS / path.parent.name / path.name, 4)
        student = nbformat.read(path, 4)
        tags = [set(c.metadata.get("tags", [])) for c in student.cells]
        assert not any("solution" in t for t in tags), path
        kept = [c.source for c in original.cells if "solution" not in c.metadata.get("tags", [])]
        assert [c.source for c in student.cells] == kept  # everything else, answer cells as they come
        assert all(not c.outputs for c, t in zip(student.cells, tags, strict=True) if {"answer", "check"} & t)
        assert student.metadata["llmkit"]["edition"] == "student"


# --- the checks that need no model: the hidden solution, a wrong answer, an empty one -------------------------------


def verdicts(ex, solution, wrong, forbidden):
    """The solution passes; the wrong answer fails, and its message names none of ``forbidden``; empty: not answered."""
    assert ex.verdict(*solution).status == PASS, ex.verdict(*solution)
    verdict = ex.verdict(*wrong)
    assert verdict.status == FAIL, verdict
    assert not [f for f in forbidden if f in verdict.message], verdict.message
    assert ex.verdict(*[...] * len(ex.answers)).status == UNANSWERED
    return verdict


def test_chapter_4_exercise_1_the_steps_of_a_chunked_prompt():
    ex = exercises.chapter(4).q1
    solution = answers_of(ex, {"build_batch": ch04.build_batch, "tr": str.format})
    verdicts(ex, solution, ([64, 64, 64, 64, 44], [300]), ["62", "52"])  # the streams' two tokens forgotten
    assert ex.verdict([62, 62, 62, 62, 52], [64, 64, 64, 64, 44]).status == FAIL  # the budget applied with no stream
    assert "adds up to 290" in ex.verdict([62, 62, 62, 62, 42], [300]).message


def test_chapter_4_exercise_4_a_policy_without_the_methods_the_engine_calls_is_told_which():
    class Duck:  # orders right, but is no LlamaServerPolicy: the engine would call choose_slot and victim too
        def order(self, waiting, slots):
            return sorted(waiting, key=lambda r: r.params.max_tokens if r.params.max_tokens >= 0 else float("inf"))

        def prompt_order(self, reading):
            return list(reading)

    verdict = exercises.chapter(4).q4.verdict(Duck)
    assert verdict.status == FAIL and "choose_slot" in verdict.message and "LlamaServerPolicy" in verdict.message


def test_chapter_5_exercise_1_the_smallest_shared_prefix():
    ex = exercises.chapter(5).q1
    solution = answers_of(ex, {"choose_slot": choose_slot, "Slot": ch05.Slot, "RequestParams": ch05.RequestParams})
    verdict = verdicts(ex, solution, (lambda n: n // 10,), ["11"])  # ">= 10 %" where llama-server says "> 10 %"
    assert "100-token" in verdict.message and "too few" in verdict.message


def test_chapter_9_exercise_3_what_a_step_keeps_after_an_end_of_generation():
    ex = exercises.chapter(9).q3

    def llmkits_rule(draft, sampled, is_eog):  # stops at any end of generation: where llama-server differs
        kept = []
        for k, token in enumerate(sampled):
            kept.append(token)
            if k == len(draft) or token != draft[k] or is_eog(token):
                return kept
        return kept

    verdict = verdicts(ex, answers_of(ex, {}), (llmkits_rule,), ["[5, 6, 2, 8]"])
    assert "last token" in verdict.message and "too few" in verdict.message


def test_the_hidden_cases_of_the_code_checks_that_plug_into_the_engine():
    """Their model-free half (the engine's half: tests/test_exercise_checks.py): the kit's reference passes its own
    cases, and a plausible wrong answer fails with what differs."""
    ch04.check_policy(ch04.ReferenceFewTokensFirst())
    with pytest.raises(Wrong, match="no limit"):
        ch04.check_policy(wrong.NoLimitFirst())  # max_tokens -1 sorted as the smallest
    ch05.check_rule(choose_entry)  # the engine's own rule, which the hidden cases are judged by
    with pytest.raises(Wrong, match="under a quarter"):
        ch05.check_rule(wrong.prompt_cache_without_the_quarter)
    ch07.check_slots(ch07.reference_slot)
    with pytest.raises(Wrong, match="never used: yours takes slot 0"):
        ch07.check_slots(choose_slot)  # llmkit's rule: the first idle slot on a tie, where llama-server takes the last
    ch08.check_matcher(StopMatcher)
    with pytest.raises(Wrong, match="split over three pieces"):
        ch08.check_matcher(wrong.ReleasesAtOnce)
    with pytest.raises(Wrong, match="the stream stalls"):
        ch08.check_matcher(wrong.NeverStreams)  # the right text in the end, all of it at the stop or the flush (the learner's D15)
    ch09.check_drafts(ch09.ReferenceLookup)
    with pytest.raises(Wrong, match="two matches: the later one"):
        ch09.check_drafts(wrong.LookupInEverything)
