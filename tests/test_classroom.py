"""For a class: a folder of submitted notebooks graded, each in a fresh kernel with time limits.

Chapter 99 (tests/exercise_demo.py: a value and a function, no model) keeps it fast. Six submissions: a correct one,
a wrong one, an empty one, one that raises, one that loops forever (at the top of a cell, and inside its function,
catching even the interrupt) and one that prints megabytes. Each costs only its own row, within the time limits.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import nbformat
import pytest

from llmkit.cli import main
from llmkit.course.exercises import classroom, done

from exercise_demo import demo_notebook

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
}
EXPECTED = {
    "correct": ["pass", "pass"],
    "wrong": ["fail", "fail"],
    "empty": ["not answered", "not answered"],
    "crashing": ["error", "error"],
    "endless": ["error", "error"],
    "loud": ["pass", "pass"],
}
CELL_TIMEOUT, TOTAL_TIMEOUT = 4, 15


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder, out = tmp_path_factory.mktemp("submissions"), tmp_path_factory.mktemp("grades")
    for student, (answer, double) in SUBMISSIONS.items():
        nbformat.write(demo_notebook(answer, double), folder / f"{student}.ipynb")
    (folder / "nothing.ipynb").write_text("this is not a notebook")
    t0 = time.perf_counter()
    submissions = classroom.grade(folder, out, cell_timeout=CELL_TIMEOUT, total_timeout=TOTAL_TIMEOUT, modules={99: "exercise_demo"},
                                  paths=[str(__import__("pathlib").Path(__file__).parent)])  # fmt: skip
    return submissions, out, time.perf_counter() - t0


def test_each_submission_gets_its_own_row(graded):
    _, out, _ = graded
    with (out / "grades.csv").open() as f:
        table = {row["student"]: row for row in csv.DictReader(f)}
    for student, statuses in EXPECTED.items():
        assert [table[student]["99.1"], table[student]["99.2"]] == statuses, (student, table[student])
    assert table["correct"]["passed"] == "2" and table["wrong"]["passed"] == "0"
    assert table["nothing"]["?"] == "error"  # an unreadable file costs its own row too
    page = (out / "grades.html").read_text()
    assert page.count("<tr>") == len(table) + 1 and 'title="answer cell: ZeroDivisionError: division by zero"' in page


def test_an_endless_submission_costs_only_its_time_limit(graded):
    submissions, _, seconds = graded
    by_student = {s.student: s for s in submissions}
    assert by_student["endless"].seconds < TOTAL_TIMEOUT + 15  # interrupted, then killed: not forever
    assert "time limit" in by_student["endless"].results["99.1"].message
    assert all(by_student[s].seconds < 30 for s in ("correct", "wrong", "empty", "crashing", "loud")), {
        s: round(v.seconds) for s, v in by_student.items()
    }
    assert seconds < 240


def test_a_grading_run_records_nothing_in_the_graders_progress(graded, tmp_path, monkeypatch):
    monkeypatch.setenv(done.ENV, str(tmp_path / "mine.json"))
    assert not (tmp_path / "mine.json").exists() and done.load() == {}


def test_the_student_edition_from_the_command_line(tmp_path, capsys):
    assert main(["exercises", "student", str(tmp_path)]) == 0
    assert "notebooks without their solutions" in capsys.readouterr().out
    chapters = sorted(p.name for p in (Path(__file__).parents[1] / "notebooks" / "en").glob("*.ipynb"))
    for lang in ("en", "ja"):
        assert sorted(p.name for p in (tmp_path / lang).glob("*.ipynb")) == chapters, f"{lang}: every chapter, and only those"
