"""Put the exercises that answer back into the chapters, both editions: a one-off edit of notebooks/en and notebooks/ja.

    python scripts/exercise_cells.py [NOTEBOOKS]        # default: notebooks/

For each chapter 1-9, in each edition:

- the exercise section's opening: how an exercise answers back, then a code cell (tagged ``exercises``) that loads the
  chapter's checks and shows its progress;
- each exercise: its statement as the notebook has it (or a new one, where the exercise changed), a paragraph that
  says what the answer cell holds, its hints in closed ``<details>`` blocks (the notebook's ``*Hint:*`` first), then an
  answer cell (tagged ``answer``), a check cell (tagged ``check``) and the hidden solution (tagged ``solution``), which
  now defines the answer cell's names before it shows and asserts what the chapter claims;
- new exercises where a chapter had fewer than three, or none whose code runs in the engine or against a server.

Chapter 0 gets the progress of every chapter. Code cells are the same in both editions (tests/test_notebooks.py).
Run once, on notebooks without the edit (it refuses a chapter that already has answer cells); then re-execute.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exercise_texts import CHAPTER_ZERO, EXERCISES, INTRO, PO_ADDITIONS, PO_RENAMES

EXERCISE = re.compile(r"^\*\*[^*\d\n]{1,20}?(\d+)\s*—", re.MULTILINE)
HINT = re.compile(r"\n*^\*(?:Hint|ヒント)[:\uff1a]\s*\*\s*(.+?)(?=\n\s*\n|\Z)", re.MULTILINE | re.DOTALL)
HINT_WORD = {"en": "Hint", "ja": "ヒント"}
HIDDEN = {"jupyter": {"source_hidden": True}}


def details(lang: str, hints: list[str]) -> str:
    return "\n\n".join(f"<details><summary>{HINT_WORD[lang]} {k}</summary>\n\n{hint}\n\n</details>" for k, hint in enumerate(hints, 1))


def exercise_markdown(lang: str, old: str | None, spec: dict) -> str:
    """The exercise's markdown: its statement (the notebook's, or the spec's), what the answer cell holds, its hints."""
    if spec.get("statement"):
        statement, hints = spec["statement"][lang], []
    else:
        assert old is not None
        hints = [" ".join(m.group(1).split()) if lang == "ja" else m.group(1).strip() for m in HINT.finditer(old)]
        statement = HINT.sub("", old).strip()
    hints = (hints if spec.get("keep_hint", True) else []) + spec["hints"][lang]
    return f"{statement}\n\n{spec['answer_note'][lang]}\n\n{details(lang, hints)}"


def code(source: str, tags: list[str], **metadata) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source.strip("\n"), metadata={"tags": tags, **metadata})


def exercise_cells(spec: dict) -> list:
    """The answer cell, the check cell and (for a new exercise) the hidden solution."""
    cells = [code(spec["answer"], ["answer"]), code(spec["check"], ["check"])]
    return cells + ([code(spec["solution"], ["solution"], **HIDDEN)] if spec.get("new") else [])


SECTION = re.compile(r"## (Exercises|演習)\s*$")


def section_start(cells: list) -> int:
    return next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and SECTION.match(c.source.split("\n", 1)[0]))


def split_section_opening(cells: list, lang: str, chapter: int) -> None:
    """ "## Exercises", the opening, the exercises cell; then exercise 1's markdown on its own."""
    at = section_start(cells)
    source = cells[at].source
    first = EXERCISE.search(source)
    assert first and first.group(1) == "1", f"chapter {chapter}: exercise 1 is not in the section's first cell"
    extra = INTRO["extra"].get(chapter, {}).get(lang, "")
    opening = f"{source.split(chr(10), 1)[0]}\n\n{INTRO[lang]}{(' ' + extra) if extra else ''}"
    loader = code(f"from llmkit.course import exercises\n\nex = exercises.chapter({chapter})\nex.progress()", ["exercises"])
    cells[at : at + 1] = [nbformat.v4.new_markdown_cell(opening), loader, nbformat.v4.new_markdown_cell(source[first.start() :])]


def edit_exercise(cells: list, lang: str, spec: dict) -> None:
    number = spec["number"]
    at = next(
        i for i, c in enumerate(cells) if c.cell_type == "markdown" and any(int(m.group(1)) == number for m in EXERCISE.finditer(c.source))
    )
    before, _, block = cells[at].source.partition(EXERCISE.search(cells[at].source).group(0))
    head = EXERCISE.search(cells[at].source).group(0)
    cells[at].source = (before + exercise_markdown(lang, head + block, spec)).strip()
    solution = next(i for i in range(at + 1, len(cells)) if "solution" in cells[i].metadata.get("tags", []))
    if spec["solution"] is not None:  # None: the notebook's solution already defines the answer cell's names
        cells[solution].source = spec["solution"].strip("\n")
    cells[solution:solution] = exercise_cells(spec)


def insert_new_exercises(cells: list, lang: str, specs: list[dict]) -> None:
    """New exercises after the last one: before the chapter's summary or its "Next:" line (split off the cell it ends)."""
    last = max(i for i, c in enumerate(cells) if "solution" in c.metadata.get("tags", []))
    ends = re.compile(r"(## |Next:|次へ)")  # the chapter's summary, or its last line
    at = next((i for i in range(last + 1, len(cells)) if cells[i].cell_type == "markdown" and ends.match(cells[i].source)), None)
    if at is None:  # the closing discussion ends with "Next: ...": split it there
        at = len(cells) - 1
        discussion, _, rest = cells[at].source.partition("\n\nNext:" if lang == "en" else "\n\n次へ")
        if rest:
            cells[at].source = discussion
            cells.append(nbformat.v4.new_markdown_cell(("Next:" if lang == "en" else "次へ") + rest))
            at += 1
    new = []
    for spec in specs:
        new += [nbformat.v4.new_markdown_cell(exercise_markdown(lang, None, spec)), *exercise_cells(spec)]
    cells[at:at] = new


def edit_chapter(path: Path, lang: str, chapter: int) -> None:
    nb = nbformat.read(path, as_version=4)
    assert not any("answer" in c.metadata.get("tags", []) for c in nb.cells), f"{path} already has answer cells"
    specs = [s for s in EXERCISES if s["chapter"] == chapter]
    split_section_opening(nb.cells, lang, chapter)
    for spec in (s for s in specs if not s.get("new")):
        edit_exercise(nb.cells, lang, spec)
    insert_new_exercises(nb.cells, lang, [s for s in specs if s.get("new")])
    nbformat.write(nb, path)


def edit_catalogs(locale: Path) -> None:
    """The Japanese labels the new solution cells print, and chapter 0's changed one."""
    import polib

    for name, entries in PO_ADDITIONS.items():
        po = polib.pofile(str(locale / name))
        for msgid, msgstr in entries.items():
            po.append(polib.POEntry(msgid=msgid, msgstr=msgstr))
        po.save()
    for name, (old, new, msgstr) in PO_RENAMES.items():
        po = polib.pofile(str(locale / name))
        entry = po.find(old)
        entry.msgid, entry.msgstr = new, msgstr
        po.save()


def edit_chapter_zero(path: Path, lang: str) -> None:
    nb = nbformat.read(path, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and re.match(r"## (What's next|次に読むもの|次へ)", c.source))
    for old, new in CHAPTER_ZERO["replace"][lang]:
        for cell in nb.cells:
            cell.source = cell.source.replace(old, new)
    nb.cells[at:at] = [nbformat.v4.new_markdown_cell(CHAPTER_ZERO["section"][lang]),
                       code("from llmkit.course import exercises\n\nexercises.progress()", ["exercises"])]  # fmt: skip
    nbformat.write(nb, path)


def main(root: Path) -> None:
    for lang in ("en", "ja"):
        for chapter in range(1, 10):
            (path,) = (root / lang).glob(f"{chapter:02d}_*.ipynb")
            edit_chapter(path, lang, chapter)
        edit_chapter_zero(root / lang / "00_start_here.ipynb", lang)
        print(f"{lang}: chapters 0-9 edited")
    edit_catalogs(root / "ja" / "locale")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "notebooks")
