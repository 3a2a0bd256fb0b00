"""For a class: a student edition of the notebooks, and a folder of submitted notebooks graded.

    llmkit exercises student OUT                       # notebooks/en and ja without solutions, answer cells as they come
    llmkit exercises grade SUBMISSIONS -o RESULTS      # RESULTS/grades.csv and grades.html: student x exercise

A submission is graded on its answers alone: a fresh kernel runs the chapter's checks on the cells tagged ``answer``
(what the learner wrote), one exercise after the other, through the same judges as ``ex.qN.check`` (the kit's own
check cells, not the submission's: a learner cannot change what is checked). Each answer runs on its own, so an
answer cell must import what it uses (the chapter's exercise section says so). Each cell has a time limit, the whole
submission another; a kernel that overruns is interrupted, then killed, with the servers its checks started. A
submission that loops forever, prints megabytes or raises anywhere costs only its own row: pass, fail, not answered
or error, per exercise.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import csv
import html
import json
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from llmkit.course.exercises.core import ERROR, PASS, STATUSES, UNANSWERED, VERDICT_KEY, chapter, show
from llmkit.course.exercises.lab import PIDS_ENV
from llmkit.course.exercises.notebook import ANSWER, CHECK, SOLUTION

CHAPTER_CALL = re.compile(r"exercises\.chapter\((\d+)\)")
CHECK_CALL = re.compile(r"\bq(\d+)\.check\(")
OUTPUT_LIMIT = 100_000  # characters a cell may print in a grading run; the rest is dropped
PREAMBLE_TIMEOUT = 120  # seconds for the kit's own first cell (llmkit's imports on a busy machine), whatever the cells' limit


def repository_notebooks() -> Path:
    """The course's notebooks folder: beside the package in a checkout (an editable install), else ./notebooks."""
    beside = Path(__file__).resolve().parents[3] / "notebooks"
    return beside if beside.is_dir() else Path("notebooks")


# --- the student edition ---------------------------------------------------------------------------------------------


def student_notebook(nb: Any) -> Any:
    """``nb`` without its solution cells; its answer and check cells without outputs (the answer cells as they come)."""
    nb.cells = [cell for cell in nb.cells if SOLUTION not in cell.get("metadata", {}).get("tags", [])]
    for cell in nb.cells:
        if cell.cell_type == "code" and {ANSWER, CHECK} & set(cell.metadata.get("tags", [])):
            cell.outputs, cell.execution_count = [], None
    nb.metadata.setdefault("llmkit", {})["edition"] = "student"
    return nb


def student_edition(out: Path, notebooks: Path | None = None, editions: tuple[str, ...] = ("en", "ja")) -> list[Path]:
    """Write ``out/<edition>/``: every chapter without its solutions, and the edition's label catalogs (``locale/``)."""
    source, written = notebooks or repository_notebooks(), []
    for edition in editions:
        target = out / edition
        target.mkdir(parents=True, exist_ok=True)
        if (source / edition / "locale").is_dir():
            shutil.copytree(source / edition / "locale", target / "locale", dirs_exist_ok=True)
        for path in sorted((source / edition).glob("*.ipynb")):
            nbformat.write(student_notebook(nbformat.read(path, as_version=4)), target / path.name)
            written.append(target / path.name)
    return written


# --- grading ---------------------------------------------------------------------------------------------------------


@dataclass
class Graded:
    """One exercise of one submission: its status (pass, fail, not answered, error) and why."""

    status: str
    message: str = ""


@dataclass
class Submission:
    student: str
    path: Path
    chapter: int | None
    results: dict[str, Graded] = field(default_factory=dict)  # "4.1" -> Graded
    seconds: float = 0.0


def chapter_of(nb: Any, path: Path) -> int | None:
    """The chapter a notebook's exercises belong to: its ``exercises.chapter(N)``, else its file name's number."""
    for cell in nb.cells:
        if cell.cell_type == "code" and (found := CHAPTER_CALL.search(cell.source)):
            return int(found.group(1))
    digits = re.match(r"(\d+)_", path.name)
    return int(digits.group(1)) if digits else None


def answers_by_exercise(nb: Any) -> dict[int, str]:
    """Exercise number -> the source of its answer cell: the answer cell before each ``ex.qN.check(...)`` cell."""
    answers, pending = {}, None
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type != "code":
            continue
        if ANSWER in tags:
            pending = cell.source
        elif CHECK in tags and (found := CHECK_CALL.search(cell.source)) and pending is not None:
            answers[int(found.group(1))] = pending
            pending = None
    return answers


PREAMBLE = """\
import os, sys
os.environ[{progress_env!r}] = {progress!r}   # a grading run records nothing in anyone's progress
os.environ[{pids_env!r}] = {pids!r}           # the servers the checks start, for the grader to stop
sys.path[:0] = {paths!r}
from llmkit.course.exercises import classroom as _classroom
_classroom.cap_output({limit})
_classroom.load_chapters({modules!r})
"""

CHECK_CELL = "_classroom.graded({chapter}, {number}, globals())"


def load_chapters(modules: dict[int, str]) -> None:
    """Checks of chapters outside llmkit (a class's own), chapter number -> module."""
    from llmkit.course.exercises.core import EXTRA_MODULES

    EXTRA_MODULES.update(modules)


def graded(chapter_number: int, number: int, namespace: dict) -> None:
    """A grading run's check cell: exercise ``number``'s verdict on the names its answer cell defined (missing: not answered)."""
    ex = chapter(chapter_number).exercises[number]
    show(ex.verdict(*(namespace.get(name, ...) for name in ex.answers)))


def cap_output(limit: int) -> None:
    """At most ``limit`` characters printed per cell (stdout and stderr each): a print loop cannot flood the grader."""
    import sys

    from IPython import get_ipython

    class Capped:
        def __init__(self, inner: Any):
            self.inner, self.left = inner, limit

        def write(self, text: str) -> int:
            if self.left > 0:
                self.inner.write(text[: self.left])
                self.left -= len(text)
            return len(text)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    sys.stdout, sys.stderr = Capped(sys.stdout), Capped(sys.stderr)

    def reset(*_: Any) -> None:
        sys.stdout.left = sys.stderr.left = limit  # type: ignore[union-attr]

    shell = get_ipython()
    if shell is not None:
        shell.events.register("pre_run_cell", reset)


def grading_notebook(nb: Any, chapter_number: int, work: Path, modules: dict[int, str], paths: list[str]) -> tuple[Any, dict]:
    """The notebook a grading kernel runs: the preamble, then per exercise its answer cell and the kit's check cell.
    Also returns, per exercise, the indexes of those two cells."""
    preamble = PREAMBLE.format(
        progress_env="LLMKIT_PROGRESS", progress=str(work / "progress.json"), pids_env=PIDS_ENV, pids=str(work / "servers.pids"),
        paths=paths, limit=OUTPUT_LIMIT, modules=modules,
    )  # fmt: skip
    cells, where = [nbformat.v4.new_code_cell(preamble)], {}
    answers = answers_by_exercise(nb)
    for ex in chapter(chapter_number):
        answer = answers.get(ex.number)
        where[ex.number] = (len(cells) if answer is not None else None, len(cells) + (answer is not None))
        if answer is not None:
            cells.append(nbformat.v4.new_code_cell(answer))
        cells.append(nbformat.v4.new_code_cell(CHECK_CELL.format(chapter=chapter_number, number=ex.number)))
    return nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}}), where


def cell_error(cell: Any) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            if output.get("ename") in ("KeyboardInterrupt", "Timeout"):
                return "the cell ran over its time limit and was interrupted"
            return f"{output.get('ename')}: {output.get('evalue')}"[:300]
    return None


def cell_verdict(cell: Any) -> dict | None:
    for output in cell.get("outputs", []):
        if VERDICT_KEY in output.get("metadata", {}):
            return output["metadata"][VERDICT_KEY]
    return None


def results_of(run: Any, where: dict, chapter_number: int) -> dict[str, Graded]:
    results = {}
    for number, (answer_at, check_at) in where.items():
        key = f"{chapter_number}.{number}"
        if answer_at is not None and (error := cell_error(run.cells[answer_at])) is not None:
            results[key] = Graded(ERROR, f"answer cell: {error}")
        elif (verdict := cell_verdict(run.cells[check_at])) is not None:
            results[key] = Graded(verdict["status"], verdict["message"])
        else:
            results[key] = Graded(ERROR, cell_error(run.cells[check_at]) or "no verdict: the check ran over the time limit")
    return results


async def execute(run: Any, work: Path, cell_timeout: float, total_timeout: float) -> None:
    """Run ``run`` in a fresh kernel: each cell within ``cell_timeout`` (then interrupted, its error recorded, the next
    cell runs), the whole within ``total_timeout`` (then the kernel is killed). Cells not reached keep no outputs."""
    from nbclient import NotebookClient
    from nbclient.util import ensure_async

    preamble = run.cells[0]
    client = NotebookClient(
        run, timeout_func=lambda cell: int(max(cell_timeout, PREAMBLE_TIMEOUT) if cell is preamble else cell_timeout),
        kernel_name="python3", allow_errors=True, interrupt_on_timeout=True,
        error_on_timeout={"ename": "Timeout", "evalue": f"the cell ran over {cell_timeout:.0f} s and was interrupted", "traceback": []},
        resources={"metadata": {"path": str(work)}}, record_timing=False,
    )  # fmt: skip
    try:
        await asyncio.wait_for(client.async_execute(), total_timeout)
    except TimeoutError:
        pass
    except Exception:  # noqa: BLE001 -- a dead kernel (a submission that exits or crashes it) costs its own row: results_of reports it
        pass
    finally:
        if client.km is not None:
            with contextlib.suppress(Exception):
                await ensure_async(client.km.shutdown_kernel(now=True))
        atexit.unregister(client._cleanup_kernel)  # a run cut short leaves nbclient's own clean-up for the exit: done here
        stop_servers(work / "servers.pids")


def stop_servers(pids: Path) -> None:
    """Stop the servers a grading kernel's checks started (their process ids, one a line)."""
    if not pids.exists():
        return
    for line in pids.read_text().split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(line), signal.SIGTERM)  # launch.start puts each server in a session of its own
    time.sleep(1)
    for line in pids.read_text().split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(line), signal.SIGKILL)


def grade_one(
    path: Path, student: str, *, cell_timeout: float, total_timeout: float, modules: dict[int, str], paths: list[str]
) -> Submission:
    t0 = time.perf_counter()
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 -- an unreadable file is that student's error, not the class's
        return Submission(student, path, None, {"?": Graded(ERROR, f"not a notebook: {exc}")})
    chapter_number = chapter_of(nb, path)
    if chapter_number is None:
        return Submission(student, path, None, {"?": Graded(ERROR, "no exercises.chapter(N) in it")})
    load_chapters(modules)
    with tempfile.TemporaryDirectory(prefix="llmkit-grade-") as tmp:
        work = Path(tmp)
        run, where = grading_notebook(nb, chapter_number, work, modules, paths)
        asyncio.run(execute(run, work, cell_timeout, total_timeout))
        results = results_of(run, where, chapter_number)
    return Submission(student, path, chapter_number, results, time.perf_counter() - t0)


def grade(
    folder: Path, out: Path, *, cell_timeout: float = 300, total_timeout: float = 1800, modules: dict[int, str] | None = None,
    paths: list[str] | None = None,
) -> list[Submission]:  # fmt: skip
    """Grade every notebook under ``folder`` (the student: its path, without ``.ipynb``; a notebook named after the chapter
    in a student's folder: that folder), write ``out/grades.csv`` and ``out/grades.html``; return the submissions."""
    submissions = []
    for path in sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts):
        relative = path.relative_to(folder).with_suffix("")
        student = str(relative.parent) if re.match(r"\d+_", relative.name) and relative.parent != Path(".") else str(relative)
        submissions.append(grade_one(path, student, cell_timeout=cell_timeout, total_timeout=total_timeout, modules=modules or {},
                                     paths=paths or []))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_csv(submissions, out / "grades.csv")
    write_html(submissions, out / "grades.html", folder)
    return submissions


def columns(submissions: list[Submission]) -> list[str]:
    keys = {key for s in submissions for key in s.results}
    return sorted(keys, key=lambda k: tuple(int(p) if p.isdigit() else 0 for p in k.split(".")))


def rows(submissions: list[Submission]) -> dict[str, dict[str, Graded]]:
    """student -> exercise -> result (a student's several chapters in one row)."""
    table: dict[str, dict[str, Graded]] = {}
    for s in submissions:
        table.setdefault(s.student, {}).update(s.results)
    return table


def write_csv(submissions: list[Submission], path: Path) -> None:
    keys = columns(submissions)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *keys, "passed"])
        for student, results in rows(submissions).items():
            statuses = [results[k].status if k in results else "" for k in keys]
            writer.writerow([student, *statuses, sum(s == PASS for s in statuses)])


COLOURS = {PASS: "#e6f4ea", "fail": "#fdecea", UNANSWERED: "#f1f3f4", ERROR: "#fce8b2"}


def write_html(submissions: list[Submission], path: Path, folder: Path) -> None:
    keys = columns(submissions)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = []
    for student, results in rows(submissions).items():
        cells = []
        for k in keys:
            r = results.get(k)
            status = r.status if r else ""
            title = html.escape(r.message if r else "", quote=True)
            cells.append(
                f'<td class="{status.replace(" ", "-")}" style="background:{COLOURS.get(status, "#fff")}" title="{title}">{status}</td>'
            )
        passed = sum(results[k].status == PASS for k in keys if k in results)
        body.append(f"<tr><th>{html.escape(student)}</th>{''.join(cells)}<td>{passed}</td></tr>")
    legend = " · ".join(STATUSES)
    style = "body{font-family:sans-serif} table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:0.2em 0.6em;text-align:left}"
    statuses = json.dumps({s: {k: r.status for k, r in res.items()} for s, res in rows(submissions).items()})
    path.write_text(
        f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Exercises graded</title>
<style>{style}</style>
</head><body>
<h1>Exercises graded</h1>
<p>{html.escape(str(folder))}: {len(submissions)} notebooks. Each cell: {legend} (hover for what differs).</p>
<table><tr><th>student</th>{head}<th>passed</th></tr>
{chr(10).join(body)}
</table>
<script type="application/json" id="grades">{html.escape(statuses)}</script>
</body></html>
""",
        encoding="utf-8",
    )
