"""For a class: a folder of submitted notebooks graded, each in cages with time limits.

Chapter 99 (tests/exercise_demo.py: a value and a function, no model) keeps it fast. Honest submissions: a correct one,
a wrong one, an empty one, one that raises, one that loops forever (at the top of a cell, and inside its function,
catching even the interrupt), one that prints megabytes, one that uses the chapter's earlier names and says
``return None``. Hostile ones, from the learner report (../shared/reviews/2026-12-07-learner.md): one that kills the
grader and deletes a folder outside its own, one that replaces the judge, one that blanks another student's file, one
that floods the descriptors, one that leaves a ``setsid`` daemon, one that imports the kit's reference (and one that
reads the check's frames). Every honest row is graded as if alone; no hostile row gets more than its own answers
earn; no process and no file outside the cages is left or touched.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from llmkit.cli import main
from llmkit.course.exercises import cage, classroom, done

from exercise_demo import demo_notebook

ROOT = Path(tempfile.mkdtemp(prefix="llmkit-classroom-"))
DECOY, SUBMISSIONS_DIR = ROOT / "decoy", ROOT / "submissions"
SUBMISSIONS = {  # student -> (exercise 1's answer cell, exercise 2's)
    "correct": ("answer = 42", "def double(x):\n    return x * 2"),
    "wrong": ("answer = 41", "def double(x):\n    return x + x + 1"),
    "empty": ("answer = ...", "def double(x):\n    ..."),
    "crashing": ("answer = 1 / 0", "def double(x):\n    return {}[x]"),
    "endless": (
        "while True:\n    pass",
        # catches even the interrupt: only killing the kernel stops it
        "import time\n\n\ndef double(x):\n    while True:\n        try:\n            time.sleep(1)\n"
        "        except BaseException:\n            pass",
    ),
    "loud": ("for _ in range(100_000):\n    print('spam ' * 20)\nanswer = 42", "def double(x):\n    return 2 * x"),
    "victim": ("answer = 6 * 7", "def double(x):\n    return x + x"),
    # the notebook's own style: a name from the chapter's earlier cells (tr), no import
    "natural": ("answer = int(tr('42'))", "def double(x):\n    if x is None:\n        return None\n    return x * 2"),
    "killer": (
        f"import os, shutil, signal\nshutil.rmtree({str(DECOY)!r}, ignore_errors=True)\nos.kill(os.getppid(), signal.SIGKILL)\n"
        "os.kill(1, signal.SIGKILL)\nanswer = 42\nos._exit(3)",
        "def double(x):\n    return 2 * x",
    ),
    "tamper": (
        "answer = 41\nfrom llmkit.course.exercises import core\n"
        "core.Exercise.verdict = lambda self, *a: core.Verdict(self.chapter, self.number, core.PASS, 'correct')",
        "def double(x):\n    from llmkit.course.exercises import core\n"
        "    core.Exercise.verdict = lambda self, *a: core.Verdict(self.chapter, self.number, core.PASS, 'correct')\n    return x",
    ),
    "saboteur": (
        "import glob\nfor path in glob.glob(" + repr(f"{SUBMISSIONS_DIR}/*.ipynb") + "):\n"
        "    if 'victim' in path:\n        open(path, 'w').write('{}')\nanswer = 42",
        "def double(x):\n    return 2 * x",
    ),
    "flood": (
        "import os, sys\nsys.__stdout__.write('y' * 20_000_000)\nos.write(1, b'z' * 20_000_000)\nos.write(2, b'e' * 20_000_000)\n"
        "answer = 42",
        "def double(x):\n    return 2 * x",
    ),
    "daemon": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n            time.sleep(1)\n"
        "    os._exit(0)\nanswer = 42",
        "import os\n\n\ndef double(x):\n    os._exit(1)",
    ),
    "cheat": (
        "from exercise_demo import q1\nanswer = 6 * 7 if q1 else 0",
        "def double(x):\n    import exercise_demo\n    return exercise_demo.reference_double(x)",
    ),
    "walker": (
        "answer = 42",
        "def double(x):\n    kit = [c for c in object.__subclasses__() if c.__name__ == 'Chapter'][0]\n"
        "    return kit.exercise.__globals__['chapter'](99).q2.judge.__globals__['reference_double'](x)",
    ),
    "spy": (
        "answer = 0",
        "import inspect\n\n\ndef double(x):\n    for info in inspect.stack():\n        print(info.frame.f_code.co_names)\n    return x",
    ),
}
CELL_TIMEOUT, TOTAL_TIMEOUT = 4, 15
EXPECTED = {
    "correct": ["pass", "pass"],
    "wrong": ["fail", "fail"],
    "empty": ["not answered", "not answered"],
    "crashing": ["error", "error"],
    "endless": ["error", "error"],
    "loud": ["pass", "pass"],
    "victim": ["pass", "pass"],
    "natural": ["pass", "pass"],
    "killer": ["error", "pass"],  # its first cell ends in the cage (pid 1 there is the cage's own); the second is right
    "tamper": ["fail", "error"],  # its real answers: 41, and code that reaches into the checks
    "saboteur": ["pass", "pass"],  # the other notebooks are not in its cage: it blanked nothing
    "flood": ["error", "pass"],  # its own write past the cap fails (EFBIG): at most OUTPUT_LIMIT bytes a descriptor
    "daemon": ["pass", "error"],  # the daemon dies with the cage; os._exit in the judge is no verdict
    "cheat": ["error", "error"],  # the reference is not in the answers' cage, and the judge refuses its import
    "spy": ["fail", "error"],
    "walker": ["pass", "error"],
}


def caged_processes() -> list[str]:
    """The processes a grading run here started (its mark in their environment), as command lines."""
    mark, found = f"{classroom.GRADER_ENV}={os.getpid()}".encode(), []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if p.name.isdigit() and mark in (p / "environ").read_bytes().split(b"\0"):
                found.append((p / "cmdline").read_bytes().decode(errors="replace"))
    return found


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def graded():
    folder, out = SUBMISSIONS_DIR, ROOT / "grades"
    folder.mkdir()
    DECOY.mkdir()
    (DECOY / "keep.txt").write_text("an instructor's file")
    for student, (answer, double) in SUBMISSIONS.items():
        nbformat.write(demo_notebook(answer, double), folder / f"{student}.ipynb")
    (folder / "nothing.ipynb").write_text("this is not a notebook")
    files = tree(ROOT)
    t0 = time.perf_counter()
    submissions = classroom.grade(folder, out, cell_timeout=CELL_TIMEOUT, total_timeout=TOTAL_TIMEOUT, modules={99: "exercise_demo"},
                                  paths=[str(Path(__file__).parent)])  # fmt: skip
    seconds = time.perf_counter() - t0
    left = caged_processes()
    yield submissions, out, seconds, left, files
    shutil.rmtree(ROOT, ignore_errors=True)


def test_each_submission_gets_its_own_row(graded):
    _, out, *_ = graded
    with (out / "grades.csv").open() as f:
        table = {row["student"]: row for row in csv.DictReader(f)}
    for student, statuses in EXPECTED.items():
        assert [table[student]["99.1"], table[student]["99.2"]] == statuses, (student, table[student])
    assert table["correct"]["passed"] == "2" and table["wrong"]["passed"] == "0" and table["victim"]["passed"] == "2"
    assert table["nothing"]["?"] == "error"  # an unreadable file costs its own row too
    page = (out / "grades.html").read_text()
    assert page.count("<tr>") == len(table) + 1 and 'title="answer cell: ZeroDivisionError: division by zero"' in page


def test_bubblewrap_is_the_cage_here():
    assert cage.kind() == cage.BUBBLEWRAP  # make test installs it (the Makefile's browser target)


def test_an_endless_submission_costs_only_its_time_limit(graded):
    submissions, _, seconds, *_ = graded
    by_student = {s.student: s for s in submissions}
    assert by_student["endless"].seconds < TOTAL_TIMEOUT + 15  # interrupted, then killed: not forever
    assert "time limit" in by_student["endless"].results["99.1"].message
    assert all(by_student[s].seconds < 40 for s in ("correct", "wrong", "empty", "crashing", "loud")), {
        s: round(v.seconds) for s, v in by_student.items()
    }
    assert seconds < 400


def test_nothing_of_a_submission_outlives_its_cage_or_touches_what_is_not_its_own(graded):
    *_, left, files = graded
    assert not left  # the setsid daemon, a check's server: gone with their cage
    assert tree(ROOT / "decoy") == {k: v for k, v in files.items() if "/decoy/" in k}  # the killer's rmtree reached nothing
    assert tree(SUBMISSIONS_DIR) == {k: v for k, v in files.items() if "/submissions/" in k}  # every notebook as it came


def test_the_grades_say_which_cage_and_why_a_hostile_row_lost(graded):
    submissions, out, *_ = graded
    by_student = {s.student: s.results for s in submissions}
    assert "reached into the kit's checks" in by_student["tamper"]["99.2"].message
    assert "import the kit's checks" in by_student["cheat"]["99.2"].message
    assert "frames" in by_student["spy"]["99.2"].message and "a way into them" in by_student["walker"]["99.2"].message
    assert "ended its process (exit code 3)" in by_student["killer"]["99.1"].message
    assert "File too large" in by_student["flood"]["99.1"].message
    assert "no verdict" in by_student["daemon"]["99.2"].message
    page = (out / "grades.html").read_text()
    assert cage.kind() in page and json.loads(page.split('id="grades">')[1].split("</script>")[0])["victim"]["99.1"] == "pass"


FALLBACK = ("correct", "daemon", "flood", "cheat")


def test_the_fallback_where_bubblewrap_cannot_run(tmp_path, monkeypatch):
    """The weaker cage (a process group, marked processes killed after): the same rows for what it can hold."""
    folder = tmp_path / "submissions"
    folder.mkdir()
    for student in FALLBACK:
        nbformat.write(demo_notebook(*SUBMISSIONS[student]), folder / f"{student}.ipynb")
    monkeypatch.setenv(cage.CAGE_ENV, "process-group")
    cage.bwrap_works.cache_clear()
    try:
        submissions = classroom.grade(folder, tmp_path / "grades", cell_timeout=CELL_TIMEOUT, total_timeout=TOTAL_TIMEOUT,
                                      modules={99: "exercise_demo"}, paths=[str(Path(__file__).parent)])  # fmt: skip
        assert cage.FALLBACK in (tmp_path / "grades" / "grades.html").read_text()
    finally:
        monkeypatch.delenv(cage.CAGE_ENV)
        cage.bwrap_works.cache_clear()
    assert {s.student: [r.status for r in s.results.values()] for s in submissions} == {s: EXPECTED[s] for s in FALLBACK}
    assert not caged_processes()  # the setsid daemon too


def test_a_grading_run_records_nothing_in_the_graders_progress(graded, tmp_path, monkeypatch):
    monkeypatch.setenv(done.ENV, str(tmp_path / "mine.json"))
    assert not (tmp_path / "mine.json").exists() and done.load() == {}


def test_the_student_edition_from_the_command_line(tmp_path, capsys):
    assert main(["exercises", "student", str(tmp_path)]) == 0
    assert "notebooks without their solutions" in capsys.readouterr().out
    chapters = sorted(p.name for p in (Path(__file__).parents[1] / "notebooks" / "en").glob("*.ipynb"))
    for lang in ("en", "ja"):
        assert sorted(p.name for p in (tmp_path / lang).glob("*.ipynb")) == chapters, f"{lang}: every chapter, and only those"
