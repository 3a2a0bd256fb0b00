"""The Japanese edition's prose and labels: written in Japanese, one term per concept, numbers written one way,
no stray line breaks.

Model-free: reads notebooks/ja/*.ipynb, their catalogs notebooks/ja/locale/*.po and notebooks/ja/glossary.toml
only. (That the code cells are identical to the English edition's is tests/test_notebooks.py's job; that every
label has an entry, tests/test_course.py's.)
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

import nbformat
import polib
import pytest
from markdown_it import MarkdownIt

from llmkit.course import words

from helpers import JA_CHAR

ROOT = Path(__file__).resolve().parent.parent / "notebooks"
JAPANESE = sorted((ROOT / "ja").glob("*.ipynb"))
CATALOGS = sorted((ROOT / "ja" / "locale").glob("*.po"))  # the labels the code cells (and llmkit) print
GLOSSARY = ROOT / "ja" / "glossary.toml"

# JA_CHAR (helpers), plus Japanese punctuation and full-width forms: a line ending or starting with one of
# these is Japanese text on both sides of the break.
JA_TEXT = r"[\u3000-\u303f\u3040-\u309f\u30a0-\u30ff\u4e00-\u9fff\uff00-\uffef]"
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.DOTALL)
# A full-width digit, or a number (a digit, or a label's {placeholder}) touching a Japanese character: 3件, {n}トークン.
UNSPACED_NUMBER = re.compile(rf"[\uff10-\uff19]|[\d}}](?={JA_CHAR})|(?<={JA_CHAR})[\d{{]")
# A number (or a placeholder) with a space before its %: the glossary writes 6%, as {x:.0%} prints it.
SPACED_PERCENT = re.compile(r"[\d}]\s+%")
BOLD = re.compile(r"\*\*(.+?)\*\*")


def markdown_cells(path: Path) -> list[tuple[int, str]]:
    nb = nbformat.read(path, 4)
    return [(i, cell.source) for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"]


def prose(source: str) -> str:
    """A markdown cell without its code blocks and code spans (they are code, not Japanese)."""
    return CODE_SPAN.sub(" ", FENCE.sub("\n", source))


def japanese_texts(path: Path) -> dict[str, str]:
    """What a reader sees in Japanese: a notebook's markdown prose, by cell; a catalog's msgstrs, by msgid."""
    if path.suffix == ".po":
        return {entry.msgid: prose(entry.msgstr) for entry in polib.pofile(str(path))}
    return {f"cell {i}": prose(source) for i, source in markdown_cells(path)}


def load_glossary() -> list[dict]:
    with GLOSSARY.open("rb") as f:
        return tomllib.load(f)["term"]


def rejected_found(text: str, term: dict) -> list[str]:
    """The rejected variants of `term` in `text`, except where one is part of the chosen term itself."""
    chosen = [m.span() for m in re.finditer(re.escape(term["ja"]), text)]
    found = []
    for variant in term["rejected"]:
        for m in re.finditer(re.escape(variant), text):
            if not any(start <= m.start() and m.end() <= end for start, end in chosen):
                found.append(variant)
    return found


def rejected_in(text: str, terms: list[dict]) -> list[str]:
    """Every rejected variant of every glossary term found in ``text``, each with the term to use instead."""
    return sorted({f"{v} (use {t['ja']})" for t in terms for v in rejected_found(text, t)})


def unspaced_numbers(text: str) -> list[str]:
    """Each number in ``text`` written against the glossary's rule for numerals, with a few characters around it."""
    return [text[max(0, m.start() - 6) : m.end() + 6] for m in UNSPACED_NUMBER.finditer(text)]


def paragraph_breaks(source: str) -> list[str]:
    """Line breaks between two Japanese characters inside a paragraph.

    Code blocks are removed; lines that are headings, list items, table rows, quotes or indented
    (a list item's continuation) keep their own lines and are not joined with a neighbour.
    """
    lines = FENCE.sub("", source).split("\n")
    own_line = re.compile(r"^\s*(#|[-*+] |\d+[.)] |\||>)|^\s{2,}\S")
    breaks = []
    for a, b in itertools.pairwise(lines):
        if not a.strip() or not b.strip() or own_line.match(a) or own_line.match(b):
            continue
        if re.search(JA_TEXT + r"$", a.rstrip()) and re.match(JA_TEXT, b.lstrip()):
            breaks.append(f"{a[-20:]!r} / {b[:20]!r}")
    return breaks


def test_there_are_japanese_notebooks():
    assert JAPANESE, "notebooks/ja has no notebooks"


def test_glossary_parses_and_every_entry_has_its_fields():
    terms = load_glossary()
    assert len(terms) >= 18
    for term in terms:
        assert isinstance(term.get("en"), str) and term["en"].strip(), term
        kept_in_english = term.get("ja") == term["en"].split(" (")[0]  # an API's own word: temperature, SSE
        assert isinstance(term.get("ja"), str) and (re.search(JA_CHAR, term["ja"]) or kept_in_english), term
        rejected = term.get("rejected")
        assert isinstance(rejected, list) and rejected and all(isinstance(v, str) and v.strip() for v in rejected), term
        assert term["ja"] not in rejected, term
    english = {t["en"].split(" (")[0] for t in terms}
    concepts = ("continuous batching", "KV cache", "slot", "structured output", "prefix", "greedy", "token", "prompt", "unified KV cache")
    for concept in (*concepts, "temperature", "SSE", "translator", "prefill", "speculative decoding", "handler", "response"):
        assert concept in english, f"the glossary has no entry for {concept!r}"


@pytest.mark.parametrize("path", JAPANESE, ids=lambda p: p.name)
def test_every_markdown_cell_is_japanese(path):
    not_japanese = [i for i, source in markdown_cells(path) if not re.search(JA_CHAR, prose(source))]
    assert not not_japanese, f"markdown cells with no Japanese text: {not_japanese}"


def test_there_are_catalogs():
    chapters = {path.stem for path in CATALOGS} - {"llmkit", "exercises"}  # what llmkit's own code and its exercises' checks print
    assert {"llmkit.po", "exercises.po"} <= {path.name for path in CATALOGS} and chapters and chapters <= {path.stem for path in JAPANESE}


@pytest.mark.parametrize("path", JAPANESE + CATALOGS, ids=lambda p: p.name)
def test_no_rejected_glossary_variant(path):
    terms = load_glossary()
    found = {where: hits for where, text in japanese_texts(path).items() if (hits := rejected_in(text, terms))}
    assert not found, f"rejected renderings (notebooks/ja/glossary.toml), by cell or label: {found}"


@pytest.mark.parametrize("path", JAPANESE + CATALOGS, ids=lambda p: p.name)
def test_numbers_are_half_width_and_spaced_from_japanese(path):
    found = {where: hits for where, text in japanese_texts(path).items() if (hits := unspaced_numbers(text))}
    assert not found, f"numbers against the rule in notebooks/ja/glossary.toml's header, by cell or label: {found}"


@pytest.mark.parametrize("path", JAPANESE, ids=lambda p: p.name)
def test_no_line_break_inside_a_japanese_paragraph(path):
    found = {i: b for i, source in markdown_cells(path) if (b := paragraph_breaks(source))}
    assert not found, f"a Japanese paragraph is one line (a break shows as a space), by cell: {found}"


def unrendered_emphasis(source: str) -> list[str]:
    """Emphasis markers that CommonMark leaves as literal text, with what surrounds them.

    CommonMark (the parser family of Jupyter and the book) closes ``**`` only where the run is right-flanking: after
    a punctuation mark (a full-width closing bracket, say), it must be followed by a space or another mark, so a bold
    term that ends with its English in brackets, right before a kana, renders its asterisks. Code spans and blocks
    are left out: an asterisk there is code.
    """
    html = MarkdownIt("commonmark").render(source)
    text = re.sub(r"<pre>.*?</pre>|<code>.*?</code>", " ", html, flags=re.DOTALL)
    return [text[max(0, m.start() - 12) : m.end() + 12] for m in re.finditer(r"\*", text)]


@pytest.mark.parametrize("path", JAPANESE, ids=lambda p: p.name)
def test_emphasis_renders(path):
    found = {i: hits for i, source in markdown_cells(path) if (hits := unrendered_emphasis(source))}
    assert not found, f"asterisks CommonMark prints as text (close the bold before the bracket), by cell: {found}"


@pytest.mark.parametrize("path", JAPANESE + CATALOGS, ids=lambda p: p.name)
def test_percent_follows_the_number(path):
    found = {where: SPACED_PERCENT.findall(text) for where, text in japanese_texts(path).items() if SPACED_PERCENT.search(text)}
    assert not found, f"'10 %' where the glossary writes '10%', by cell or label: {found}"


@pytest.mark.parametrize("path", JAPANESE, ids=lambda p: p.name)
def test_labels_the_prose_names_are_the_labels_printed(path):
    """A bold name in the English prose that is a label the code prints (a button, a row of a table: a key of the
    catalogs) is named in the Japanese prose as the Japanese edition prints it."""
    labels = words.catalog(ROOT / "ja")
    english = nbformat.read(ROOT / "en" / path.name, 4).cells
    japanese = nbformat.read(path, 4).cells
    found = {}
    for i, (en, ja) in enumerate(zip(english, japanese, strict=True)):
        if en.cell_type != "markdown":
            continue
        named = [span for span in BOLD.findall(CODE_SPAN.sub(" ", en.source)) if span in labels]
        if missing := [f"**{span}** -> **{labels[span]}**" for span in named if f"**{labels[span]}**" not in ja.source]:
            found[i] = missing
    assert not found, f"labels the prose names as the output does not print them, by cell: {found}"


# Latin letters written against Japanese ("ツールとMCP サーバー"): a half-width space goes between them, as between a
# number and Japanese, except inside the glossary's own compounds (KVキャッシュ, OpenAI互換) and around "・".
GLUED_LATIN = re.compile(rf"[A-Za-z](?={JA_CHAR})|(?<={JA_CHAR})[A-Za-z]")
# Half-width brackets around Japanese text in a label: Japanese labels use the full-width pair (U+FF08, U+FF09).
HALF_WIDTH_BRACKETS = re.compile(rf"\([^()]*{JA_CHAR}[^()]*\)")


def glued_latin(text: str, terms: list[dict]) -> list[str]:
    """Latin letters touching a Japanese character, outside the glossary's chosen terms, with what surrounds them."""
    for term in terms:
        text = text.replace(term["ja"], " ")
    text = text.replace("・", " ")
    return [text[max(0, m.start() - 6) : m.end() + 6] for m in GLUED_LATIN.finditer(text)]


@pytest.mark.parametrize("path", JAPANESE + CATALOGS, ids=lambda p: p.name)
def test_latin_letters_are_spaced_from_japanese(path):
    terms = load_glossary()
    found = {where: hits for where, text in japanese_texts(path).items() if (hits := glued_latin(text, terms))}
    assert not found, f"Latin letters against Japanese (put a half-width space between), by cell or label: {found}"


@pytest.mark.parametrize("path", CATALOGS, ids=lambda p: p.name)
def test_labels_bracket_japanese_with_full_width_brackets(path):
    found = {where: HALF_WIDTH_BRACKETS.findall(text) for where, text in japanese_texts(path).items() if HALF_WIDTH_BRACKETS.search(text)}
    assert not found, f"half-width brackets around Japanese (a Japanese label uses U+FF08 and U+FF09), by label: {found}"


def printed(cell) -> str:
    """The text a code cell printed, as a reader sees it (streams and the plain or HTML form of its results)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        else:
            parts += [output.get("data", {}).get(kind, "") for kind in ("text/plain", "text/html")]
    return "".join("".join(part) for part in parts)


@pytest.mark.parametrize("path", JAPANESE, ids=lambda p: p.name)
def test_no_rejected_glossary_variant_in_what_the_cells_printed(path):
    """The committed outputs: a label changed in a catalog reaches them only when the chapter is executed again."""
    terms = load_glossary()
    cells = nbformat.read(path, 4).cells
    found = {i: hits for i, cell in enumerate(cells) if cell.cell_type == "code" if (hits := rejected_in(printed(cell), terms))}
    assert not found, f"rejected renderings in the committed outputs (execute the chapter again), by cell: {found}"


def plain_endings(text: str) -> list[str]:
    """The sentences of ``text`` that end in plain form (だ体: a past tense in た that is not ました or でした, or a
    copula だ), where the checks speak in です・ます. A closing remark in brackets and punctuation are passed over."""
    found = []
    for sentence in re.split("[。\n]", text):
        bare = re.sub(r"(\uff08[^\uff08]*\uff09|\([^(]*\))+$", "", sentence.strip())  # a closing remark in brackets
        bare = re.sub(r"[\u300d\u300f\uff1a:\s!\uff01]+$", "", bare)
        if (bare.endswith("た") and not bare.endswith(("ました", "でした"))) or bare.endswith("だ"):
            found.append(sentence)
    return found


def test_plain_endings_are_found():
    remark, label = "数えた\uff082 回\uff09", "None\uff08待つ\uff09"  # a remark in full-width brackets, and a label's
    assert plain_endings("2 台のうち 1 台が処理した") and plain_endings("正しい形だ。") and plain_endings(remark)
    assert not plain_endings("1 台が処理しました。") and not plain_endings("正しい形でした") and not plain_endings(label)


def test_the_checks_speak_in_desu_masu():
    """What an exercise's check says, in every chapter, in one register (the review found chapter 10's in plain form)."""
    entries = polib.pofile(str(ROOT / "ja" / "locale" / "exercises.po"))
    plain = {entry.msgid: found for entry in entries if (found := plain_endings(entry.msgstr))}
    assert not plain, plain
