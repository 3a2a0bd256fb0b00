"""The hidden solution cells, as the tests run them through their checks.

A solution cell defines the names its exercise's answer cell defines (``error_message``, ``steps_alone``, ...), then
shows and asserts what the chapter claims. ``answers_of`` runs only what defines those names: the cell's imports and,
walking back from the end, each statement that assigns a name still needed (a ``def``, a ``class``, an assignment, a
``with`` block), and the names those use, in turn. What they use from the chapter's earlier cells comes from
``context``: a name missing there fails the test (the slice must stand on what the test gives it).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from llmkit.course.exercises.core import Exercise
from llmkit.course.exercises.notebook import solution_cell, source

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def defined(stmt: ast.stmt) -> set[str]:
    """The names a top-level statement binds (anywhere in it, but inside the functions and classes it defines)."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def used(stmt: ast.stmt) -> set[str]:
    return {node.id for node in ast.walk(stmt) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def slice_for(code: str, names: tuple[str, ...]) -> str:
    """The statements of ``code`` that define ``names``, and what they need, in their order."""
    body = ast.parse(code).body
    needed, kept = set(names), []
    for stmt in reversed(body):
        if isinstance(stmt, ast.Import | ast.ImportFrom) or defined(stmt) & needed:
            kept.append(stmt)
            needed |= used(stmt)
    missing = set(names) - {n for stmt in kept for n in defined(stmt)}
    assert not missing, f"the solution cell defines none of {sorted(missing)}"
    return ast.unparse(ast.Module(body=list(reversed(kept)), type_ignores=[]))


def answers_of(ex: Exercise, context: dict[str, Any], edition: str = "en") -> tuple:
    """The answers exercise ``ex``'s hidden solution cell defines, run in ``context`` (the chapter's earlier names)."""
    cell = solution_cell(ex.chapter, ex.number, NOTEBOOKS / edition)
    assert cell is not None, f"exercise {ex.chapter}.{ex.number} has no solution cell in notebooks/{edition}"
    namespace = dict(context)
    exec(compile(slice_for(source(cell), ex.answers), f"<solution {ex.chapter}.{ex.number}>", "exec"), namespace)
    return tuple(namespace[name] for name in ex.answers)
