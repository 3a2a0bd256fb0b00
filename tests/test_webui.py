"""The sequential server's web UI in a real browser (headless Chromium via selenium).

Debian's chromium and chromedriver are used directly (``helpers.chromium``), so
selenium-manager never tries to download a browser or a driver (there is no
internet here). ``make test`` installs them; by hand: ``make browser``.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from helpers import chromium

LANGUAGES = ["ja", "en", "zh", "ko", "fr", "de", "es"]
TIMEOUT = 60  # seconds: a whole translation on a CPU, with room to spare

# Installed in the page before typing: every 2 ms, note the output text while it
# is streaming. Sampling inside the page sees each network read separately
# (tokens from one read are appended within one task, so a single blob shows up
# as a single sample), at a rate no WebDriver round trip can match.
SAMPLER = """
const out = document.getElementById("output");
window.__samples = [];
window.__sampler = setInterval(() => {
  if (out.dataset.state !== "streaming") return;
  const text = out.textContent;
  if (!text) { window.__samples = []; return; }  // a new request started afresh
  const s = window.__samples;
  if (s[s.length - 1] !== text) s.push(text);
}, 2);
"""


@pytest.fixture
def browser(tmp_path):
    driver = chromium(tmp_path / "chromium-profile", capabilities={"goog:loggingPrefs": {"browser": "ALL"}})
    driver.set_page_load_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser, sequential_server):
    """The UI, opened, with its model menu filled from GET /models."""
    browser.get(sequential_server.url + "/")
    WebDriverWait(browser, TIMEOUT).until(
        lambda d: any(o.get_attribute("value") for o in Select(d.find_element(By.ID, "model")).options),
        "the model menu was never filled from GET /models",
    )
    return browser


def output_state(driver) -> tuple[str, str]:
    out = driver.find_element(By.ID, "output")
    return out.get_attribute("data-state"), out.text


def wait_for_state(driver, *states: str) -> tuple[str, str]:
    WebDriverWait(driver, TIMEOUT).until(
        lambda d: output_state(d)[0] in states,
        f"#output never reached data-state {states}",
    )
    return output_state(driver)


def test_page_shows_languages_and_models(page, sequential_server):
    assert "Translation" in page.title
    assert page.find_element(By.TAG_NAME, "h1").text.strip()
    assert output_state(page) == ("idle", "")

    lang = Select(page.find_element(By.ID, "target-lang"))
    assert [o.get_attribute("value") for o in lang.options] == LANGUAGES
    assert lang.first_selected_option.get_attribute("value") == "ja"

    with urllib.request.urlopen(sequential_server.url + "/models", timeout=TIMEOUT) as response:
        catalog = json.load(response)["models"]
    selected = [m["name"] for m in catalog if m["selected"]]
    assert len(selected) == 1, catalog
    model = Select(page.find_element(By.ID, "model"))
    assert [o.get_attribute("value") for o in model.options] == [m["name"] for m in catalog]
    assert model.first_selected_option.get_attribute("value") == selected[0]
    for option, entry in zip(model.options, catalog, strict=True):
        assert option.text.startswith(f"{entry['name']} ({entry['params']})")

    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_typing_streams_a_translation(page):
    Select(page.find_element(By.ID, "target-lang")).select_by_value("fr")
    page.execute_script(SAMPLER)
    page.find_element(By.ID, "input").send_keys("Hello, world.")

    state, text = wait_for_state(page, "done", "error")
    page.execute_script("clearInterval(window.__sampler)")
    assert state == "done", text
    assert text.strip()

    # Streamed, not one final blob: partial text was on screen before the end,
    # and each partial text is a prefix of the next (tokens are appended).
    samples = page.execute_script("return window.__samples")
    final = page.execute_script("return document.getElementById('output').textContent")
    seen = [s for s in samples if s != final] + [final]
    assert len(seen) >= 2, f"the output appeared in one piece: {samples!r}"
    for shorter, longer in itertools.pairwise(seen):
        assert longer.startswith(shorter) and len(longer) > len(shorter), seen


def test_clearing_the_input_clears_the_output(page):
    field = page.find_element(By.ID, "input")
    field.send_keys("Good morning.")
    WebDriverWait(page, TIMEOUT).until(lambda d: output_state(d)[1], "no translation appeared")

    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    assert field.get_attribute("value") == ""
    assert wait_for_state(page, "idle") == ("idle", "")

    # A stream still running when the input was cleared was aborted: nothing more arrives.
    for _ in range(10):
        time.sleep(0.1)
        assert output_state(page) == ("idle", "")


def test_server_error_is_shown(page):
    # A prompt longer than the model's context: the server refuses it, and the UI says so.
    page.execute_script(
        """const input = document.getElementById("input");
        input.value = "word ".repeat(5000);
        input.dispatchEvent(new Event("input"));"""
    )
    state, text = wait_for_state(page, "done", "error")
    assert state == "error", text[:200]
    assert text.startswith("Error: ")
