"""An exercise's cells, read from its chapter's notebook: the one source of its text, hints and solution.

The kernel's working directory is the notebook's folder (as for ``tr``), so chapter 4 is ``04_*.ipynb`` there, in
the reader's language. In it, exercise *N* starts at the markdown cell that names it (``**Exercise N — ...**``,
``**演習 N — ...**``) and runs up to the next exercise or heading. Its cells, by tag:

- ``answer``: the code cell the learner fills in (``...`` until then);
- ``check``: the line that checks it (``ex.qN.check(...)``);
- ``solution``: the hidden solution, run by the tests (collapsed in JupyterLab and in the book).

Its hints are in its markdown, each in a ``<details>`` block (closed in JupyterLab and in the book, given one at a
time by ``hint()``); a markdown without them gives its ``*Hint:*`` paragraphs instead.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmkit.course import tr


class Exercise(Protocol):
    """An exercise as its hints and solution are read for it (``core.Exercise``): where it is, the hints shown so far."""

    chapter: int
    number: int
    hints_shown: int


ANSWER, CHECK, SOLUTION, SECTION = "answer", "check", "solution", "exercises"  # cell tags
EXERCISE = re.compile(r"^\*\*[^*\d\n]{1,20}?(\d+)\s*—", re.MULTILINE)  # **Exercise 4 —, **演習 4 —
DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.DOTALL)
# *Hint:* paragraphs, and their Japanese (with a full-width colon)
HINT_PARAGRAPH = re.compile(r"^\*(?:Hint|ヒント)[:\uff1a]\s*\*\s*(.+?)(?=\n\s*\n|\Z)", re.MULTILINE | re.DOTALL)


def chapter_notebook(chapter: int, folder: Path | None = None) -> Path | None:
    """Chapter ``chapter``'s notebook in ``folder`` (default: the working directory), if it is there."""
    found = sorted((folder or Path.cwd()).glob(f"{chapter:02d}_*.ipynb"))
    return found[0] if found else None


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def source(cell: dict) -> str:
    text = cell["source"]
    return text if isinstance(text, str) else "".join(text)


def tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def exercise_starts(notebook_cells: list[dict]) -> dict[int, int]:
    """Exercise number -> the index of the markdown cell that names it."""
    starts: dict[int, int] = {}
    for i, cell in enumerate(notebook_cells):
        if cell["cell_type"] == "markdown":
            for match in EXERCISE.finditer(source(cell)):
                starts.setdefault(int(match.group(1)), i)
    return starts


def exercise_cells(notebook_cells: list[dict], number: int) -> list[dict]:
    """The cells of exercise ``number``: from its markdown up to the next exercise or heading."""
    starts = exercise_starts(notebook_cells)
    if number not in starts:
        return []
    first = starts[number]
    end = len(notebook_cells)
    for i in range(first + 1, len(notebook_cells)):
        cell = notebook_cells[i]
        text = source(cell)
        if cell["cell_type"] == "markdown" and (EXERCISE.search(text) or text.lstrip().startswith("#")):
            end = i
            break
    return notebook_cells[first:end]


def hints_in(markdown: str) -> list[str]:
    """The hints of an exercise's markdown: its ``<details>`` blocks, else its ``*Hint:*`` paragraphs."""
    blocks = [body.strip() for _, body in DETAILS.findall(markdown)]
    return blocks or [m.group(1).strip() for m in HINT_PARAGRAPH.finditer(markdown)]


def solution_cell(chapter: int, number: int, folder: Path | None = None) -> dict | None:
    """The code cell tagged ``solution`` under exercise ``number`` of chapter ``chapter`` (None: not in that notebook)."""
    path = chapter_notebook(chapter, folder)
    if path is None:
        return None
    return next((c for c in exercise_cells(cells(path), number) if c["cell_type"] == "code" and SOLUTION in tags(c)), None)


# --- what hint() and solution() show -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """A hint or a solution as a notebook shows it: a title, then markdown or code."""

    title: str
    body: str
    code: bool = False

    def __str__(self) -> str:
        return f"{self.title}\n{self.body}"

    def _repr_markdown_(self) -> str:
        body = f"```python\n{self.body}\n```" if self.code else self.body
        return f"**{self.title}**\n\n{body}"

    def _repr_html_(self) -> str | None:
        if not self.code:
            return None  # the markdown form
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        code = highlight(self.body, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=False))
        return f"<strong>{html.escape(self.title)}</strong>{code}"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        bundle = {"text/plain": str(self), "text/markdown": self._repr_markdown_()}
        if (rich := self._repr_html_()) is not None:
            bundle["text/html"] = rich
        return bundle


def next_hint(ex: Exercise) -> Shown:
    """Exercise ``ex``'s next hint from its notebook (one more each call; the last one again after that)."""
    path = chapter_notebook(ex.chapter)
    if path is None:
        return Shown(tr("No hint here"), tr("the chapter's notebook is not in this folder: hints are read from it"))
    markdown = "\n\n".join(source(c) for c in exercise_cells(cells(path), ex.number) if c["cell_type"] == "markdown")
    hints = hints_in(markdown)
    if not hints:
        return Shown(tr("No hint here"), tr("this exercise has no hint in its notebook"))
    ex.hints_shown = min(ex.hints_shown + 1, len(hints))
    k = ex.hints_shown
    return Shown(tr("Hint {k} of {n}", k=k, n=len(hints)), hints[k - 1])


def solution_view(ex: Exercise) -> Shown:
    """Exercise ``ex``'s solution: its hidden cell's code, from the notebook (a student edition has none)."""
    if chapter_notebook(ex.chapter) is None:
        return Shown(tr("No solution here"), tr("the chapter's notebook is not in this folder: the solution is read from it"))
    cell = solution_cell(ex.chapter, ex.number)
    if cell is None:
        return Shown(tr("No solution here"), tr("this edition of the notebook has no solutions"))
    return Shown(tr("Solution of exercise {chapter}.{number}", chapter=ex.chapter, number=ex.number), source(cell), code=True)
