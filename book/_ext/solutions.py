"""Sphinx extension: each exercise's solution is collapsed in the book, code and output together, behind one click;
its hints (``<details>`` blocks in the exercise's markdown, closed) and its answer and check cells are styled as the
learner's part (``static/exercises.css``).

In the notebooks a solution is a code cell tagged ``solution`` whose source is collapsed in JupyterLab
(``jupyter.source_hidden``). That tag is the one source of truth: here every code cell that carries it is
given MyST-NB's ``hide-cell`` treatment (the ``hide_mode`` "all" that the ``hide-cell`` tag would set), so the
notebooks need no second tag. MyST-NB then wraps the whole cell, its input and its output, in one closed
``<details class="hide above-input">`` whose ``<summary>`` says what opens: "Show the solution" ("解答を表示"
in the Japanese edition, where the summary's accessible name is Japanese too). ``hide-input`` would hide the
code but leave its printed answer on the page, right under the exercise, before the reader has tried it.

tests/test_book.py checks the built pages: every solution cell is one closed ``<details>`` holding its input
and output, no other cell is collapsed, and in Chromium a click opens it.
"""

from __future__ import annotations

from html import escape

from docutils import nodes

TAG = "tag_solution"  # MyST-NB gives a cell's container one class per tag: tag_<tag>
PROMPTS = {  # language -> (the summary of a closed solution, of an open one)
    "en": ("Show the solution", "Hide the solution"),
    "ja": ("解答を表示", "解答を隠す"),
}
# The <summary>'s accessible name (MyST-NB writes "Toggle hidden content", in English in every edition):
# language -> (for a solution, for any other collapsed content)
ARIA_LABELS = {
    "en": ("Show or hide the solution", "Toggle hidden content"),
    "ja": ("解答の表示を切り替え", "隠れた内容の表示を切り替え"),
}


def _collapse_solutions(app, doctree):
    show, hide = PROMPTS.get(app.config.language or "en", PROMPTS["en"])
    for cell in doctree.findall(nodes.container):
        if cell.get("nb_element") == "cell_code" and TAG in cell["classes"]:
            # what MyST-NB's renderer sets for a `hide-cell` tag; its HideInputCells post-transform does the rest
            cell["hide_mode"] = "all"
            cell["prompt_show"] = show
            cell["prompt_hide"] = hide


def _visit_hidden(self, node):
    """MyST-NB's ``visit_HideCellInput``, with the summary's accessible name in the edition's language."""
    language = self.config.language or "en"
    solution, other = ARIA_LABELS.get(language, ARIA_LABELS["en"])
    label = solution if node["prompt_show"] == PROMPTS.get(language, PROMPTS["en"])[0] else other
    self.body.append(f'<details class="admonition hide {" ".join(node["classes"])}">\n')
    self.body.append(f'<summary aria-label="{escape(label)}">\n')
    self.body.append(f'<p class="collapsed admonition-title">{escape(node["prompt_show"])}</p>\n')
    self.body.append(f'<p class="expanded admonition-title">{escape(node["prompt_hide"])}</p>\n')
    self.body.append("</summary>\n")


def setup(app):
    app.setup_extension("myst_nb")  # first: its HTML visitor for a collapsed cell is registered, then replaced here
    from myst_nb.sphinx_ import HideCodeCellNode, depart_HideCellInput

    app.add_node(HideCodeCellNode, override=True, html=(_visit_hidden, depart_HideCellInput))
    app.connect("doctree-read", _collapse_solutions)
    app.add_css_file("exercises.css")
    # env_version: raise it when a change here alters the doctrees, so an incremental build reads every page again
    return {"version": "1.0", "env_version": 1, "parallel_read_safe": True, "parallel_write_safe": True}
