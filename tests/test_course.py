"""llmkit.course: the notebooks' labels per edition — English keys in identical code cells, Japanese from the catalogs."""

from __future__ import annotations

import ast
import re
import string
from pathlib import Path

import nbformat
import polib
import pytest

from llmkit import course

from helpers import JA_CHAR

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def keys_used(path: Path) -> set[str]:
    """The literal first arguments of every ``tr(...)`` call in a notebook's code cells."""
    keys = set()
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tr":
                assert node.args and isinstance(node.args[0], ast.Constant), f"{path.name}: tr() needs a literal key"
                keys.add(node.args[0].value)
    return keys


USED = {key for path in sorted((NOTEBOOKS / "en").glob("*.ipynb")) for key in keys_used(path)}


def test_english_folder_prints_the_key_itself(tmp_path):
    assert course.catalog(tmp_path) == {}


def test_a_catalog_in_the_folder_translates_and_formats(tmp_path, monkeypatch):
    (tmp_path / "locale").mkdir()
    po = polib.POFile()
    po.append(polib.POEntry(msgid="{n} requests", msgstr="リクエスト {n} 件"))
    po.save(str(tmp_path / "locale" / "x.po"))
    monkeypatch.chdir(tmp_path)
    course.catalog.cache_clear()
    try:
        assert course.tr("{n} requests", n=3) == "リクエスト 3 件"
        with pytest.warns(UserWarning, match="no translation"):
            assert course.tr("{n} slots", n=2) == "2 slots"  # a learner's new label: English, with a warning
        import matplotlib

        assert matplotlib.rcParams["font.family"] == ["IPAexGothic"]
    finally:
        course.catalog.cache_clear()


def test_the_notebooks_use_tr():
    assert len(USED) > 100, "the chapters print their labels through llmkit.course.tr"


def test_every_label_the_notebooks_print_has_a_japanese_entry_and_none_is_unused():
    ja = course.catalog(NOTEBOOKS / "ja")
    assert sorted(USED - ja.keys()) == [], "labels the Japanese edition would print in English"
    assert sorted(ja.keys() - USED) == [], "catalog entries no notebook uses"


def fields(text: str) -> list[str]:
    """The ``{placeholders}`` of a format string, with their format specs."""
    return sorted(f"{name}:{spec}" for _, name, spec, _ in string.Formatter().parse(text) if name is not None)


def test_japanese_entries_are_japanese_and_keep_the_placeholders():
    for key, text in course.catalog(NOTEBOOKS / "ja").items():
        assert re.search(JA_CHAR, text) or text == key, f"not translated: {key!r} -> {text!r}"
        assert fields(key) == fields(text), f"placeholders differ: {key!r} vs {text!r}"


def test_a_label_shared_by_chapters_reads_the_same_in_each_catalog():
    # the catalogs of one folder are merged: a key in two chapters' files must not say two different things
    seen: dict[str, tuple[str, str]] = {}
    for po in sorted((NOTEBOOKS / "ja" / "locale").glob("*.po")):
        for entry in polib.pofile(str(po)):
            first = seen.setdefault(entry.msgid, (entry.msgstr, po.name))
            assert first[0] == entry.msgstr, f"{entry.msgid!r}: {first[1]} says {first[0]!r}, {po.name} says {entry.msgstr!r}"
