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


@CHAPTER.exercise(2, answers=("double",), compares=(HIDDEN,), writes="a function")
def q2(double) -> str:
    fn = expect.function("double", double, 1)
    for x in (0, 3, -2, 10**6):
        if call(fn, x, case=f"double({x})") != 2 * x:
            raise Wrong(f"double({x}) is not twice {x}")
    return "twice every number"
