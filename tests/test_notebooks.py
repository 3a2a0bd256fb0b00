"""The notebooks as files: Japanese mirrors English, outputs are committed, nothing errored.

(Executing them is nbval's job: `make test` runs each chapter once, in one edition, with --nbval-lax; `make test-editions`
runs both.)
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent / "notebooks"
ENGLISH = sorted((ROOT / "en").glob("*.ipynb"))


def headings(nb) -> list[str]:
    """The heading levels of the markdown cells, in order (text is translated, structure is not)."""
    return [
        line.split(" ", 1)[0]
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for line in cell.source.splitlines()
        if line.startswith("#")
    ]


def test_there_are_notebooks():
    assert ENGLISH, "notebooks/en is empty"


@pytest.mark.parametrize("en_path", ENGLISH, ids=lambda p: p.name)
def test_japanese_mirrors_english(en_path):
    ja_path = ROOT / "ja" / en_path.name
    assert ja_path.exists(), f"missing translation: {ja_path}"
    en, ja = nbformat.read(en_path, 4), nbformat.read(ja_path, 4)
    assert [c.cell_type for c in en.cells] == [c.cell_type for c in ja.cells]
    assert [c.source for c in en.cells if c.cell_type == "code"] == [c.source for c in ja.cells if c.cell_type == "code"]
    assert headings(en) == headings(ja)


@pytest.mark.parametrize("path", ENGLISH + sorted((ROOT / "ja").glob("*.ipynb")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_with_outputs_and_no_errors(path):
    nb = nbformat.read(path, 4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell was executed before committing"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


def compares_rows(nb) -> set[int]:
    """The chapter numbers of the rows of chapter 0's "What each chapter compares" table (its first table)."""
    table = next(c.source for c in nb.cells if c.cell_type == "markdown" and "|---|---|" in c.source)
    return {int(m) for m in re.findall(r"^\| (\d+)\. ", table, re.MULTILINE)}


def prints_labels(nb) -> bool:
    return any(re.search(r"\btr\(", c.source) for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("en_path", [p for p in ENGLISH if not p.name.startswith("00_")], ids=lambda p: p.name)
def test_every_chapter_has_its_twin_its_catalog_and_its_row_in_chapter_0(en_path):
    number = int(en_path.name.split("_", 1)[0])
    assert (ROOT / "ja" / en_path.name).exists(), f"no Japanese edition of {en_path.name}"
    if prints_labels(nbformat.read(en_path, 4)):
        assert (ROOT / "ja" / "locale" / f"{en_path.stem}.po").exists(), f"{en_path.name} prints labels: its catalog is missing"
    for lang in ("en", "ja"):
        assert number in compares_rows(nbformat.read(ROOT / lang / "00_start_here.ipynb", 4)), f"chapter 0 ({lang}) has no row for {number}"
