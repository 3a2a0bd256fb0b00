"""The notebooks' widgets, driven without a browser: the translator against a real sequential server, and
the engine view on a real engine stepped by hand."""

from __future__ import annotations

import html
import re
from collections import Counter
from pathlib import Path

import httpx
import pytest

from llmkit.course import launch
from llmkit.course.widgets import LANGUAGES, EngineView, Translator, engine_html
from llmkit.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def server():
    with launch.serve("sequential", "--temp", "0", "-n", "24", "-t", "1") as s:
        yield s


def test_translate_streams_into_the_output(server):
    widget = Translator(server.url)
    text = widget.translate("Good morning, my friend.", "French")
    assert text and widget.error is None
    assert len(widget.pieces) > 1  # it arrived token by token
    assert widget.output.value.endswith("</div>") and html.escape(text) in widget.output.value
    assert not widget.button.disabled
    # the same text as the non-streaming endpoint (greedy)
    r = httpx.post(f"{server.url}/translate", json={"text": "Good morning, my friend.", "target_lang": "French"}, timeout=60)
    assert r.json()["translation"] == text


def test_an_error_answer_is_shown(server):
    widget = Translator(server.url)
    assert widget.translate("", "French") == ""
    assert widget.error == "'text' is required"
    assert "Error: &#x27;text&#x27; is required" in widget.output.value


# --- the engine view ---------------------------------------------------------------------------------------


@pytest.fixture
def engine(model):
    """Two slots of 256 tokens, a budget of 8 tokens a step while a stream runs: prompts are read in chunks."""
    with Engine(model, EngineConfig(n_parallel=2, n_ctx=512, n_threads=1, step_tokens=8), start=False) as e:
        yield e


def boxes(page: str, slot_id: int) -> Counter:
    """How many boxes of each kind the slot's strip shows."""
    block = re.search(rf'<div class="slot" data-slot="{slot_id}">(.*?)</div>', page)
    assert block, f"no slot {slot_id} in the page"
    return Counter(re.findall(r'<i class="(\w+)"></i>', block.group(1)))


def test_the_page_shows_the_queue_the_prompt_progress_and_the_cells(engine):
    story = engine.complete("Once upon a time", max_tokens=6, temperature=0)
    engine.step()  # the story's prompt, alone: read whole; it generates from now on
    late = engine.complete("The harbour opens at six and the first boats leave before sunrise. " * 2, max_tokens=2, temperature=0)
    third = engine.complete("Hello", max_tokens=1)
    for _ in range(2):
        engine.step()
    job = engine.slots[late.id_slot].job
    assert job is not None and 0 < job.n_prompt_done < len(late.prompt)  # the budget: still reading it

    page = engine_html(engine)
    assert f"waiting for a slot: #{third.id} ({len(third.prompt)} tokens)" in page
    assert f"request #{late.id}, reading its prompt: {job.n_prompt_done} of {len(late.prompt)} tokens" in page
    assert f"request #{story.id}, generating (tokens generated: {len(engine.slots[story.id_slot].job.output)})" in page
    last = {share.slot: share.n_tokens for share in engine.steps[-1].batch}
    for slot in engine.slots:  # one box per cell (short contexts); the last step's cells in its colour
        assert f"{slot.n_past} of {slot.n_ctx} cells" in page
        assert boxes(page, slot.id) == Counter({"earlier": slot.n_past - last[slot.id], "last": last[slot.id]})
    assert f"batch of {sum(last.values())}" in page


def test_a_reused_prefix_shows_as_reused_cells(engine):
    text = "The harbour opens at six and the first boats leave before sunrise."
    first = engine.complete(text, max_tokens=2, temperature=0)
    while not first.done:
        engine.step()
    again = engine.complete(text + " By noon", max_tokens=2, temperature=0)
    engine.step()
    assert again.id_slot == first.id_slot and again.n_cached > 0
    kinds = boxes(engine_html(engine), again.id_slot)
    assert kinds == Counter({"reused": again.n_cached, "last": len(again.prompt) - again.n_cached})


def test_the_step_button_runs_one_step(engine):
    r = engine.complete("Once upon a time", max_tokens=3, temperature=0)
    view = EngineView(engine)
    assert "steps so far: 0" in view.picture.value and f"#{r.id} (" in view.picture.value
    step, to_the_end = view.buttons[0], view.buttons[-1]
    step.click()
    assert engine.counters.n_decode_total == 1 and "steps so far: 1" in view.picture.value
    assert view.picture.value == engine_html(engine)
    to_the_end.click()
    assert r.done and r.outcome.n_output == 3 and "nothing to decode" in view.message.value
    assert view.picture.value == engine_html(engine)


def test_an_error_is_shown_in_the_view_not_raised(model):
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=256, n_threads=1)) as running:  # its own thread runs the loop
        view = EngineView(running)
        assert view.step() == 0
    assert view.error is not None and "start=False" in view.error and "crimson" in view.message.value


def test_the_language_menu_names_languages_in_the_readers_language_and_sends_them_in_english(monkeypatch):
    from llmkit.course import words

    monkeypatch.chdir(Path(__file__).resolve().parent.parent / "notebooks" / "ja")  # the Japanese edition's folder
    words.catalog.cache_clear()
    try:
        menu = Translator("http://127.0.0.1:9", target_lang="Japanese").language  # no request is made
        shown = {value: label for label, value in menu.options}
        assert shown["French"] == "フランス語" and menu.value == "Japanese"  # shown in Japanese ...
        assert [value for _, value in menu.options] == list(LANGUAGES)  # ... the prompt still names it in English
    finally:
        words.catalog.cache_clear()
