"""The pattern every exercise follows: answers in, a ``Verdict`` out, never the right answer in a message.

An exercise (``Exercise``) knows the names of its answers (what the answer cell defines) and a *judge*: a function
that takes them, measures or runs what it needs, and either returns a short note (the answer is right) or raises

- ``Wrong``: the answer differs; the message says where (which answer, which case, what kind of value was expected,
  what came back), never what the right value is;
- ``TheirError``: the learner's own code raised; the verdict shows their traceback, not the kit's frames.

``Exercise.verdict`` turns that into a ``Verdict`` (pass, fail, not answered, error); ``check`` shows it and records
it in the learner's progress. An answer still ``...`` (the answer cell as it comes), or a function or class whose
body is only ``...``, is *not answered yet*: the check says so and fails nothing, so a notebook runs from top to bottom
with its answer cells empty (nbval).
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import importlib
import inspect
import json
import signal
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmkit.course import tr
from llmkit.course.exercises import done, notebook
from llmkit.course.exercises.verdict import ERROR, FAIL, PASS, UNANSWERED, Verdict

# What a check compares the answer with (the closing table of each exercise, README's list)
LIVE = "value measured live"  # a prediction or a value, against what the kit measures on this machine now
HIDDEN = "code on hidden cases"  # the learner's code, called on cases it has not seen
ENGINE = "code in the engine"  # the learner's code, plugged into a real Engine
SERVER = "code against a server"  # the learner's code, served or sent to a real server (ours)
LLAMA = "code against llama-server"  # the learner's code, judged by what the real llama-server does
SOURCE = "llama-server's source"  # a reading of the C++, against the C++ itself
KINDS = (LIVE, HIDDEN, ENGINE, SERVER, LLAMA, SOURCE)

KIT = Path(__file__).resolve().parents[2]  # llmkit: the frames above the learner's first one (a check, the engine) are the kit's


class Wrong(Exception):
    """The answer differs from what the kit measured or expected; the message says where, not what is right."""


class TheirError(Exception):
    """The learner's code raised ``error`` on ``case``: shown with their traceback."""

    def __init__(self, case: str, error: BaseException):
        super().__init__(case)
        self.case, self.error = case, error


def their_traceback(error: BaseException) -> str:
    """``error``'s traceback from the learner's first frame on: the kit's frames above it (the check, the engine that
    called their code) are left out; llmkit's frames under it (code their code called) stay."""
    tb = error.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(KIT):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb if tb is not None else error.__traceback__))


def call(fn: Callable[..., Any], *args: Any, case: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, the learner's code: an exception in it becomes a ``TheirError`` for ``case``."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- whatever their code raises is their error, shown as theirs
        raise TheirError(case, exc) from None


class Guard:
    """The learner's code where the kit's code calls it (an engine's slot chooser, a drafter): the first exception
    it raises is kept, and ``raise_first()`` raises it as their error once the kit's code has returned."""

    def __init__(self, case: str):
        self.case = case
        self.error: BaseException | None = None

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                self.error = self.error or exc
                raise

        return guarded

    def raise_first(self) -> None:
        if self.error is not None:
            raise TheirError(self.case, self.error)


class TimeLimit(BaseException):
    """A check ran over its time limit (a BaseException: the learner's ``except Exception`` does not swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeLimit`` in the block after ``seconds`` (SIGALRM: the main thread only; elsewhere no limit). An alarm
    already set (pytest-timeout's) is kept: it goes off first if it is sooner, else it is set again afterwards."""
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or 0 < outer <= seconds:
        yield
        return

    def overran(*_: Any) -> None:
        raise TimeLimit(seconds)

    previous, started = signal.signal(signal.SIGALRM, overran), time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))


# --- not answered yet --------------------------------------------------------------------------------------------


def is_stub(fn: Any) -> bool:
    """A function whose body does nothing (``...``, ``pass``, a docstring): the answer cell's template. A body that
    says ``return None`` is an answer (None means something in some exercises): read from its source where it has one."""
    if not inspect.isfunction(fn):
        return False
    with suppress(OSError, TypeError, SyntaxError, IndexError):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        if isinstance(tree, ast.FunctionDef | ast.AsyncFunctionDef):
            return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in tree.body)
    ops = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def unanswered(value: Any) -> bool:
    """``...``; a stub function; a class (or an instance of one) whose own methods are all stubs; a dict, list or tuple
    of nothing but ``...`` (the answer cell's template: ``intact = {"events_of": ..., "sse_parse": ...}``)."""
    if value is Ellipsis or is_stub(value):
        return True
    if isinstance(value, dict | list | tuple) and value:
        return all(v is Ellipsis for v in (value.values() if isinstance(value, dict) else value))
    cls = value if inspect.isclass(value) else type(value)
    if cls.__module__ in ("builtins", "llmkit") or cls.__module__.startswith(("llmkit.", "httpx", "openai")):
        return False
    # the methods written in the class (not a dataclass's generated __init__, __eq__, ...)
    generated = dataclasses.is_dataclass(cls)
    own = [v for k, v in vars(cls).items() if inspect.isfunction(v) and not (generated and k.startswith("__"))]
    return bool(own) and all(is_stub(f) for f in own)


# --- showing it ----------------------------------------------------------------------------------------------------


def show(obj: Any) -> None:
    """Display ``obj`` in a notebook (its rich form), or print it outside one."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with the lab extra
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


# --- an exercise and a chapter ------------------------------------------------------------------------------------

Judge = Callable[..., str]


@dataclass
class Exercise:
    """One exercise: ``check(*answers)``, ``hint()`` one at a time, ``solution()`` read from the notebook."""

    chapter: int
    number: int
    answers: tuple[str, ...]  # the names the answer cell defines, in the order check() takes them
    compares: tuple[str, ...]  # what the check compares with (KINDS)
    judge: Judge
    learner_writes: str = ""  # what the learner writes, for the list of exercises (README, report)
    hints_shown: int = field(default=0, repr=False)
    timeout: float = 600  # seconds a check may run (its servers started on a busy machine, then the learner's code)

    @property
    def name(self) -> str:
        return f"q{self.number}"

    def verdict(self, *answers: Any) -> Verdict:
        """The verdict on ``answers`` (nothing shown, nothing recorded): what ``check`` shows, what tests read."""
        if len(answers) != len(self.answers):
            message = tr(
                "check() takes {n} answers ({names}), not {got}", n=len(self.answers), names=", ".join(self.answers), got=len(answers)
            )
            return Verdict(self.chapter, self.number, FAIL, message)
        missing = [name for name, answer in zip(self.answers, answers, strict=True) if unanswered(answer)]
        if missing:
            message = tr("replace the ... in {names} with your answer", names=", ".join(missing))
            return Verdict(self.chapter, self.number, UNANSWERED, message + self.hint_pointer())
        try:
            with time_limit(self.timeout):
                note = self.judge(*answers)
        except TimeLimit:
            message = tr("the check stopped after {seconds:.0f} s: does your code loop forever?", seconds=self.timeout)
            return Verdict(self.chapter, self.number, ERROR, message)
        except KeyboardInterrupt:
            return Verdict(self.chapter, self.number, ERROR, tr("the check was interrupted before it could decide"))
        except Wrong as wrong:
            return Verdict(self.chapter, self.number, FAIL, str(wrong) + self.hint_pointer())
        except TheirError as theirs:
            message = tr("{case}: {error}", case=theirs.case, error=f"{type(theirs.error).__name__}: {theirs.error}")
            return Verdict(self.chapter, self.number, ERROR, message, their_traceback(theirs.error))
        except Exception as exc:  # noqa: BLE001 -- the check itself broke (a server that did not start): say so, never blame the answer
            message = tr("the check itself failed, not your answer: {error}", error=f"{type(exc).__name__}: {exc}")
            return Verdict(self.chapter, self.number, ERROR, message, traceback.format_exc(), theirs=False)
        return Verdict(self.chapter, self.number, PASS, note)

    def hint_pointer(self) -> str:
        return tr(" ({call} gives a hint)", call=f"ex.{self.name}.hint()")  # the space before it is the language's own

    def check(self, *answers: Any) -> None:
        """Check ``answers`` (the names the answer cell defines), show the verdict, and record it in your progress."""
        verdict = self.verdict(*answers)
        done.record(verdict)
        show(verdict)

    def hint(self) -> None:
        """Show the next hint (the exercise's hints in the notebook, one more each call; then the last again)."""
        show(notebook.next_hint(self))

    def solution(self) -> None:
        """Show the solution: the code of the hidden cell under the exercise, read from the notebook."""
        show(notebook.solution_view(self))


@dataclass
class Chapter:
    """A chapter's exercises, ``q1``, ``q2``, ... (``ex = exercises.chapter(4)``; ``ex.q1.check(...)``)."""

    number: int
    exercises: dict[int, Exercise] = field(default_factory=dict)

    def exercise(self, number: int, *, answers: tuple[str, ...], compares: tuple[str, ...], writes: str) -> Callable[[Judge], Judge]:
        """Decorator: ``judge`` is exercise ``number``'s check (its parameters: the answers, in order)."""

        def register(judge: Judge) -> Judge:
            assert set(compares) <= set(KINDS), compares
            assert number not in self.exercises, f"exercise {self.number}.{number} defined twice"
            assert tuple(inspect.signature(judge).parameters) == answers, f"{judge.__name__}: its parameters must be {answers}"
            self.exercises[number] = Exercise(self.number, number, answers, compares, judge, writes)
            return judge

        return register

    def __getattr__(self, name: str) -> Exercise:
        if name.startswith("q") and name[1:].isdigit() and int(name[1:]) in self.exercises:
            return self.exercises[int(name[1:])]
        raise AttributeError(f"chapter {self.number} has no exercise {name!r} (it has {', '.join(e.name for e in self)})")

    def __iter__(self) -> Iterator[Exercise]:
        return iter(sorted(self.exercises.values(), key=lambda e: e.number))

    def __len__(self) -> int:
        return len(self.exercises)

    def progress(self) -> done.ProgressView:
        """A widget: which of this chapter's exercises are done (updated as checks pass)."""
        return done.ProgressView([self], one=True)


CHAPTERS = tuple(range(1, 11))  # the chapters with exercises
EXTRA_MODULES: dict[int, str] = {}  # chapter -> module, for checks outside llmkit (a class's own, the tests' synthetic chapter)


def chapter(number: int) -> Chapter:
    """Chapter ``number``'s exercises (its module ``llmkit.course.exercises.chNN``, imported once)."""
    module = EXTRA_MODULES.get(number, f"llmkit.course.exercises.ch{number:02d}")
    found = importlib.import_module(module).CHAPTER
    assert isinstance(found, Chapter) and found.number == number, module
    return found


def chapters() -> list[Chapter]:
    return [chapter(n) for n in CHAPTERS]


def progress(number: int | None = None) -> done.ProgressView:
    """A widget: the exercises done, of chapter ``number`` or (``None``) of every chapter."""
    return chapter(number).progress() if number is not None else done.ProgressView(chapters())


@contextmanager
def extra_chapter(number: int, module: str) -> Iterator[None]:
    """Chapter ``number``'s checks from ``module`` while the block runs (tests, a class's own chapter)."""
    EXTRA_MODULES[number] = module
    try:
        yield
    finally:
        EXTRA_MODULES.pop(number, None)


def dumps(verdicts: list[Verdict]) -> str:
    return json.dumps([v.to_json() for v in verdicts])
