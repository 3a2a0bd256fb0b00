"""The notebooks as files: Japanese mirrors English, outputs are committed, nothing errored.

(Executing them is nbval's job: `make test` runs notebooks/ with --nbval-lax.)
"""

from __future__ import annotations

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
