"""Plug-ins given by name on the command line: a built-in one's name, or ``package.module:Name`` for your own (any
importable module: your package, or a file on ``PYTHONPATH``). Each fills a seam of ``EngineConfig`` (``PLUG_INS``).

    llmkit serve slots --scheduling-policy mypolicies:RoundRobin --drafter mydrafts:PromptLookup
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def find(spec: str, builtins: Mapping[str, Any], kind: str) -> Any:
    """What ``spec`` names (``ValueError`` says why nothing): a built-in by name, else ``module:Name``'s object."""
    if spec in builtins:
        return builtins[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"unknown {kind} {spec!r}: one of {', '.join(builtins) or 'none built in'}, or package.module:Name")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{kind} {spec!r} cannot be loaded: {exc}") from exc
