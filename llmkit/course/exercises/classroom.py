"""For a class: a student edition of the notebooks, and a folder of submitted notebooks graded.

    llmkit exercises student OUT                       # notebooks/en and ja without solutions, answer cells as they come
    llmkit exercises grade SUBMISSIONS -o RESULTS      # RESULTS/grades.csv and grades.html: student x exercise

A submission is graded on its answers alone (the cells tagged ``answer``), in cages (``cage``: bubblewrap, or a
weaker fallback the grades say they used). Every notebook is read before any runs. Per submission:

1. its answer cells run in a cage of their own, each in a fresh namespace (the chapter's earlier names it uses are
   given: ``context``), under the cell's time limit; out come their answers as data, or "code" (``answers``). The
   chapters' checks are hidden from that cage: the kit's reference answers cannot be imported there;
2. each exercise's verdict is decided in a fresh caged process, through the same judge as ``ex.qN.check``: values
   as data, code rebuilt from the statements of the answer cell that define it; an audit hook refuses (and grades as
   an error) an answer's code that imports the checks, reads their frames or changes the kit (``inside``).

A cell that raises, loops, ignores the interrupt, ends its process or prints megabytes costs only its own exercise;
nothing a submission does outlives its cage, reaches another submission's file, or reaches the grader.
"""

from __future__ import annotations

import contextlib
import csv
import html
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from llmkit.course.exercises import cage
from llmkit.course.exercises.answers import encode, free_names
from llmkit.course.exercises.core import CHAPTERS, chapter
from llmkit.course.exercises.notebook import ANSWER, CHECK, SOLUTION
from llmkit.course.exercises.verdict import ERROR, PASS, STATUSES, UNANSWERED

CHAPTER_CALL = re.compile(r"exercises\.chapter\((\d+)\)")
CHECK_CALL = re.compile(r"\bq(\d+)\.check\(")


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


# --- grading: each submission in cages, the verdict outside the learner's process ------------------------------------

OUTPUT_LIMIT = 1_000_000  # bytes any file a caged process writes may hold (its stdout and stderr too): the rest is dropped
READ_LIMIT = 4_000_000  # bytes of a cage's answers the grader reads
GRACE = 5  # seconds after a cell's own time limit before its process is killed (a cell that ignores the interrupt)
GRADER_ENV = "LLMKIT_GRADER"  # in every caged process's environment: the grader's process id (to find what is left, if any)
STARTUP = 60  # seconds more for a judge's process to start (llmkit's imports on a busy machine)


@dataclass
class Limits:
    cell: float
    total: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.started + self.total - time.monotonic()


@dataclass
class Grading:
    """What every cage of one class shares: the kit's checks and notebooks, the submissions and the results (hidden)."""

    chapter_files: list[Path]  # the chapters' check modules: hidden while the answers run
    hidden: list[Path]  # folders no cage may read: the submissions, the results, the kit's notebooks (solutions)
    modules: dict[int, str]
    paths: list[str]

    def run(self, command: str, spec: dict, scratch: Path, logs: Path, until: float, *, watch: Path | None = None,
            cell: float = 0) -> cage.Ran:  # fmt: skip
        """Run ``inside``'s ``command`` on ``spec`` caged in ``scratch``; stop it at ``until`` (monotonic), or ``cell``
        seconds + GRACE after the last line of ``watch`` appeared (a cell that ignores its interrupt; STARTUP more before
        the first)."""
        (scratch / "spec.json").write_text(json.dumps({**spec, "paths": self.paths, "modules": self.modules}), encoding="utf-8")
        env = {**os.environ, "LLMKIT_PROGRESS": str(scratch / "progress.json"), GRADER_ENV: str(os.getpid())}
        seen = {"size": -1, "since": time.monotonic()}

        def deadline() -> bool:
            now = time.monotonic()
            if watch is not None and (size := watch.stat().st_size if watch.exists() else 0) != seen["size"]:
                seen.update(size=size, since=now)
            allowed = cell + GRACE + (STARTUP if seen["size"] <= 0 else 0)  # the first cell waits for the imports too
            return now > until or (watch is not None and now > seen["since"] + allowed)

        argv = [sys.executable, "-m", "llmkit.course.exercises.inside", command, str(scratch / "spec.json")]
        hidden_files = self.chapter_files if command == "answers" else []
        return cage.run(argv, scratch, logs, env=env, output_limit=OUTPUT_LIMIT, deadline=deadline, hidden_dirs=self.hidden,
                        hidden_files=hidden_files)  # fmt: skip


def load_chapters(modules: dict[int, str]) -> None:
    """Checks of chapters outside llmkit (a class's own), chapter number -> module."""
    from llmkit.course.exercises.core import EXTRA_MODULES

    EXTRA_MODULES.update(modules)


def context_spec(chapter_number: int, source: str) -> dict:
    """The chapter's earlier names the answer cell uses: data (made here, sent as JSON) or made in the cage."""
    from llmkit.course.exercises.context import Elsewhere, chapter_names

    wanted = free_names(source)
    data, elsewhere = {}, {}
    for name, give in chapter_names(chapter_number).items():
        if name in wanted:
            value = give()
            if isinstance(value, Elsewhere):
                elsewhere[name] = [value.module, value.attribute, value.call]
            else:
                data[name] = encode(value)
    return {"context": data, "elsewhere": elsewhere}


def read_lines(path: Path) -> list[dict]:
    """The JSON lines a cage wrote (at most READ_LIMIT bytes; a line that is not a JSON object is skipped)."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        text = f.read(READ_LIMIT).decode(errors="replace")
    found = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(item := json.loads(line), dict):
                found.append(item)
    return found


def ended(ran: cage.Ran) -> str:
    if ran.overran:
        return "it ran over its time limit and ignored the interrupt: its process was killed"
    return f"it ended its process (exit code {ran.returncode})"


def collect_answers(grading: Grading, chapter_number: int, cells: list[tuple[int, str, list[str]]], tmp: Path,
                    limits: Limits) -> dict[int, dict]:  # fmt: skip
    """Exercise number -> {"answers": name -> encoded} or {"error": why}: the answer cells run caged, in order; a cell
    that ends or hangs its process costs its own exercise, and the next cells run in a fresh cage."""
    collected: dict[int, dict] = {}
    pending, attempt = list(cells), 0
    while pending and limits.left() > 0:
        attempt += 1
        scratch, logs = tmp / f"answers{attempt}", tmp / f"logs-answers{attempt}"
        scratch.mkdir()
        logs.mkdir()
        context: dict[str, dict] = {"context": {}, "elsewhere": {}}
        for _, source, _ in pending:
            for key, value in context_spec(chapter_number, source).items():
                context[key].update(value)
        spec = {"chapter": chapter_number, "cells": pending, "cell_timeout": limits.cell, **context}
        ran = grading.run("answers", spec, scratch, logs, time.monotonic() + limits.left(), watch=scratch / "progress", cell=limits.cell)
        numbers = {number for number, _, _ in pending}
        for item in read_lines(scratch / "answers.jsonl"):
            if item.get("number") in numbers and item["number"] not in collected:
                collected[item["number"]] = item
        started = [int(n) for n in (scratch / "progress").read_text().split() if n.isdigit()] if (scratch / "progress").exists() else []
        pending = [cell for cell in pending if cell[0] not in collected]
        if pending and started and pending[0][0] == started[-1]:
            collected[pending.pop(0)[0]] = {"error": f"the cell did not finish: {ended(ran)}"}
        elif pending:
            why = f"the answers' process could not start: {ended(ran)}: {ran.stderr_tail[-300:]}"
            collected.update({number: {"error": why} for number, _, _ in pending})
            break
    return collected


def judge(grading: Grading, ex: Any, source: str, answers: dict, tmp: Path, limits: Limits) -> Graded:
    """Exercise ``ex``'s verdict on ``answers``, decided in a fresh caged process (never the one that ran the answers)."""
    scratch, logs = tmp / f"judge{ex.number}", tmp / f"logs-judge{ex.number}"
    scratch.mkdir()
    logs.mkdir()
    spec = {"chapter": ex.chapter, "number": ex.number, "answers": answers, "source": source, "cell_timeout": limits.cell,
            **context_spec(ex.chapter, source)}  # fmt: skip
    until = time.monotonic() + min(limits.left(), limits.cell + GRACE + STARTUP)
    ran = grading.run("judge", spec, scratch, logs, until, watch=scratch / "progress", cell=limits.cell)
    found = read_lines(scratch / "verdict.json")
    if ran.returncode == 0 and found and found[0].get("status") in STATUSES and isinstance(found[0].get("message"), str):
        return Graded(found[0]["status"], found[0]["message"][:2000])
    if ran.overran:
        return Graded(ERROR, "no verdict: the check (and the answer's code in it) ran over the time limit")
    why = f"the check's process ended (exit code {ran.returncode}): the answer's code ended it, or the check broke"
    return Graded(ERROR, f"no verdict: {why}")


def grade_one(nb: Any, path: Path, student: str, grading: Grading, limits: Limits) -> Submission:
    chapter_number = chapter_of(nb, path)
    if chapter_number is None:
        return Submission(student, path, None, {"?": Graded(ERROR, "no exercises.chapter(N) in it")})
    ch, sources = chapter(chapter_number), answers_by_exercise(nb)
    cells = [(ex.number, sources[ex.number], list(ex.answers)) for ex in ch if ex.number in sources]
    results = {}
    with tempfile.TemporaryDirectory(prefix="llmkit-grade-") as tmp:
        collected = collect_answers(grading, chapter_number, cells, Path(tmp), limits)
        for ex in ch:
            key, found = f"{chapter_number}.{ex.number}", collected.get(ex.number, {})
            if "error" in found:
                results[key] = Graded(ERROR, f"answer cell: {found['error']}")
            elif not found or all(v == {"ellipsis": True} for v in found.get("answers", {}).values()):
                results[key] = Graded(UNANSWERED, ex.verdict(*[...] * len(ex.answers)).message)
            elif limits.left() <= 0:
                results[key] = Graded(ERROR, "no verdict: the submission ran over its total time limit")
            else:
                results[key] = judge(grading, ex, sources[ex.number], found.get("answers", {}), Path(tmp), limits)
    return Submission(student, path, chapter_number, results, time.monotonic() - limits.started)


def read_all(folder: Path) -> list[tuple[Path, Any]]:
    """Every notebook under ``folder`` read now, before any runs (no submission can change another's), or the error."""
    found = []
    for path in sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts):
        try:
            found.append((path, nbformat.read(path, as_version=4)))
        except Exception as exc:  # noqa: BLE001 -- an unreadable file is that student's error, not the class's
            found.append((path, exc))
    return found


def chapter_files(modules: dict[int, str]) -> list[Path]:
    """The files of the chapters' checks (``chNN.py``, a class's own modules): what an answers' cage must not read."""
    names = [f"llmkit.course.exercises.ch{n:02d}" for n in CHAPTERS] + list(modules.values())
    return [Path(spec.origin) for name in names if (spec := importlib.util.find_spec(name)) is not None and spec.origin]


def grade(
    folder: Path, out: Path, *, cell_timeout: float = 300, total_timeout: float = 1800, modules: dict[int, str] | None = None,
    paths: list[str] | None = None,
) -> list[Submission]:  # fmt: skip
    """Grade every notebook under ``folder`` (the student: its path, without ``.ipynb``; a notebook named after the chapter
    in a student's folder: that folder), write ``out/grades.csv`` and ``out/grades.html``; return the submissions."""
    modules = modules or {}
    load_chapters(modules)
    grading = Grading(chapter_files(modules), [folder.resolve(), out.resolve(), repository_notebooks().resolve()], modules, paths or [])
    submissions = []
    for path, nb in read_all(folder):
        relative = path.relative_to(folder).with_suffix("")
        student = str(relative.parent) if re.match(r"\d+_", relative.name) and relative.parent != Path(".") else str(relative)
        if isinstance(nb, Exception):
            submissions.append(Submission(student, path, None, {"?": Graded(ERROR, f"not a notebook: {nb}")}))
        else:
            submissions.append(grade_one(nb, path, student, grading, Limits(cell_timeout, total_timeout)))
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
    statuses = statuses.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # JSON still, never a tag
    path.write_text(
        f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Exercises graded</title>
<style>{style}</style>
</head><body>
<h1>Exercises graded</h1>
<p>{html.escape(str(folder))}: {len(submissions)} notebooks, each graded in a cage: {html.escape(cage.kind())}.
Each cell: {legend} (hover for what differs).</p>
<table><tr><th>student</th>{head}<th>passed</th></tr>
{chr(10).join(body)}
</table>
<script type="application/json" id="grades">{statuses}</script>
</body></html>
""",
        encoding="utf-8",
    )
