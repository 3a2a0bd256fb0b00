"""The course's printed words in the reader's language, with code cells identical in every edition.

A notebook cell writes its labels in English, through ``tr``::

    from llmkit.course import tr
    print(tr("bad requests answered 400: {n}/{total}", n=n, total=total))
    ax.set_xlabel(tr("seconds since the first request"))

The English text is the key (gettext's idea: the code reads as English, a translator works on a catalog beside
it). Which catalog applies is chosen by the notebook's folder, the kernel's working directory: a folder with a
``locale/`` of gettext ``.po`` files (``notebooks/ja/locale/*.po``) translates; any other folder (``notebooks/en``,
your own scripts) prints the English as it is. In a translated folder, plots also switch to a font with Japanese
glyphs that the kit installs (``matplotlib-fontja``'s IPAexGothic), so no plot shows empty boxes.

A key missing from the catalog falls back to English with a warning (a learner's own new cell keeps working);
``tests/test_course.py`` checks that every key the notebooks use is in every catalog, and that no entry is unused.
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path

import polib


@cache
def catalog(folder: Path | None = None) -> dict[str, str]:
    """English → translation, from every ``locale/*.po`` in ``folder`` (default: the working directory)."""
    folder = Path.cwd() if folder is None else folder
    entries = [e for po in sorted((folder / "locale").glob("*.po")) for e in polib.pofile(str(po)) if e.msgstr]
    if entries:
        use_japanese_font()
    return {e.msgid: e.msgstr for e in entries}


def tr(text: str, /, **values: object) -> str:
    """``text`` in the notebook folder's language, then ``str.format(**values)`` (any placeholder name, ``text`` too)."""
    table = catalog()
    if table and text not in table:
        warnings.warn(f"no translation for {text!r}: printed in English", stacklevel=2)
    return table.get(text, text).format(**values)


def use_japanese_font() -> None:
    """Draw plot text with IPAexGothic (shipped by ``matplotlib-fontja``): Latin and Japanese glyphs in one font."""
    import matplotlib_fontja

    matplotlib_fontja.japanize()
