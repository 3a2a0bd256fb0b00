"""book/ publishes the notebooks as a static site: build it and find every chapter in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_book_builds_with_every_notebook(tmp_path):
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    p = subprocess.run(
        [str(jupyter_book), "build", str(ROOT / "notebooks"), "--config", str(ROOT / "book/_config.yml"),
         "--toc", str(ROOT / "book/_toc.yml"), "--path-output", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    html = tmp_path / "_build" / "html"
    for notebook in sorted((ROOT / "notebooks").glob("[ej][na]/*.ipynb")):
        page = html / notebook.parent.name / notebook.with_suffix(".html").name
        assert page.exists(), f"{notebook.name} is missing from the book"
    assert "en/00_start_here.html" in (html / "index.html").read_text()  # the front page redirects to chapter 0
