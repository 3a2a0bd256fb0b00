"""The hidden solution cells, as the tests run them through their checks.

A solution cell defines the names its exercise's answer cell defines (``error_message``, ``steps_alone``, ...), then
shows and asserts what the chapter claims. ``answers_of`` runs only what defines those names (``answers.slice_for``,
as a grading run does): walking back from the end, each statement that binds a name still needed (an import, a
``def``, a ``class``, an assignment, a ``with`` block), and the names those use, in turn. What they use from the
chapter's earlier cells comes from ``context`` (``exercises.context``, as in a grading run): a name missing there
fails the test (the slice must stand on what the test gives it).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from llmkit.course.exercises.answers import defined, slice_for
from llmkit.course.exercises.core import Exercise
from llmkit.course.exercises.notebook import solution_cell, source

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def answers_of(ex: Exercise, context: dict[str, Any], edition: str = "en") -> tuple:
    """The answers exercise ``ex``'s hidden solution cell defines, run in ``context`` (the chapter's earlier names)."""
    cell = solution_cell(ex.chapter, ex.number, NOTEBOOKS / edition)
    assert cell is not None, f"exercise {ex.chapter}.{ex.number} has no solution cell in notebooks/{edition}"
    code = slice_for(source(cell), ex.answers)
    missing = set(ex.answers) - {n for stmt in ast.parse(code).body for n in defined(stmt)}
    assert not missing, f"the solution cell defines none of {sorted(missing)}"
    namespace = dict(context)
    exec(compile(code, f"<solution {ex.chapter}.{ex.number}>", "exec"), namespace)
    return tuple(namespace[name] for name in ex.answers)
