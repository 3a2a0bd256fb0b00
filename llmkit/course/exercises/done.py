"""Which exercises are done, per chapter, kept across kernel restarts: a JSON file in the per-user data folder.

    exercises.progress()          # a widget: every chapter (chapter 0)
    ex.progress()                 # a widget: this chapter's exercises (the top of its exercise section)
    llmkit exercises              # the same, in a terminal

The file is ``exercises.json`` in the data folder the kit keeps models in (platformdirs: ``~/.local/share/llmkit``
on Linux), or ``$LLMKIT_PROGRESS``. Each check's verdict is recorded (not "not answered yet"); an exercise is
*done* once it has passed, whatever later tries say. A widget shown in the notebook redraws when a check records.
The chapters it tells of are given to it (``core.chapters()``, a ``Chapter``): it reads their numbers and exercises.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import platformdirs

from llmkit.course import table, tr
from llmkit.course.exercises.verdict import ERROR, FAIL, MARKS, PASS, UNANSWERED, Verdict

ENV = "LLMKIT_PROGRESS"


class Exercise(Protocol):
    """An exercise as the progress reads it (``core.Exercise``)."""

    @property
    def number(self) -> int: ...

    @property
    def name(self) -> str: ...


class Chapter(Protocol):
    """A chapter as the progress reads it (``core.Chapter``): its number and its exercises."""

    @property
    def number(self) -> int: ...

    def __iter__(self) -> Iterator[Exercise]: ...

    def __len__(self) -> int: ...


def store_path() -> Path:
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else platformdirs.user_data_path("llmkit", appauthor=False) / "exercises.json"


def load() -> dict[str, dict[str, dict]]:
    """chapter -> exercise -> {"status": the last verdict, "done": passed once, "at": when}, as strings of numbers."""
    try:
        found = json.loads(store_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def save(data: dict) -> None:
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(f.name, path)  # whole or not at all: a kernel killed mid-write leaves the old file


def record(verdict: Verdict) -> None:
    """Keep ``verdict`` (but "not answered yet": nothing was tried), then redraw the widgets on show."""
    if verdict.status == UNANSWERED:
        return
    data = load()
    entry = data.setdefault(str(verdict.chapter), {}).setdefault(str(verdict.number), {})
    entry.update(status=verdict.status, done=bool(entry.get("done")) or verdict.passed, at=time.strftime("%Y-%m-%d %H:%M:%S"))
    save(data)
    for view in list(VIEWS):
        view.refresh()


def status_of(data: dict, chapter_number: int, number: int) -> tuple[str, bool]:
    """(the last status, done) of one exercise; never tried: not answered, not done."""
    entry = data.get(str(chapter_number), {}).get(str(number), {})
    return entry.get("status", UNANSWERED), bool(entry.get("done"))


def summary(chapters: Sequence[Chapter]) -> list[tuple[int, int, int, str]]:
    """(chapter, done, total, one mark per exercise) for each of ``chapters``."""
    data = load()
    rows = []
    for ch in chapters:
        states = [status_of(data, ch.number, ex.number) for ex in ch]
        marks = "".join(MARKS[PASS] if done else MARKS[status] if status in (FAIL, ERROR) else "·" for status, done in states)
        rows.append((ch.number, sum(done for _, done in states), len(ch), marks))
    return rows


def text(chapters: Sequence[Chapter]) -> str:
    """The progress of ``chapters``, as a table (``llmkit exercises``: every chapter)."""
    rows = summary(chapters)
    done, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = table([(n, f"{d}/{t}", marks) for n, d, t, marks in rows], headers=(tr("chapter"), tr("done"), tr("exercises")), align=">>")
    legend = tr("✓ done, ✗ tried and not passed yet, · not tried")
    line = tr("{done} of {total} exercises done ({legend}; {path})", done=done, total=total, legend=legend, path=store_path())
    return f"{lines}\n{line}"


CELL = 'style="padding:0.1em 0.6em; text-align:left"'


def chapter_html(ch: Chapter) -> str:
    """What a chapter's widget shows: each of its exercises, done or not."""
    data = load()
    marks = []
    for ex in ch:
        status, done = status_of(data, ch.number, ex.number)
        mark, colour = (MARKS[PASS], "#1e7b34") if done else (MARKS[status], "#b3261e") if status in (FAIL, ERROR) else ("·", "#5f6368")
        marks.append(f'<td {CELL}><span style="color:{colour}">{mark}</span> {ex.name}</td>')
    title = tr("Chapter {chapter}: {done} of {total} exercises done", chapter=ch.number, done=n_done(ch), total=len(ch))
    return f"<div><strong>{html.escape(title)}</strong><table><tr>{''.join(marks)}</tr></table></div>"


def course_html(chapters: Sequence[Chapter]) -> str:
    """What the course's widget shows: a line per chapter."""
    rows = "".join(
        f"<tr><td {CELL}>{n}</td><td {CELL}>{d}/{t}</td><td {CELL}>{html.escape(marks)}</td></tr>" for n, d, t, marks in summary(chapters)
    )
    head = f"<tr><th {CELL}>{tr('chapter')}</th><th {CELL}>{tr('done')}</th><th {CELL}>{tr('exercises')}</th></tr>"
    return f"<div><strong>{html.escape(tr('Your exercises'))}</strong><table>{head}{rows}</table></div>"


def n_done(ch: Chapter) -> int:
    data = load()
    return sum(status_of(data, ch.number, ex.number)[1] for ex in ch)


VIEWS: weakref.WeakSet[ProgressView] = weakref.WeakSet()


class ProgressView:
    """An ipywidgets ``HTML`` that shows the progress of one chapter (``one``: ``chapters`` is that chapter alone) or of
    every chapter, and redraws itself when a check records a verdict. Outside a live kernel (a book page, a saved
    notebook) its HTML is the same table."""

    def __init__(self, chapters: Sequence[Chapter], *, one: bool = False):
        import ipywidgets

        self.chapters, self.one = list(chapters), one
        self.widget = ipywidgets.HTML(self.html())
        VIEWS.add(self)

    def html(self) -> str:
        return chapter_html(self.chapters[0]) if self.one else course_html(self.chapters)

    def refresh(self) -> None:
        self.widget.value = self.html()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["text/html"] = self.widget.value  # the table itself where no widget manager runs (the book, nbconvert)
        if self.one:
            ch = self.chapters[0]
            bundle["text/plain"] = tr("{n} of {total} exercises done", n=n_done(ch), total=len(ch))
        else:
            bundle["text/plain"] = text(self.chapters)
        return bundle
