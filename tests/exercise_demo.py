"""A tiny chapter of exercises (number 99) for the tests of the exercise machinery: no model, no server.

Exercise 1: a value (``answer``, six times seven); exercise 2: code (``double(x)``, run on cases it has not seen).
"""

from __future__ import annotations

from llmkit.course.exercises import expect
from llmkit.course.exercises.core import HIDDEN, LIVE, Chapter, Wrong, call

CHAPTER = Chapter(99)


@CHAPTER.exercise(1, answers=("answer",), compares=(LIVE,), writes="a number")
def q1(answer) -> str:
    expect.same("answer", expect.whole_number("answer", answer), 6 * 7)
    return "six times seven"


def reference_double(x: int) -> int:
    """The reference answer (as the chapters keep theirs): a graded answer may not use it."""
    return 2 * x


@CHAPTER.exercise(2, answers=("double",), compares=(HIDDEN,), writes="a function")
def q2(double) -> str:
    fn = expect.function("double", double, 1)
    for x in (0, 3, -2, 10**6):
        if call(fn, x, case=f"double({x})") != reference_double(x):
            raise Wrong(f"double({x}) is not twice {x}")
    return "twice every number"


def demo_notebook(answer: str = "answer = ...", double: str = "def double(x):\n    ..."):
    """Chapter 99 as a notebook: each exercise's markdown (two hints for the first), answer cell, check cell, hidden solution."""
    import nbformat

    v4 = nbformat.v4
    hidden = {"jupyter": {"source_hidden": True}}
    return v4.new_notebook(
        cells=[
            v4.new_markdown_cell("# 99. A tiny chapter\n\n## Exercises"),
            v4.new_code_cell("from llmkit.course import exercises\n\nex = exercises.chapter(99)", metadata={"tags": ["exercises"]}),
            v4.new_markdown_cell(
                "**Exercise 1 — six times seven.** What is it?\n\n"
                "<details><summary>Hint 1</summary>\n\nMultiply.\n\n</details>\n\n"
                "<details><summary>Hint 2</summary>\n\nSix sevens.\n\n</details>"
            ),
            v4.new_code_cell(answer, metadata={"tags": ["answer"]}),
            v4.new_code_cell("ex.q1.check(answer)", metadata={"tags": ["check"]}),
            v4.new_code_cell("answer = 6 * 7\nprint(answer)", metadata={"tags": ["solution"], **hidden}),
            v4.new_markdown_cell("**Exercise 2 — double.** Write `double(x)`.\n\n*Hint:* twice `x`."),
            v4.new_code_cell(double, metadata={"tags": ["answer"]}),
            v4.new_code_cell("ex.q2.check(double)", metadata={"tags": ["check"]}),
            v4.new_code_cell("def double(x):\n    return 2 * x", metadata={"tags": ["solution"], **hidden}),
        ]
    )
