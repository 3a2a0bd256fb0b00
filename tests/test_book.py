"""The book: one edition per language, built as `make book` builds it, read in a real browser.

book/build.py builds notebooks/en and notebooks/ja as two Jupyter Book editions (each with its own
language, title, root and table of contents) and puts them side by side under a landing page.
Here both are built afresh with warnings as errors, then checked as files (language, titles, the
link to the other edition on every page, navigation that stays in one language, every output and
figure of the notebooks embedded, every exercise solution collapsed with its output) and in headless
Chromium (Debian's chromium and chromedriver, as tests/test_webui.py): the landing page and one
chapter in each language, a solution opened with a click, with screenshots saved in
book/_build/screenshots/ for a person to look at, and a check that Japanese text is drawn with a
font that has Japanese glyphs (no "tofu" boxes).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import html
import http.server
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from filehost import serve_handler
from helpers import chromium, wait_until

ROOT = Path(__file__).resolve().parent.parent
# Building both editions takes about a minute on 2 idle cores; the first test waits for it.
pytestmark = pytest.mark.timeout(900)

EDITIONS = {"en": "ja", "ja": "en"}  # edition -> the other one
SCREENSHOTS = ROOT / "book" / "_build" / "screenshots"
CHAPTER = "03_sse_format"  # the chapter opened in the browser (it has a figure)
JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")  # kana and CJK ideographs
TIMEOUT = 60


# The notebooks as they were built (a copy: the tests compare the site with what went into it).
SOURCE: dict[str, Path] = {"notebooks": ROOT / "notebooks"}


def notebooks(lang: str) -> list[Path]:
    return sorted((SOURCE["notebooks"] / lang).glob("*.ipynb"))


def plain(text: str) -> str:
    """Text as a reader sees it, for comparing markdown with HTML: no markup, straight quotes, single spaces."""
    text = re.sub(r"[`*_]", "", html.unescape(re.sub(r"<[^>]+>", "", text)))
    text = text.translate(str.maketrans("‘’“”", "''\"\""))
    return " ".join(text.split())


def chapter_title(notebook: Path) -> str:
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return plain(line[2:])
    raise AssertionError(f"{notebook} has no '# ' title")


def pages(edition: Path) -> list[Path]:
    return sorted(p for p in edition.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


def hrefs(page_html: str, selector_class: str | None = None) -> list[str]:
    if selector_class is None:
        return re.findall(r'<a\b[^>]*\bhref="([^"]*)"', page_html)
    return re.findall(rf'<a\b[^>]*class="[^"]*\b{selector_class}\b[^"]*"[^>]*\bhref="([^"]*)"', page_html)


def resolve(page: Path, href: str) -> Path:
    return (page.parent / urlsplit(href).path).resolve()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Both editions built afresh (no cached pages: every warning shows), warnings as errors."""
    out = tmp_path_factory.mktemp("book")
    source = out / "notebooks"
    for lang in EDITIONS:
        shutil.copytree(ROOT / "notebooks" / lang, source / lang, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    SOURCE["notebooks"] = source
    p = subprocess.run(
        [sys.executable, str(ROOT / "book" / "build.py"), "-W", "--out", str(out), "--notebooks", str(source)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert p.returncode == 0, "the book build failed (warnings are errors):\n" + p.stdout[-4000:] + p.stderr[-4000:]
    return out / "html"


def test_one_edition_per_language_with_every_chapter(site):
    for lang in EDITIONS:
        edition = site / lang
        names = {nb.stem for nb in notebooks(lang)}
        assert names, f"no notebooks in notebooks/{lang}"
        built = {p.stem for p in edition.glob("[0-9][0-9]_*.html")}
        assert built == names, f"{lang}: built {sorted(built)}, notebooks {sorted(names)}"
        # The edition's own front page leads to its first chapter, in its language.
        assert "00_start_here.html" in (edition / "index.html").read_text(encoding="utf-8")


def test_language_title_and_theme_labels(site):
    for lang in EDITIONS:
        edition = site / lang
        for page in pages(edition):
            text = page.read_text(encoding="utf-8")
            assert re.search(rf'<html\b[^>]*\blang="{lang}"', text), f"{page.relative_to(site)}: not lang={lang}"
        options = (edition / "_static" / "documentation_options.js").read_text(encoding="utf-8")
        assert re.search(rf"LANGUAGE:\s*'{lang}'", options), f"{lang}: search index language: {options}"
        for notebook in notebooks(lang):
            text = (edition / f"{notebook.stem}.html").read_text(encoding="utf-8")
            title = plain(re.search(r"<title>(.*?)</title>", text, re.S).group(1))
            assert chapter_title(notebook) in title, (notebook.name, title)
            if lang == "ja":
                # the chapter's title and the book's (book/ja/_config.yml) are both Japanese
                head, _, book_title = title.partition(" — ")
                assert JAPANESE.search(head) and JAPANESE.search(book_title), f"ja <title> not Japanese: {title!r}"
            else:
                assert not JAPANESE.search(title), f"en <title> has Japanese: {title!r}"
    ja_chapter = (site / "ja" / f"{CHAPTER}.html").read_text(encoding="utf-8")
    en_chapter = (site / "en" / f"{CHAPTER}.html").read_text(encoding="utf-8")
    assert "前へ" in ja_chapter and "次へ" in ja_chapter, "ja theme labels (Previous/Next) are not Japanese"
    assert "この本を検索" in ja_chapter and "Search this book" not in ja_chapter
    assert "Search this book" in en_chapter

    # tooltips and labels: none left in English on the ja page but two ARIA landmark names that
    # sphinx-book-theme writes in English in its templates (sidebar "Main", page "Page")
    def labels(page: str) -> set[str]:
        body = page[page.find("<body") :]
        return set(re.findall(r'\b(?:title|aria-label|placeholder|data-bs-title)="([^"]*)"', body))

    assert labels(ja_chapter) & labels(en_chapter) <= {"Main", "Page"}, labels(ja_chapter) & labels(en_chapter)


def test_no_line_break_between_japanese_characters(site):
    """A newline inside a paragraph is drawn as a space: between two Japanese characters it must not be there."""
    cjk = r"[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]"
    paragraphs = 0
    for notebook in notebooks("ja"):
        text = (site / "ja" / f"{notebook.stem}.html").read_text(encoding="utf-8")
        for paragraph in re.findall(r"<p>(.*?)</p>", text, re.S):
            words = re.sub(r"<[^>]+>", "", paragraph)
            breaks = re.findall(rf"{cjk}\s*\n\s*{cjk}", words)
            assert not breaks, f"ja/{notebook.stem}.html: a line break between Japanese characters: {breaks[:3]}"
            paragraphs += bool(JAPANESE.search(words))
    assert paragraphs > 50, f"only {paragraphs} Japanese paragraphs found"


def test_every_page_links_to_the_same_page_in_the_other_language(site):
    for lang, other in EDITIONS.items():
        edition = site / lang
        checked = 0
        for page in pages(edition):
            text = page.read_text(encoding="utf-8")
            links = hrefs(text, "bilingual-switch")
            assert len(links) == 1, f"{page.relative_to(site)}: {len(links)} links to the other language"
            target = resolve(page, links[0])
            assert target == (site / other / page.relative_to(edition)).resolve(), (page, links[0])
            assert target.exists(), f"{page.relative_to(site)} links to missing {links[0]}"
            assert re.search(rf'<link rel="alternate" hreflang="{other}" href="{re.escape(links[0])}"', text)
            checked += 1
        assert checked >= len(notebooks(lang)), f"{lang}: only {checked} pages checked"
    landing = (site / "index.html").read_text(encoding="utf-8")
    for lang in EDITIONS:
        links = [h for h in hrefs(landing) if h.startswith(f"{lang}/")]
        assert links, f"the landing page does not link the {lang} edition"
        for link in links:
            assert resolve(site / "index.html", link).exists(), link


def test_navigation_stays_in_one_language(site):
    for lang in EDITIONS:
        edition = site / lang
        chapters = [edition / f"{nb.stem}.html" for nb in notebooks(lang)]
        titles = [chapter_title(nb) for nb in notebooks(lang)]
        for i, page in enumerate(chapters):
            text = page.read_text(encoding="utf-8")
            # every link inside the site stays in this edition, but the one to the other language
            for href in hrefs(text):
                if urlsplit(href).scheme or href.startswith(("#", "mailto:")):
                    continue
                target = resolve(page, href)
                inside = target.is_relative_to(edition.resolve())
                assert inside or href in hrefs(text, "bilingual-switch"), f"{lang}/{page.name} links out: {href}"
            previous = [resolve(page, h) for h in hrefs(text, "left-prev")]
            following = [resolve(page, h) for h in hrefs(text, "right-next")]
            assert previous == ([chapters[i - 1].resolve()] if i else []), (page.name, previous)
            assert following == ([chapters[i + 1].resolve()] if i + 1 < len(chapters) else []), (page.name, following)
            # the sidebar lists this edition's chapters, titled in its language
            sidebar = re.search(r'<nav class="bd-links bd-docs-nav".*?</nav>', text, re.S).group(0)
            listed = [plain(t) for t in re.findall(r'<a class="[^"]*reference internal[^"]*"[^>]*>(.*?)</a>', sidebar, re.S)]
            assert listed == titles, f"{lang}/{page.name} sidebar: {listed}"


def test_outputs_and_figures_are_embedded(site):
    for lang in EDITIONS:
        edition = site / lang
        for notebook in notebooks(lang):
            page = edition / f"{notebook.stem}.html"
            text = page.read_text(encoding="utf-8")
            code = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
            with_outputs = [c for c in code if c.get("outputs")]
            assert text.count('class="cell_output') == len(with_outputs), f"{lang}/{page.name}: outputs missing"
            # every figure is in the page, byte for byte
            images = {
                hashlib.sha256(resolve(page, src).read_bytes()).hexdigest()
                for src in re.findall(r'<img\b[^>]*\bsrc="(_images/[^"]+)"', text)
            }
            for cell in code:
                for output in cell.get("outputs", []):
                    png = output.get("data", {}).get("image/png")
                    if png:
                        digest = hashlib.sha256(base64.b64decode("".join(png))).hexdigest()
                        assert digest in images, f"{lang}/{page.name}: a figure is missing"
                    # printed text: its first line is in the page
                    lines = [line.strip() for line in "".join(output.get("text", "")).splitlines() if line.strip()]
                    if lines:
                        assert html.escape(lines[0], quote=False) in text, f"{lang}/{page.name}: {lines[0]!r}"


SOLUTION_PROMPT = {"en": "Show the solution", "ja": "解答を表示"}  # book/_ext/solutions.py


def solution_cells(notebook: Path) -> list[dict]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [c for c in cells if c["cell_type"] == "code" and "solution" in c["metadata"].get("tags", [])]


def test_every_solution_is_collapsed_with_its_output(site):
    """A cell tagged `solution` is one closed <details> (MyST-NB's hide-cell) that holds its code and its output."""
    from bs4 import BeautifulSoup

    checked = 0
    for lang in EDITIONS:
        for notebook in notebooks(lang):
            where = f"{lang}/{notebook.stem}.html"
            page = BeautifulSoup((site / lang / f"{notebook.stem}.html").read_text(encoding="utf-8"), "html.parser")
            solutions = solution_cells(notebook)
            built = page.select("div.cell.tag_solution")
            assert len(built) == len(solutions), f"{where}: {len(built)} solution cells, the notebook has {len(solutions)}"
            # nothing else is collapsed: the chapter's own cells stay open
            assert len(page.select("div.cell details.hide")) == len(solutions), f"{where}: other cells are collapsed too"
            for cell, source in zip(built, solutions, strict=True):
                wrappers = cell.find_all(recursive=False)
                assert [w.name for w in wrappers] == ["details"], f"{where}: a solution is not one <details>: {wrappers}"
                details = wrappers[0]
                assert {"hide", "above-input"} <= set(details["class"]) and not details.has_attr("open"), (
                    f"{where}: a solution is not collapsed: {details.attrs}"
                )
                summary = details.find("summary", recursive=False)
                assert summary is not None and summary.find("p", class_="collapsed").get_text(strip=True) == SOLUTION_PROMPT[lang]
                # the code and every output are inside it, none beside it: the answer is not printed under the exercise
                inputs, outputs = details.select("div.cell_input"), details.select("div.cell_output")
                assert len(inputs) == 1 and len(outputs) == bool(source.get("outputs")), (where, len(inputs), len(outputs))
                assert len(cell.select("div.cell_input, div.cell_output")) == len(inputs) + len(outputs)
                first_line = "".join(source["source"]).splitlines()[0]
                assert plain(first_line) in plain(inputs[0].get_text()), f"{where}: the wrong cell is collapsed: {first_line!r}"
                checked += 1
    assert checked >= 30, f"only {checked} solutions checked"


HINT_PROMPT = {"en": "Hint", "ja": "ヒント"}  # a hint's <summary> in the notebooks: "Hint 1", "ヒント 1"


def exercise_parts(notebook: Path) -> tuple[int, int, list[str]]:
    """(exercises, hints, the check cells' sources) of a notebook: its exercise markdown, <details> hints, check cells."""
    from llmkit.course.exercises.notebook import DETAILS, EXERCISE

    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    checks = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "check" in c["metadata"].get("tags", [])]
    return sum(len(EXERCISE.findall(m)) for m in markdown), sum(len(DETAILS.findall(m)) for m in markdown), checks


def test_every_exercise_shows_its_answer_cell_its_check_and_its_hints_closed(site):
    """Under each exercise: its hints, each a closed <details>; its answer cell and its check, open, the check with
    its verdict ("not answered yet" in the committed notebooks); then the closed solution (the test above)."""
    from bs4 import BeautifulSoup

    exercises_seen = 0
    for lang in EDITIONS:
        for notebook in notebooks(lang):
            where = f"{lang}/{notebook.stem}.html"
            n_exercises, n_hints, checks = exercise_parts(notebook)
            page = BeautifulSoup((site / lang / f"{notebook.stem}.html").read_text(encoding="utf-8"), "html.parser")
            answers, verdicts = page.select("div.cell.tag_answer"), page.select("div.cell.tag_check")
            assert len(answers) == len(verdicts) == n_exercises == len(checks), (where, len(answers), len(verdicts), n_exercises)
            for cell in answers + verdicts:
                assert not cell.find("details") and cell.select("div.cell_input"), f"{where}: an answer or check cell is collapsed"
            for cell in verdicts:
                assert cell.select_one("div.cell_output .llmkit-verdict"), f"{where}: a check cell without its verdict"
            hints = [d for d in page.select("article details") if "hide" not in d.get("class", [])]
            assert len(hints) == n_hints and n_hints >= n_exercises, (where, len(hints), n_hints)
            for hint in hints:
                summary = hint.find("summary", recursive=False)
                assert not hint.has_attr("open") and summary.get_text(strip=True).startswith(HINT_PROMPT[lang]), (where, hint)
            exercises_seen += n_exercises
    assert exercises_seen >= 2 * 36, f"only {exercises_seen} exercises in the book"


# ---------------------------------------------------------------------------------------------------
# In a real browser


@pytest.fixture(scope="module")
def server(site):
    """The site over HTTP on loopback, as a reader would open it (python -m http.server)."""
    with serve_handler(functools.partial(QuietHandler, directory=str(site))) as url:
        yield url + "/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = chromium(tmp_path_factory.mktemp("chromium-profile"), window="1280,900", extra=("--hide-scrollbars",))
    driver.set_page_load_timeout(TIMEOUT)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def open_page(driver, url: str) -> None:
    driver.get(url)
    driver.execute_async_script("const done = arguments[0]; document.fonts.ready.then(() => done(true));")


def japanese_fonts() -> set[str]:
    """Font families installed on this machine that cover Japanese (fontconfig's own answer)."""
    if not shutil.which("fc-list"):
        return set()
    p = subprocess.run(["fc-list", ":lang=ja", "family"], capture_output=True, text=True, check=False)
    return {name.strip() for line in p.stdout.splitlines() for name in line.split(",") if name.strip()}


def fonts_used(driver, selector: str) -> list[dict]:
    """The fonts Chromium actually drew an element's text with (DevTools: CSS.getPlatformFontsForNode)."""
    driver.execute_cdp_cmd("DOM.enable", {})
    driver.execute_cdp_cmd("CSS.enable", {})
    document = driver.execute_cdp_cmd("DOM.getDocument", {"depth": -1})
    node = driver.execute_cdp_cmd("DOM.querySelector", {"nodeId": document["root"]["nodeId"], "selector": selector})
    assert node["nodeId"], f"no {selector} in the page"
    return driver.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": node["nodeId"]})["fonts"]


# Draws characters one by one in the element's own font and returns each one's pixels, hashed:
# missing glyphs all come out as the same box (the font's .notdef), real ones all differ.
GLYPHS = """
const [selector, chars] = arguments;
const style = getComputedStyle(document.querySelector(selector));
const canvas = document.createElement("canvas");
canvas.width = 64; canvas.height = 64;
const ctx = canvas.getContext("2d", {willReadFrequently: true});
const out = [];
for (const ch of chars) {
  ctx.clearRect(0, 0, 64, 64);
  ctx.font = `48px ${style.fontFamily}`;
  ctx.fillStyle = "#000";
  ctx.textBaseline = "top";
  ctx.fillText(ch, 4, 4);
  const data = ctx.getImageData(0, 0, 64, 64).data;
  let h = 0, ink = 0;
  for (let i = 3; i < data.length; i += 4) { h = (h * 31 + data[i]) >>> 0; if (data[i] > 0) ink++; }
  out.push({ch, hash: h, ink, width: ctx.measureText(ch).width});
}
return {lang: document.documentElement.lang, fontFamily: style.fontFamily, glyphs: out};
"""
TOFU = "\U0010fffd"  # a private-use code point no font draws: the missing-glyph box


def assert_japanese_glyphs(driver, selector: str, where: str) -> dict:
    text = driver.execute_script("return document.querySelector(arguments[0]).textContent", selector)
    chars = sorted(set(JAPANESE.findall(text)))[:12]
    assert len(chars) >= 3, f"{where}: {selector} has too little Japanese to check: {text!r}"
    result = driver.execute_script(GLYPHS, selector, [*chars, TOFU])
    *glyphs, tofu = result["glyphs"]
    boxes = [g["ch"] for g in glyphs if g["hash"] == tofu["hash"] or not g["ink"]]
    assert not boxes, f"{where}: {''.join(boxes)} drawn as missing-glyph boxes (tofu) in {result['fontFamily']}"
    assert len({g["hash"] for g in glyphs}) == len(glyphs), f"{where}: different characters drawn alike: {glyphs}"
    installed = japanese_fonts()
    used = fonts_used(driver, selector)
    cjk = [f for f in used if f["familyName"] in installed]
    assert installed, f"{where}: no font for Japanese is installed (make browser, or apt-get install fonts-noto-cjk)"
    assert cjk and sum(f["glyphCount"] for f in cjk) >= len(JAPANESE.findall(text)), (
        f"{where}: Japanese drawn with {used}, none of the Japanese fonts {sorted(installed)[:6]}"
    )
    return {"chars": "".join(chars), "fonts": [(f["familyName"], f["glyphCount"]) for f in used]}


def test_landing_page_in_a_browser(browser, server):
    from selenium.webdriver.common.by import By

    open_page(browser, server)
    editions = {e.get_attribute("hreflang"): e for e in browser.find_elements(By.CSS_SELECTOR, "a.edition")}
    assert set(editions) == {"en", "ja"}, editions
    for lang, link in editions.items():
        assert link.is_displayed() and link.size["width"] > 100, f"the {lang} edition's link is not visible"
    browser.save_screenshot(str(SCREENSHOTS / "landing.png"))  # first: a failure below leaves it to look at
    fonts = assert_japanese_glyphs(browser, "#edition-ja", "landing page")
    print(f"landing page: Japanese drawn with {fonts['fonts']}; screenshot {SCREENSHOTS / 'landing.png'}")
    editions["ja"].click()
    assert browser.current_url.endswith("/ja/00_start_here.html"), browser.current_url
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == "ja"


@pytest.mark.parametrize("lang", list(EDITIONS))
def test_chapter_in_a_browser(browser, server, lang):
    from selenium.webdriver.common.by import By

    other = EDITIONS[lang]
    open_page(browser, urljoin(server, f"{lang}/{CHAPTER}.html"))
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == lang
    assert chapter_title(SOURCE["notebooks"] / lang / f"{CHAPTER}.ipynb") in plain(browser.title)
    h1 = browser.find_element(By.CSS_SELECTOR, "article h1")
    assert h1.is_displayed()
    figure = browser.find_element(By.CSS_SELECTOR, "article .cell_output img")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", figure)
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", figure) > 100
    figure.screenshot(str(SCREENSHOTS / f"{lang}-{CHAPTER}-figure.png"))
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(SCREENSHOTS / f"{lang}-{CHAPTER}.png"))
    if lang == "ja":
        fonts = assert_japanese_glyphs(browser, "article h1", f"ja/{CHAPTER} title")
        assert_japanese_glyphs(browser, "article section p", f"ja/{CHAPTER} text")
        print(f"ja/{CHAPTER}: Japanese drawn with {fonts['fonts']}")
    switch = browser.find_element(By.CSS_SELECTOR, "a.bilingual-switch")
    assert switch.is_displayed() and switch.get_attribute("hreflang") == other
    switch.click()
    assert browser.current_url.endswith(f"/{other}/{CHAPTER}.html"), browser.current_url
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == other


@pytest.mark.parametrize("lang", list(EDITIONS))
def test_a_solution_opens_on_a_click(browser, server, lang):
    """In the browser a solution shows only its summary; one click shows its code and its output."""
    from selenium.webdriver.common.by import By

    open_page(browser, urljoin(server, f"{lang}/{CHAPTER}.html"))
    cell = browser.find_element(By.CSS_SELECTOR, "div.cell.tag_solution")
    summary = cell.find_element(By.CSS_SELECTOR, "details > summary")
    code = cell.find_element(By.CSS_SELECTOR, ".cell_input")
    output = cell.find_element(By.CSS_SELECTOR, ".cell_output")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", summary)
    assert summary.is_displayed() and summary.text.strip() == SOLUTION_PROMPT[lang], summary.text
    assert not code.is_displayed() and not output.is_displayed(), "the solution is open before a click"
    cell.screenshot(str(SCREENSHOTS / f"{lang}-{CHAPTER}-solution-closed.png"))
    summary.click()
    assert cell.find_element(By.CSS_SELECTOR, "details").get_attribute("open") is not None
    # the theme fades the opened content in (selenium counts opacity 0 as hidden): wait for the end of it
    wait_until(lambda: code.is_displayed() and output.is_displayed(), 10)
    cell.screenshot(str(SCREENSHOTS / f"{lang}-{CHAPTER}-solution-open.png"))


@pytest.mark.parametrize("lang", list(EDITIONS))
def test_a_hint_opens_on_a_click_above_the_answer_and_its_check(browser, server, lang):
    """An exercise in the browser: its first hint closed, opened by a click; its answer cell and check shown, the check's
    verdict in the reader's language."""
    from selenium.webdriver.common.by import By

    open_page(browser, urljoin(server, f"{lang}/{CHAPTER}.html"))
    hint = next(d for d in browser.find_elements(By.CSS_SELECTOR, "article details") if "hide" not in (d.get_attribute("class") or ""))
    summary = hint.find_element(By.TAG_NAME, "summary")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", summary)
    assert summary.text.strip().startswith(HINT_PROMPT[lang]) and hint.get_attribute("open") is None
    body = hint.find_element(By.CSS_SELECTOR, "p")
    assert not body.is_displayed(), "a hint is open before a click"
    summary.click()
    wait_until(body.is_displayed, 10)
    answer = browser.find_element(By.CSS_SELECTOR, "div.cell.tag_answer .cell_input")
    verdict = browser.find_element(By.CSS_SELECTOR, "div.cell.tag_check .llmkit-verdict")
    assert answer.is_displayed() and verdict.is_displayed()
    assert ("演習" in verdict.text) == (lang == "ja"), verdict.text  # the check's words in the edition's language
    hint.screenshot(str(SCREENSHOTS / f"{lang}-{CHAPTER}-hint-open.png"))


@pytest.mark.parametrize("lang", list(EDITIONS))
def test_search_finds_the_chapter_in_its_language(browser, server, lang):
    """Each edition has its own search index (Japanese is split into words by Sphinx's Japanese splitter)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    title = chapter_title(SOURCE["notebooks"] / lang / f"{CHAPTER}.ipynb")
    words = re.findall(r"[\u30a0-\u30ff\u4e00-\u9fff]{2,}", title) if lang == "ja" else []
    word = max(words or re.findall(r"[A-Za-z]{3,}", title), key=len)  # a Japanese word where the title has one
    open_page(browser, urljoin(server, f"{lang}/search.html?q={word}"))
    WebDriverWait(browser, TIMEOUT).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a"),
        f"{lang}: searching {word!r} found nothing",
    )
    found = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a")]
    assert any(urlsplit(h).path.endswith(f"/{lang}/{CHAPTER}.html") for h in found), (word, found)
    assert all(f"/{lang}/" in urlsplit(h).path for h in found), f"search left the {lang} edition: {found}"
