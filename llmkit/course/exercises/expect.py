"""What the judges say about an answer's kind and value: each raises ``Wrong`` with what differs, never the right value.

A kind first (``whole_number``, ``truth``, ``function`` ...: "steps should be a list of whole numbers, not str"),
then the value against what the kit measured: ``same`` (exact: a count, a yes or no), ``near`` (within a tolerance
whose reason the message gives), ``same_list`` (the first element that differs, and whether yours is too high or
too low there). What came back (the learner's own value) is shown; what was expected only in kind.
"""

from __future__ import annotations

import inspect
import math
import reprlib
from collections.abc import Sequence
from typing import Any

from llmkit.course import tr
from llmkit.course.exercises.core import Wrong

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 60, 60, 8, 6


def shown(value: Any) -> str:
    """The learner's value, short, with its type: ``str 'abc'``, ``list [1, 2]``."""
    return f"{type(value).__name__} {_short.repr(value)}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(name: str, value: Any) -> int:
    if not is_int(value):
        raise Wrong(tr("{name} should be a whole number, not {got}", name=name, got=shown(value)))
    return value


def number(name: str, value: Any) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)):
        raise Wrong(tr("{name} should be a number, not {got}", name=name, got=shown(value)))
    return float(value)


def truth(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise Wrong(tr("{name} should be True or False, not {got}", name=name, got=shown(value)))
    return value


def text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise Wrong(tr("{name} should be a string, not {got}", name=name, got=shown(value)))
    return value


def whole_numbers(name: str, value: Any) -> list[int]:
    if not (isinstance(value, list | tuple) and all(is_int(v) for v in value)):
        raise Wrong(tr("{name} should be a list of whole numbers, not {got}", name=name, got=shown(value)))
    return list(value)


def function(name: str, value: Any, n_args: int) -> Any:
    """A function (or any callable) that takes ``n_args`` positional arguments."""
    if not callable(value) or inspect.isclass(value):
        raise Wrong(tr("{name} should be a function, not {got}", name=name, got=shown(value)))
    try:
        inspect.signature(value).bind(*range(n_args))
    except TypeError:
        many = tr("{name} should take {n} arguments", name=name, n=n_args)
        raise Wrong(tr("{name} should take one argument", name=name) if n_args == 1 else many) from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    return value


def klass(name: str, value: Any, base: type | None = None) -> type:
    if not inspect.isclass(value):
        raise Wrong(tr("{name} should be a class, not {got}", name=name, got=shown(value)))
    if base is not None and not issubclass(value, base):
        raise Wrong(tr("{name} should be a subclass of {base}", name=name, base=base.__name__))
    return value


def mapping(name: str, value: Any, keys: Sequence[str] | None = None) -> dict:
    """A dict (with exactly ``keys``, if given)."""
    if not isinstance(value, dict):
        raise Wrong(tr("{name} should be a dict, not {got}", name=name, got=shown(value)))
    if keys is not None and set(value) != set(keys):
        raise Wrong(
            tr(
                "{name} should have exactly the keys {keys}, not {got}",
                name=name,
                keys=", ".join(map(repr, keys)),
                got=", ".join(map(repr, value)),
            )
        )
    return value


def same(name: str, value: Any, measured: Any, *, ordered: bool = True) -> None:
    """``value`` equals ``measured`` exactly; for quantities (``ordered``) the message says too high or too low."""
    if value == measured:
        return
    if ordered and ((is_int(value) and is_int(measured)) or (isinstance(value, float) and isinstance(measured, int | float))):
        side = tr("too high") if value > measured else tr("too low")
        raise Wrong(tr("{name} = {yours} is {side}: this machine measured something else just now", name=name, yours=value, side=side))
    raise Wrong(tr("{name} = {yours} is not what this machine measured just now", name=name, yours=_short.repr(value)))


def near(name: str, value: float, measured: float, tolerance: float, why: str) -> None:
    """``value`` within ``tolerance`` (an absolute amount) of ``measured``; ``why``: why the tolerance is that wide."""
    if abs(value - measured) <= tolerance:
        return
    side = tr("too high") if value > measured else tr("too low")
    raise Wrong(tr("{name} = {yours:g} is {side}, by more than the tolerance of ±{tolerance:g} ({why})",
                   name=name, yours=value, side=side, tolerance=tolerance, why=why))  # fmt: skip


def within(name: str, value: float, measured: float, share: float, why: str) -> None:
    """``value`` within ``share`` (0.1: 10 %) of ``measured``: the message gives the share, not the value it allows."""
    if abs(value - measured) <= share * abs(measured):
        return
    side = tr("too high") if value > measured else tr("too low")
    raise Wrong(
        tr("{name} = {yours:g} is {side}, by more than {share:.0%} ({why})", name=name, yours=value, side=side, share=share, why=why)
    )


def same_list(name: str, value: list, measured: list) -> None:
    """The lists are equal: else the first position where they differ (1-based), and how."""
    for i, (a, b) in enumerate(zip(value, measured, strict=False), 1):
        if a != b:
            side = tr("too high") if is_int(a) and is_int(b) and a > b else tr("too low") if is_int(a) and is_int(b) else tr("different")
            raise Wrong(tr("{name}: element {i} is {yours}, {side}", name=name, i=i, yours=a, side=side))
    if len(value) != len(measured):
        side = tr("too many") if len(value) > len(measured) else tr("too few")
        raise Wrong(tr("{name} has {n} elements: {side}", name=name, n=len(value), side=side))
