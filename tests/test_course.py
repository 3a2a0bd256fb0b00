"""llmkit.course: the notebooks' labels per edition — English keys in identical code cells, Japanese from the catalogs."""

from __future__ import annotations

import ast
import re
import string
from pathlib import Path

import nbformat
import polib
import pytest

from llmkit.course import words
from llmkit.course.upstream import MAP

from helpers import JA_CHAR

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
LIBRARY_CATALOG = NOTEBOOKS / "ja" / "locale" / "llmkit.po"  # what llmkit's own code prints; a chapter's labels: its .po
EXERCISES_CATALOG = NOTEBOOKS / "ja" / "locale" / "exercises.po"  # what the exercises' checks say (llmkit/course/exercises)

# tr() calls in llmkit whose key is not a literal, and every key each can be given
DYNAMIC_KEYS = {"self.differs": {row.differs for row in MAP}}  # upstream.Counterpart.what_differs


def tr_keys(source: str, where: str, dynamic: dict[str, set[str]] | None = None) -> set[str]:
    """The keys of every ``tr(...)`` call in Python source: literal first arguments, or a ``dynamic`` one's keys."""
    keys = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tr":
            assert node.args, f"{where}: tr() without a key"
            if isinstance(node.args[0], ast.Constant):
                keys.add(node.args[0].value)
            else:
                expression = ast.unparse(node.args[0])
                assert expression in (dynamic or {}), f"{where}: tr({expression}) needs a literal key (or an entry in DYNAMIC_KEYS)"
                keys |= (dynamic or {})[expression]
    return keys


def keys_used(path: Path) -> set[str]:
    """The literal first arguments of every ``tr(...)`` call in a notebook's code cells."""
    keys = set()
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        keys |= tr_keys(source, path.name)
    return keys


USED = {key for path in sorted((NOTEBOOKS / "en").glob("*.ipynb")) for key in keys_used(path)}
EXERCISES = {
    key for path in sorted((ROOT / "llmkit" / "course" / "exercises").rglob("*.py")) for key in tr_keys(path.read_text(), path.name)
}
LIBRARY = {
    key
    for path in sorted((ROOT / "llmkit").rglob("*.py"))
    if "exercises" not in path.relative_to(ROOT).parts
    for key in tr_keys(path.read_text(), path.name, DYNAMIC_KEYS)
}


def test_english_folder_prints_the_key_itself(tmp_path):
    assert words.catalog(tmp_path) == {}


def test_a_catalog_in_the_folder_translates_and_formats(tmp_path, monkeypatch):
    (tmp_path / "locale").mkdir()
    po = polib.POFile()
    po.append(polib.POEntry(msgid="{n} requests", msgstr="リクエスト {n} 件"))
    po.save(str(tmp_path / "locale" / "x.po"))
    monkeypatch.chdir(tmp_path)
    words.catalog.cache_clear()
    try:
        assert words.tr("{n} requests", n=3) == "リクエスト 3 件"
        with pytest.warns(UserWarning, match="no translation"):
            assert words.tr("{n} slots", n=2) == "2 slots"  # a learner's new label: English, with a warning
        import matplotlib

        assert matplotlib.rcParams["font.family"] == ["IPAexGothic"]
    finally:
        words.catalog.cache_clear()


def test_large_numbers_count_in_millions_in_english_and_in_man_in_japanese(tmp_path, monkeypatch):
    assert words.language(NOTEBOOKS / "en") == "en" and words.language(NOTEBOOKS / "ja") == "ja"
    english, japanese = tmp_path / "en", tmp_path / "ja"
    (japanese / "locale").mkdir(parents=True)
    english.mkdir()
    po = polib.POFile()
    po.metadata = {"Language": "ja"}
    po.save(str(japanese / "locale" / "x.po"))
    counts = (373_000, 91, 23_078, 9_100_000, 120_000_000, 2_500_000_000)
    printed = {}
    for folder in (english, japanese):
        monkeypatch.chdir(folder)
        words.language.cache_clear()
        try:
            printed[folder.name] = [words.large_number(n) for n in counts] + [words.large_number(373_000, digits=3)]
        finally:
            words.language.cache_clear()
    assert printed["en"] == ["0.37 million", "91", "23,000", "9.1 million", "120 million", "2.5 billion", "0.373 million"]
    assert printed["ja"] == ["37 万", "91", "2.3 万", "910 万", "1.2 億", "25 億", "37.3 万"]


def test_the_notebooks_use_tr():
    assert len(USED) > 100, "the chapters print their labels through llmkit.words.tr"


def test_llmkit_prints_through_tr_too():
    assert len(LIBRARY) > len(MAP), "MAP's 'what differs', the widgets' labels, the side-by-side captions"


def test_every_label_the_notebooks_print_has_a_japanese_entry_and_none_is_unused():
    ja = words.catalog(NOTEBOOKS / "ja")
    assert sorted((USED | LIBRARY | EXERCISES) - ja.keys()) == [], "labels the Japanese edition would print in English"
    assert sorted(ja.keys() - USED - LIBRARY - EXERCISES) == [], "catalog entries neither a notebook nor llmkit uses"


@pytest.mark.parametrize(
    ("catalog", "keys"), [(LIBRARY_CATALOG, LIBRARY), (EXERCISES_CATALOG, EXERCISES)], ids=lambda x: getattr(x, "name", "")
)
def test_what_llmkit_prints_is_in_its_own_catalog(catalog, keys):
    held = {entry.msgid for entry in polib.pofile(str(catalog))}
    assert sorted(keys - held) == [], f"these labels belong in {catalog.name}"
    assert sorted(held - keys) == [], f"entries of {catalog.name} that its code does not use"


def test_the_exercises_speak_through_tr():
    assert len(EXERCISES) > 150, "the checks' messages, hints' and solutions' titles, the progress table"


def fields(text: str) -> list[str]:
    """The ``{placeholders}`` of a format string, with their conversions and format specs."""
    return sorted(f"{name}!{conversion}:{spec}" for _, name, spec, conversion in string.Formatter().parse(text) if name is not None)


def test_japanese_entries_are_japanese_and_keep_the_placeholders():
    for key, text in words.catalog(NOTEBOOKS / "ja").items():
        japanese = re.search(JA_CHAR, text) or re.fullmatch(r"[\u3000-\u303f]+", text)  # 、 alone: Japanese punctuation
        assert japanese or text == key, f"not translated: {key!r} -> {text!r}"
        assert fields(key) == fields(text), f"placeholders differ: {key!r} vs {text!r}"


def test_a_label_shared_by_chapters_reads_the_same_in_each_catalog():
    # the catalogs of one folder are merged: a key in two chapters' files must not say two different things
    seen: dict[str, tuple[str, str]] = {}
    for po in sorted((NOTEBOOKS / "ja" / "locale").glob("*.po")):
        for entry in polib.pofile(str(po)):
            first = seen.setdefault(entry.msgid, (entry.msgstr, po.name))
            assert first[0] == entry.msgstr, f"{entry.msgid!r}: {first[1]} says {first[0]!r}, {po.name} says {entry.msgstr!r}"


def test_a_japanese_and_an_english_label_padded_alike_take_the_same_columns():
    japanese, english = "読み取りサイズ", "read size"
    assert words.width(japanese) == 14 and words.width(english) == 9  # a Japanese character takes two columns
    for align in "<>^":
        assert words.width(words.pad(japanese, 16, align)) == words.width(words.pad(english, 16, align)) == 16
    # plain formatting pads by characters: the Japanese label comes out 7 columns wider and the next column moves
    assert words.width(f"{japanese:16}") == 23 != words.width(f"{english:16}")
    assert words.pad("とても長いラベル", 4) == "とても長いラベル"  # too wide: kept whole, never cut


def test_tr_counts_display_columns_in_a_format_spec():
    line = "{name:>8} | {n:3} | {note:^9.2} |"
    assert words.width(words.tr(line, name="なし", n=7, note="無傷のチャンク")) == words.width(line.format(name="none", n=7, note="ok"))
    assert words.width(line.format(name="なし", n=7, note="無傷のチャンク")) != words.width(line.format(name="none", n=7, note="ok"))
    # for text one column per character (the English edition), exactly what str.format prints
    for spec in ("{x}", "{x:12}", "{x:>12}", "{x:^12}", "{x:*<12}", "{x:.3}", "{x:>9.4}", "{x!r:14}", "{x:3}", "{y:8.2f}", "{y:>8}"):
        assert words.tr(spec, x="budget", y=3.14159) == spec.format(x="budget", y=3.14159), spec


def test_a_table_lines_up_its_columns_in_display_columns():
    widest = "読み込み中のステップ数"  # 11 characters, 22 columns
    text = words.table([("なし", 2, "767 tok"), ("512", 3, "512 tok"), (widest, 19, "x")], headers=("budget", "steps", "x"), align=">")
    lines = text.splitlines()
    assert len(lines) == 4 and not any(line.endswith(" ") for line in lines)
    starts = {words.width(line[: line.index(str(cell))]) for line, cell in zip(lines, ["steps", 2, 3, 19], strict=True)}
    assert starts == {22 + 2}, text  # the second column starts at the same column on every line, after the widest cell
    assert lines[1].startswith(" " * 18 + "なし  ")  # right-aligned by display width
