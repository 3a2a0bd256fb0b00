"""An answer cell as the grader sees it: the statements that define its answers, the names it uses, its values as data.

A grading run never trusts the process that ran a submission: what comes out of it is data. A value (a number, a
string, a list, a dict, ``None``, ``...``) crosses as JSON (``encode``, ``decode``: plain types only, nothing that
runs on the way in); code (a function, a class, anything else) crosses as the cell's source, and the judge's process
runs only the statements that define the answers (``slice_for``: the ``def``, ``class``, imports and assignments the
answer needs, in turn): a top-level line that patches the kit, kills a process or writes a file is not among them.
"""

from __future__ import annotations

import ast
import builtins
from typing import Any

PLAIN = (type(None), bool, int, float, str)
DEPTH = 20


class NotData(Exception):
    """The value holds something other than plain data (a function, a class, an object of the learner's)."""


def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-able data, with tuples, dicts of any plain keys and ``...`` kept apart (exact types only)."""
    if depth > DEPTH:
        raise NotData("nested too deep")
    if value is Ellipsis:
        return {"ellipsis": True}
    if type(value) in PLAIN:
        return value
    if type(value) is list:
        return [encode(v, depth + 1) for v in value]
    if type(value) is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if type(value) is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise NotData(type(value).__name__)


def decode(data: Any) -> Any:
    """``encode``'s inverse; anything else (a hostile file) raises ``ValueError``."""
    if type(data) in PLAIN:
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        (tag, inner), = data.items()  # fmt: skip
        if tag == "ellipsis" and inner is True:
            return ...
        if tag == "tuple" and type(inner) is list:
            return tuple(decode(v) for v in inner)
        if tag == "dict" and type(inner) is list and all(type(p) is list and len(p) == 2 for p in inner):
            return {decode(k): decode(v) for k, v in inner}
    raise ValueError(f"not an encoded answer: {str(data)[:80]}")


# --- the statements that define the answers -------------------------------------------------------------------------


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


def used(stmt: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(stmt) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def slice_for(code: str, names: tuple[str, ...] | list[str]) -> str:
    """The statements of ``code`` that define ``names``, and those that define what they use, in their order."""
    body = ast.parse(code).body
    needed, kept = set(names), []
    for stmt in reversed(body):
        if defined(stmt) & needed:
            kept.append(stmt)
            needed |= used(stmt)
    return ast.unparse(ast.Module(body=list(reversed(kept)), type_ignores=[]))


def free_names(code: str) -> set[str]:
    """The names ``code`` uses and never binds (not builtins): what it takes from the notebook's earlier cells."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    bound = {n for stmt in tree.body for n in defined(stmt)}
    bound |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    bound |= {a.arg for node in ast.walk(tree) if isinstance(node, ast.arguments) for a in [*node.args, *node.kwonlyargs]}
    return used(tree) - bound - set(dir(builtins))
