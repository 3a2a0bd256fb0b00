"""Sphinx extension for the two editions of the book (English and Japanese, one build each).

Every page gets a link to the same page in the other edition (in the article header, beside the
theme's buttons) and ``<link rel="alternate" hreflang=...>`` tags; theme labels that Jupyter Book
sets in English (the search box, tooltips) follow the edition's ``language``; Japanese pages get a
font stack that picks a Japanese (not Chinese) CJK face where one is installed, and the line breaks
of the markdown source between two Japanese characters are dropped (a browser shows each as a space).

The editions sit side by side in the published site (``en/``, ``ja/``, see book/build.py) and
have the same page names (the notebooks' file names are the same in notebooks/en and ja), so the
other edition's page is ``../<lang>/<pagename>.html`` from an edition's root.

Config (book/<lang>/_config.yml, ``sphinx.config``): ``language`` and ``bilingual_editions``,
``{code: name in its own language}``.
"""

from __future__ import annotations

import gettext
import re
from pathlib import Path

from docutils import nodes

from sphinx import locale

HERE = Path(__file__).resolve().parent

SEARCH_BAR_TEXT = {"en": "Search this book…", "ja": "この本を検索…"}
SWITCH_TITLE = {"en": "Read this page in {name}", "ja": "このページを{name}で読む"}

# Theme and Sphinx labels that their own Japanese catalogs leave untranslated (tooltips, the heading link);
# used only where a catalog has no translation. The two sidebar toggles are templates here
# (templates/toggle-*-sidebar.html), where the theme has the English text built in.
MISSING = {
    "ja": {
        "Link to this heading": "この見出しへのリンク",
        "Color mode": "カラーモード",
        "System Settings": "システム設定",
        "Light": "ライト",
        "Dark": "ダーク",
        "Toggle primary sidebar": "サイドバーの表示を切り替え",
        "Toggle secondary sidebar": "目次の表示を切り替え",
    }
}


class _Missing(gettext.NullTranslations):
    def __init__(self, messages: dict[str, str]):
        super().__init__()
        self.messages = messages

    def gettext(self, message):
        return self.messages.get(message, message)


def _config_inited(app, config):
    config.templates_path.insert(0, str(HERE / "templates"))  # before the themes' components: ours override
    config.html_static_path.append(str(HERE / "static"))
    language = config.language or "en"
    options = config.html_theme_options
    options["search_bar_text"] = SEARCH_BAR_TEXT.get(language, SEARCH_BAR_TEXT["en"])
    end = options.get("article_header_end") or ["article-header-buttons.html"]
    if isinstance(end, str):
        end = [end]
    options["article_header_end"] = ["language-switch.html", *[t for t in end if t != "language-switch.html"]]


# Kana, CJK ideographs and punctuation, full-width forms: a line break between two of these is no space in
# Japanese, but browsers draw the newline of a wrapped markdown paragraph as one.
CJK = re.compile(r"[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")


def _join_cjk_lines(app, doctree):
    """In a Japanese edition, drop the line breaks of the markdown source that fall between two CJK characters."""
    if (app.config.language or "en") != "ja":
        return
    for paragraph in doctree.findall(nodes.paragraph):
        texts = [t for t in paragraph.findall(nodes.Text) if not isinstance(t.parent, (nodes.literal, nodes.raw))]
        for i, text in enumerate(texts):
            if "\n" not in text:
                continue
            before = "".join(str(t) for t in texts[:i])[-1:]
            after = "".join(str(t) for t in texts[i + 1 :])[:1]
            value = str(text)
            joined = "".join(
                char
                for j, char in enumerate(value)
                if not (
                    char == "\n"
                    and CJK.match((value[:j] or before)[-1:] or " ")
                    and CJK.match((value[j + 1 :] or after)[:1] or " ")
                )
            )
            if joined != value:  # by identity: Text nodes are strings, and equal ones are many ("\n")
                parent = text.parent
                parent[next(k for k, child in enumerate(parent.children) if child is text)] = nodes.Text(joined)


def _builder_inited(app):
    messages = MISSING.get(app.config.language or "en")
    translator = locale.translators.get(("general", "sphinx"))
    if messages and translator is not None:
        translator.add_fallback(_Missing(messages))


def _page_context(app, pagename, templatename, context, doctree):
    language = app.config.language or "en"
    to_root = "../" * pagename.count("/")
    others = []
    for code, name in app.config.bilingual_editions.items():
        if code == language:
            continue
        url = f"{to_root}../{code}/{pagename}.html"
        title = SWITCH_TITLE.get(language, SWITCH_TITLE["en"]).format(name=name)
        others.append({"code": code, "name": name, "url": url, "title": title})
    context["bilingual_others"] = others
    alternates = "".join(
        f'<link rel="alternate" hreflang="{o["code"]}" href="{o["url"]}" />\n' for o in others
    )
    context["metatags"] = context.get("metatags", "") + alternates


def setup(app):
    app.add_config_value("bilingual_editions", {"en": "English", "ja": "日本語"}, "html")
    app.connect("config-inited", _config_inited)
    app.connect("builder-inited", _builder_inited)
    app.connect("doctree-read", _join_cjk_lines)
    app.connect("html-page-context", _page_context)
    app.add_css_file("bilingual.css")
    # env_version: raise it when a change here alters the doctrees, so an incremental build reads every page again
    return {"version": "1.0", "env_version": 2, "parallel_read_safe": True, "parallel_write_safe": True}
