"""The notebook translator widget, driven without a browser against a real sequential server."""

from __future__ import annotations

import html

import httpx
import pytest

from llmkit.course import launch
from llmkit.course.widgets import Translator


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
