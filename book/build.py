"""Build the book: one Jupyter Book build per edition, then the site that holds both.

    python book/build.py [-W] [--out DIR] [--notebooks DIR]

Each edition is built from its own notebooks folder with its own config and table of contents
(book/en, book/ja: language, title, root), so navigation (Previous/Next, the sidebar, search)
stays inside one language. The published site is DIR/html (default book/_build/html):

    index.html     the landing page (book/landing.html), linking both editions
    en/ ja/        the editions; each page links to the same page in the other one

-W turns warnings into errors (the book test uses it).
"""

from __future__ import annotations

import argparse
import html
import shutil
import subprocess
import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
EDITIONS = ("en", "ja")


def build(
    out: Path = BOOK / "_build", warnings_are_errors: bool = False, notebooks: Path = ROOT / "notebooks", editions=EDITIONS
) -> Path:
    """Build ``notebooks/<lang>`` into ``out/<lang>``, assemble the site in ``out/html``; return that folder."""
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    site = out / "html"
    site.mkdir(parents=True, exist_ok=True)
    for lang in editions:
        command = [
            str(jupyter_book), "build", str(notebooks / lang),
            "--config", str(BOOK / lang / "_config.yml"), "--toc", str(BOOK / lang / "_toc.yml"),
            "--path-output", str(out / lang),
        ]  # fmt: skip
        command.append("--all")  # write every page: a change in book/_ext (templates, labels) reaches them all
        if warnings_are_errors:
            command += ["-W", "--keep-going"]
        print(f"Building the {lang} edition: {' '.join(command)}", flush=True)
        subprocess.run(command, check=True)
        edition = site / lang
        if edition.exists():
            shutil.rmtree(edition)
        shutil.copytree(out / lang / "_build" / "html", edition)
        write_edition_index(edition, lang, [other for other in editions if other != lang])
    shutil.copy(BOOK / "landing.html", site / "index.html")
    (site / ".nojekyll").touch()  # GitHub Pages: serve _static/ and _images/ as they are
    return site


def write_edition_index(edition: Path, lang: str, others: list[str]) -> None:
    """``<lang>/index.html``: to the edition's first page (Jupyter Book writes a bare redirect), in its language."""
    import yaml

    config = yaml.safe_load((BOOK / lang / "_config.yml").read_text(encoding="utf-8"))
    root = yaml.safe_load((BOOK / lang / "_toc.yml").read_text(encoding="utf-8"))["root"] + ".html"
    title = html.escape(config["title"])
    names = config["sphinx"]["config"]["bilingual_editions"]
    alternates = "".join(f'  <link rel="alternate" hreflang="{o}" href="../{o}/index.html" />\n' for o in others)
    switches = "".join(
        f'  <p><a class="bilingual-switch" href="../{o}/index.html" hreflang="{o}" lang="{o}">{html.escape(names[o])}</a></p>\n'
        for o in others
    )
    (edition / "index.html").write_text(
        f"""<!DOCTYPE html>
<html lang="{lang}">
<head>
  <meta charset="utf-8">
  <title>{title}</title>
  <meta http-equiv="Refresh" content="0; url={root}" />
  <link rel="canonical" href="{root}" />
{alternates}</head>
<body>
  <p><a href="{root}">{title}</a></p>
{switches}</body>
</html>
""",
        encoding="utf-8",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-W", dest="strict", action="store_true", help="turn warnings into errors")
    parser.add_argument("--out", type=Path, default=BOOK / "_build", help="build folder (default: book/_build)")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="holds en/ and ja/ (default: notebooks)")
    args = parser.parse_args(argv)
    try:
        site = build(args.out, args.strict, args.notebooks.resolve())
    except subprocess.CalledProcessError as error:
        print(f"The book build failed: {error}", file=sys.stderr)
        return 1
    print(f"\nThe book: {site / 'index.html'}  (or: python -m http.server -d {site} 8000, then http://127.0.0.1:8000/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
