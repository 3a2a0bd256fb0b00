"""Plug-ins given by name on the command line: a built-in one's name, or ``package.module:Class`` for your own (any
importable module: your package, or a file on ``PYTHONPATH``), called with no arguments.

    llmkit serve slots --scheduling-policy mypolicies:RoundRobin
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def load(spec: str, builtins: Mapping[str, Callable[[], T]], kind: str) -> T:
    """The plug-in ``spec`` names (``ValueError`` says why not): a built-in by name, else ``module:Class``, made."""
    if spec in builtins:
        return builtins[spec]()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"unknown {kind} {spec!r}: one of {', '.join(builtins)}, or package.module:Class")
    try:
        made = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{kind} {spec!r} cannot be loaded: {exc}") from exc
    return made()
