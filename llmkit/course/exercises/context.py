"""The names a chapter's cells define before its exercises, that its answer and solution cells may use unimported.

A learner writes an answer cell in the notebook, where the chapter's earlier cells ran (``MODEL``, ``choose_slot``,
``tr``); a grading run and the tests run the answer cell alone. Both give it these names, those it uses and does not
define itself: the same objects, or values equal to the chapter's.

Each name maps to a function that gives it: either the value itself (plain data: a grading run sends it into the
cage) or an ``Elsewhere``, an object the process that runs the answer imports or makes itself (a class, the model).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Elsewhere:
    """``module``'s ``attribute`` (``call``: called with no arguments), made where the answer runs."""

    module: str
    attribute: str = ""
    call: bool = False

    def make(self) -> Any:
        found: Any = importlib.import_module(self.module)
        for part in filter(None, self.attribute.split(".")):
            found = getattr(found, part)
        return found() if self.call else found


MODEL = Elsewhere("llmkit.course.exercises.lab", "LAB.model", call=True)
COMMON: dict[str, Callable[[], Any]] = {
    "tr": lambda: Elsewhere("llmkit.course", "tr"),
    "math": lambda: Elsewhere("math"),
    "httpx": lambda: Elsewhere("httpx"),
    "openai": lambda: Elsewhere("openai"),
    "Request": lambda: Elsewhere("fastapi", "Request"),
    "Translator": lambda: Elsewhere("llmkit.sequential.translator", "Translator"),
    "Engine": lambda: Elsewhere("llmkit.engine", "Engine"),
    "EngineConfig": lambda: Elsewhere("llmkit.engine", "EngineConfig"),
    "build_batch": lambda: Elsewhere("llmkit.engine.scheduler", "build_batch"),
    "streamed_for": lambda: 5.0,  # chapter 1's measured stream length, seconds (a typical value)
}


def chapter_names(chapter: int) -> dict[str, Callable[[], Any]]:
    """Chapter ``chapter``'s earlier names: name -> what gives it (called only for the names an answer uses)."""
    from llmkit.course.exercises import ch04, ch05, ch06, ch08, ch09, ch10  # the chapters' own data (in the grader: never in a cage)

    if chapter == 10:
        return {"model": lambda: MODEL, "PAIR": lambda: ch10.PAIR}
    if chapter == 5:
        engine = {"Slot": "slot", "common_prefix": "slot", "RequestParams": "request", "MIB": "prompt_cache", "choose_slot": "policy"}
        return {
            **{name: functools.partial(Elsewhere, f"llmkit.engine.{module}", name) for name, module in engine.items()},
            "MODEL": lambda: MODEL, "tr": COMMON["tr"], "chat_history": lambda: Elsewhere("llmkit.course.exercises.ch05", "chat_history"),
            "ORIGINAL": lambda: ch05.chat_history("My name is Ana and I live in a small house by the sea."),
            "EDITS": lambda: {"shortened": ch05.chat_history("My name is Ana.")},
        }  # fmt: skip
    questions = {4: ch04.QUESTIONS, 8: ch08.QUESTIONS}.get(chapter, ch04.QUESTIONS)
    speculation = {"model": lambda: MODEL, "COPY": lambda: ch09.copy_of("text.py")} if chapter == 9 else {}  # 9.1 measures COPY
    return {**COMMON, "QUESTIONS": lambda: list(questions), "SCHEMA": lambda: ch06.SCHEMA, "WEATHER": lambda: ch06.WEATHER, **speculation}


def made(value: Any) -> Any:
    return value.make() if isinstance(value, Elsewhere) else value


def names_for(chapter: int, wanted: set[str] | None = None) -> dict[str, Any]:
    """The chapter's earlier names (only ``wanted`` ones, if given), each made here (the tests; a notebook's kernel)."""
    return {name: made(give()) for name, give in chapter_names(chapter).items() if wanted is None or name in wanted}
