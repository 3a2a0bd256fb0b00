"""ipywidgets apps for the notebooks: a translator that streams into the page.

    from llmkit.course.widgets import Translator
    t = Translator(seq.url)      # a sequential server's base URL
    t                            # shows: text box, language menu, button, output
    t.translate("Good morning", "French")   # the same, without a browser

The widget reads ``POST /translate/stream`` with ``client.stream_translation``
and appends each token to the output as it arrives, like the web UI does with fetch. The
button runs the translation in a background thread, so the kernel stays free
while tokens arrive; ``translate()`` runs in the caller's thread and returns
the whole text (what tests and notebook cells call).
"""

from __future__ import annotations

import html
import threading

import httpx
import ipywidgets as w

from llmkit.course import tr
from llmkit.course.client import stream_translation

# SmolLM2-135M follows a language name far better than a code ("fr", "ja").
LANGUAGES = ("French", "Japanese", "Spanish", "German", "Chinese", "Korean", "English")


class Translator(w.VBox):
    """Text in, language menu, Translate button; the translation streams into ``output``."""

    def __init__(self, url: str, *, text: str = "", target_lang: str = "French", languages=LANGUAGES):
        self.url = url.rstrip("/")
        self.input = w.Textarea(value=text, placeholder=tr("Text to translate"), layout=w.Layout(width="100%", height="6em"))
        self.language = w.Dropdown(options=list(languages), value=target_lang, description=tr("to"))
        self.button = w.Button(description=tr("Translate"), button_style="primary", icon="language")
        self.output = w.HTML(layout=w.Layout(width="100%", min_height="3em"))
        self.status = w.Label()
        self.pieces: list[str] = []
        self.error: str | None = None
        self._busy = threading.Lock()
        self.button.on_click(lambda _: threading.Thread(target=self.translate, daemon=True).start())
        super().__init__([self.input, w.HBox([self.language, self.button]), self.output, self.status])

    @property
    def text(self) -> str:
        """The translation so far (everything streamed into the output)."""
        return "".join(self.pieces)

    def _show(self, text: str, color: str = "inherit") -> None:
        self.output.value = f'<div style="white-space: pre-wrap; color: {color}">{html.escape(text)}</div>'

    def translate(self, text: str | None = None, target_lang: str | None = None) -> str:
        """Stream a translation into the output; returns the text. Blocks until the stream ends."""
        if text is not None:
            self.input.value = text
        if target_lang is not None:
            self.language.value = target_lang
        with self._busy:  # one translation at a time per widget
            self.pieces, self.error = [], None
            self.button.disabled = True
            self.status.value = tr("translating...")
            self._show("")
            result = None

            def show(piece: str) -> None:
                self.pieces.append(piece)
                self._show(self.text)

            try:
                result = stream_translation(self.url, self.input.value, self.language.value, on_piece=show)
                if result.error is not None:  # a 4xx/5xx answer, or an error event mid-stream
                    self.error = str(result.error)
            except httpx.HTTPError as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.button.disabled = False
            if self.error or result is None:
                self._show(self.text + "\n" + tr("Error: {error}", error=self.error), "crimson")
                self.status.value = tr("error after {seconds:.2f} s", seconds=result.seconds) if result else tr("error")
            else:
                self.status.value = tr(
                    "{n} pieces in {seconds:.2f} s, first after {ttft:.2f} s", n=len(self.pieces), seconds=result.seconds, ttft=result.ttft
                )
            return self.text
