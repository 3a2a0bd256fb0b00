"""The course's printed words in the reader's language: ``tr``, ``pad``, ``table``, ``large_number``, the plots' font.

The printed words, with code cells identical in every edition. A notebook cell writes its labels in English,
through ``tr``::

    from llmkit.course import tr
    print(tr("bad requests answered 400: {n}/{total}", n=n, total=total))
    ax.set_xlabel(tr("seconds since the first request"))

The English text is the key (gettext's idea: the code reads as English, a translator works on a catalog beside
it). Which catalog applies is chosen by the notebook's folder, the kernel's working directory: a folder with a
``locale/`` of gettext ``.po`` files (``notebooks/ja/locale/*.po``) translates; any other folder (``notebooks/en``,
your own scripts) prints the English as it is. In a translated folder, plots also switch to a font with Japanese
glyphs that the kit installs (``matplotlib-fontja``'s IPAexGothic), so no plot shows empty boxes.

A key missing from the catalog falls back to English with a warning (a learner's own new cell keeps working);
``tests/test_course.py`` checks that every key the notebooks and llmkit's own code use is in every catalog, and that
no entry is unused. What llmkit itself prints in a notebook (the widgets' labels, the side-by-side views' captions,
``upstream.MAP``'s "what differs") is in ``locale/llmkit.po``; each chapter's labels are in its own ``.po``.

Columns line up in every language: a Japanese character takes two columns of a fixed-width font, so ``tr`` counts a
string's width in a format spec (``{name:13}``) in display columns (``wcwidth``), not characters, and ``pad`` and
``table`` do the same for labels that are not inside a ``tr`` sentence::

    print(table(rows, headers=(tr("field"), "slots", tr("meaning"))))   # each column as wide as its widest cell
    print(pad(tr("read size"), 12, ">"), n)

Large counts are written the way each language counts them, by ``large_number``: in English in millions and
billions (``0.37 million``), in Japanese in 万 and 億 (``37 万``, the glossary's rule), chosen by the same folder as
the catalog (its ``.po`` files' ``Language`` header)::

    print(tr("the default 8192 MiB hold about {n} tokens", n=large_number(8192 * MIB / per_token)))
"""

from __future__ import annotations

import math
import re
import string
import warnings
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import wcwidth


def po_files(folder: Path | None = None) -> list[Path]:
    """The catalogs of ``folder`` (default: the working directory): its ``locale/*.po``."""
    return sorted(((Path.cwd() if folder is None else folder) / "locale").glob("*.po"))


@cache
def catalog(folder: Path | None = None) -> dict[str, str]:
    """English → translation, from every ``locale/*.po`` in ``folder`` (default: the working directory)."""
    files = po_files(folder)
    if not files:
        return {}
    import polib  # only a translated folder needs it

    entries = [e for po in files for e in polib.pofile(str(po)) if e.msgstr]
    if entries:
        use_japanese_font()
    return {e.msgid: e.msgstr for e in entries}


def tr(text: str, /, **values: object) -> str:
    """``text`` in the notebook folder's language, then ``str.format(**values)`` (any placeholder name, ``text`` too)."""
    table = catalog()
    if table and text not in table:
        warnings.warn(f"no translation for {text!r}: printed in English", stacklevel=2)
    return COLUMNS.vformat(table.get(text, text), (), values)


@cache
def language(folder: Path | None = None) -> str:
    """The language of ``folder``'s catalogs (default: the working directory), from their ``Language`` header; else ``en``."""
    files = po_files(folder)
    if not files:
        return "en"
    import polib

    return str(polib.pofile(str(files[0])).metadata.get("Language") or "en")


# How each language groups a large count: (smallest value written with the word, what the word stands for, the word),
# largest first; a smaller count is written out in full (12,000).
LARGE_NUMBERS = {
    "en": ((1e9, 1e9, "billion"), (1e5, 1e6, "million")),  # 0.37 million, not 370 thousand
    "ja": ((1e12, 1e12, "兆"), (1e8, 1e8, "億"), (1e4, 1e4, "万")),  # 37 万, 1.2 億
}


def large_number(n: float, digits: int = 2) -> str:
    """``n`` rounded to ``digits`` significant figures, in the folder's language: ``0.37 million``, ``37 万``."""
    value = float(f"{n:.{digits}g}")
    for smallest, unit, word in LARGE_NUMBERS.get(language(), LARGE_NUMBERS["en"]):
        if abs(value) >= smallest:
            return f"{significant(value / unit, digits)} {word}"
    return significant(value, digits)


def significant(x: float, digits: int) -> str:
    """``x`` with as many decimals as ``digits`` significant figures need (none for a whole number), digits grouped."""
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0) if x else 0
    return f"{x:,.{decimals}f}"


def width(text: str) -> int:
    """How many columns ``text`` takes in a fixed-width font: two for a CJK character, none for a combining mark."""
    columns = wcwidth.wcswidth(text)
    if columns < 0:  # a control character (a newline, say) has no width of its own: count the rest
        columns = sum(max(wcwidth.wcwidth(c), 0) for c in text)
    return columns


def pad(text: object, columns: int, align: str = "<") -> str:
    """``str(text)`` padded with spaces to ``columns`` display columns: ``<`` left, ``>`` right, ``^`` centred (never cut)."""
    return COLUMNS.format_field(str(text), f"{align}{columns}")


def table(rows: Iterable[Sequence[object]], headers: Sequence[object] | None = None, align: str = "", sep: str = "  ") -> str:
    """Rows of cells as text columns, each as wide as its widest cell (display columns), headers on top.

    ``align`` has one of ``<``, ``>``, ``^`` per column (``">"``: the first column right-aligned, the others left).
    No line ends in spaces.
    """
    lines = [[str(cell) for cell in row] for row in ([headers] if headers is not None else []) + list(rows)]
    n = max((len(line) for line in lines), default=0)
    widths = [max((width(line[i]) for line in lines if i < len(line)), default=0) for i in range(n)]
    sides = align.ljust(n, "<")
    return "\n".join(sep.join(pad(cell, widths[i], sides[i]) for i, cell in enumerate(line)).rstrip() for line in lines)


class DisplayColumns(string.Formatter):
    """``str.format``, except that a string's width in a format spec is counted in display columns, not characters."""

    STRING_SPEC = re.compile(r"(?:(?P<fill>.)?(?P<align>[<>^]))?(?P<width>\d+)?(?:\.(?P<precision>\d+))?s?", re.DOTALL)

    def format_field(self, value: object, format_spec: str) -> str:
        spec = self.STRING_SPEC.fullmatch(format_spec)
        if not isinstance(value, str) or spec is None or spec["width"] is None:
            return super().format_field(value, format_spec)
        text = value if spec["precision"] is None else value[: int(spec["precision"])]
        missing = max(int(spec["width"]) - width(text), 0)
        before = {"<": 0, ">": missing, "^": missing // 2}[spec["align"] or "<"]
        fill = spec["fill"] or " "
        return fill * before + text + fill * (missing - before)


COLUMNS = DisplayColumns()


def use_japanese_font() -> None:
    """Draw plot text with IPAexGothic (shipped by ``matplotlib-fontja``): Latin and Japanese glyphs in one font."""
    import matplotlib_fontja

    matplotlib_fontja.japanize()
