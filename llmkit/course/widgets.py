"""ipywidgets apps for the notebooks: a translator that streams into the page, and a view of the engine stepped by hand.

    from llmkit.course.widgets import Translator
    t = Translator(seq.url)      # a sequential server's base URL
    t                            # shows: text box, language menu, button, output
    t.translate("Good morning", "French")   # the same, without a browser

The widget reads ``POST /translate/stream`` with ``client.stream_translation``
and appends each token to the output as it arrives, like the web UI does with fetch. The
button runs the translation in a background thread, so the kernel stays free
while tokens arrive; ``translate()`` runs in the caller's thread and returns
the whole text (what tests and notebook cells call).

    from llmkit.course.widgets import EngineView
    engine = Engine(config=EngineConfig(n_parallel=2, n_ctx=512), start=False)   # no thread: stepped by hand
    engine.complete("Once upon a time", max_tokens=8)
    view = EngineView(engine)    # shows: Step buttons, the waiting queue, each slot and its KV cells, the last batch
    view.step()                  # what the Step button does: one engine.step(), then the view redrawn
    engine_html(engine)          # the view's picture as HTML, for any engine between two steps (what tests read)
"""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Callable

import httpx
import ipywidgets as w

from llmkit.course import tr
from llmkit.course.client import stream_translation
from llmkit.engine import Engine, SlotStatus, StepRecord

# SmolLM2-135M follows a language name far better than a code ("fr", "ja").
LANGUAGES = ("French", "Japanese", "Spanish", "German", "Chinese", "Korean", "English")


def language_names() -> dict[str, str]:
    """Each language as the menu shows it, in the reader's language (the prompt still names it in English)."""
    return {"French": tr("French"), "Japanese": tr("Japanese"), "Spanish": tr("Spanish"), "German": tr("German"),
            "Chinese": tr("Chinese"), "Korean": tr("Korean"), "English": tr("English")}  # fmt: skip


class Translator(w.VBox):
    """Text in, language menu, Translate button; the translation streams into ``output``."""

    def __init__(self, url: str, *, text: str = "", target_lang: str = "French", languages=LANGUAGES):
        self.url = url.rstrip("/")
        self.input = w.Textarea(value=text, placeholder=tr("Text to translate"), layout=w.Layout(width="100%", height="6em"))
        names = language_names()
        self.language = w.Dropdown(options=[(names.get(name, name), name) for name in languages], value=target_lang, description=tr("to"))
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


# --- the engine, one step at a time ------------------------------------------------------------------------

MAX_BOXES = 128  # boxes in a slot's strip: past that, one box stands for several KV cells
TEXT_TAIL = 80  # characters of a slot's text shown (its end)
CELL_COLOURS = {"reused": "#2ca02c", "earlier": "#1f77b4", "last": "#ff7f0e"}  # newest last: a box shows its newest cell
STYLE = (
    "<style>.llmkit-engine{font:12px/1.5 monospace} .llmkit-engine .slot{margin:6px 0}"
    " .llmkit-engine i{display:inline-block;width:6px;height:11px;margin:0 1px 1px 0;vertical-align:middle}"
    " .llmkit-engine td,.llmkit-engine th{padding:0 8px;text-align:right}"
    + "".join(f" .llmkit-engine i.{kind}{{background:{colour}}}" for kind, colour in CELL_COLOURS.items())
    + "</style>"
)


def cell_kinds(slot: SlotStatus, n_last: int) -> list[str]:
    """What each of the slot's KV cells is, in position order: ``reused`` from the cache when its request
    started, written by an ``earlier`` step, or by the ``last`` step (the slot's last ``n_last`` cells)."""
    n_last = min(n_last, slot.n_cached)
    n_reused = min(slot.job.n_prompt_tokens_cache, slot.n_cached - n_last) if slot.job is not None else 0
    return ["reused"] * n_reused + ["earlier"] * (slot.n_cached - n_reused - n_last) + ["last"] * n_last


def strip(kinds: list[str], per_box: int) -> str:
    """One box per ``per_box`` cells, coloured as the newest cell in it (so a step's one new cell always shows)."""
    newest = list(CELL_COLOURS)
    groups = [kinds[i : i + per_box] for i in range(0, len(kinds), per_box)]
    return "".join(f'<i class="{max(group, key=newest.index)}"></i>' for group in groups)


def tail(text: str) -> str:
    return text if len(text) <= TEXT_TAIL else "…" + text[-TEXT_TAIL:]


def slot_state(slot: SlotStatus) -> str:
    """Idle, reading its prompt (k of n), or generating (tokens so far)."""
    if (job := slot.job) is None:
        return tr("idle")
    if job.status == "generating":
        return tr("request #{id}, generating (tokens generated: {n})", id=job.id_task, n=job.n_decoded)
    done = job.n_prompt_tokens_cache + job.n_prompt_tokens_processed
    return tr("request #{id}, reading its prompt: {done} of {n} tokens ({reused} reused)",
              id=job.id_task, done=done, n=job.n_prompt_tokens, reused=job.n_prompt_tokens_cache)  # fmt: skip


def slot_html(slot: SlotStatus, n_last: int, per_box: int, detokenize: Callable[[list[int]], str]) -> str:
    """A slot: its state, its KV cells as a strip, the end of its text (generated so far, or what an idle slot holds)."""
    cells = tr("{n} of {n_ctx} cells", n=slot.n_cached, n_ctx=slot.n_ctx)
    if slot.job is not None:
        text = tr("text so far: {text}", text=tail(detokenize(list(slot.tail)))) if slot.job.n_decoded else ""
    else:
        text = tr("holds: {text}", text=tail(detokenize(list(slot.tail)))) if slot.tail else ""
    return (
        f'<div class="slot" data-slot="{slot.id}"><b>{html.escape(tr("slot {id}", id=slot.id))}</b> · '
        f"{html.escape(slot_state(slot))} · {html.escape(cells)}<br>{strip(cell_kinds(slot, n_last), per_box)}"
        + (f'<br><span style="color:#555">{html.escape(text)}</span>' if text else "")
        + "</div>"
    )


def batch_html(step: StepRecord | None) -> str:
    """The last step's batch: who put how many prompt or generated tokens in it, who was sampled, how long it took."""
    if step is None:
        return html.escape(tr("no step has decoded anything yet"))
    drafts = any(share.n_draft for share in step.batch)  # speculation: a column for the drafts, when the step verified one
    rows = "".join(
        f"<tr><td>{share.slot}</td><td>{share.n_tokens if share.is_prompt else ''}</td>"
        f"<td>{'' if share.is_prompt else share.n_tokens}</td>"
        + (f"<td>{f'{share.n_accepted} / {share.n_draft}' if share.n_draft else ''}</td>" if drafts else "")
        + f"<td>{'✓' if share.sampled else ''}</td></tr>"
        for share in step.batch
    )
    labels = (tr("slot"), tr("prompt tokens"), tr("generated tokens"), *([tr("draft accepted")] if drafts else []), tr("sampled"))
    head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
    title = tr("last step: one llama_decode, batch of {n}, {ms:.0f} ms", n=step.n_prompt + step.n_generated, ms=step.seconds * 1e3)
    return f"{html.escape(title)}<table><tr>{head}</tr>{rows}</table>"


def engine_html(engine: Engine) -> str:
    """The engine at the end of its last step, as HTML: the waiting queue, each slot and its KV cells, the last
    step's batch. It draws ``engine.status()``, the snapshot the engine publishes: never a step half done."""
    status = engine.status()
    last = engine.steps[-1] if engine.steps else None
    # the cells the last step left: a rejected draft's are gone again
    written = {share.slot: share.n_tokens - share.n_draft + share.n_accepted for share in last.batch} if last is not None else {}
    per_box = max(1, math.ceil(max(slot.n_cached for slot in status.slots) / MAX_BOXES))
    waiting = ", ".join(tr("#{id} ({n} tokens)", id=r.id, n=r.n_prompt) for r in status.waiting) or tr("nobody")
    labels = {"reused": tr("reused from the cache"), "earlier": tr("written by earlier steps"), "last": tr("written by the last step")}
    legend = " ".join(f'<i class="{kind}"></i> {html.escape(label)}' for kind, label in labels.items())
    detokenize = engine.model.detokenize
    return (
        f'{STYLE}<div class="llmkit-engine">'
        f"{html.escape(tr('steps so far: {n}; waiting for a slot: {waiting}', n=status.counters.n_decode_total, waiting=waiting))}"
        + "".join(slot_html(slot, written.get(slot.id, 0), per_box, detokenize) for slot in status.slots)
        + f"{legend} · {html.escape(tr('KV cells per box: {n}', n=per_box))}<br>{batch_html(last)}</div>"
    )


class EngineView(w.VBox):
    """An engine with no thread (``start=False``), drawn after every step: Step, 10 steps, Run to the end.

    Each button runs ``engine.step()`` in the kernel's thread (a step of this small model takes milliseconds
    to a second), then redraws. An error (the engine's own thread runs its loop, the engine is closed) is shown
    under the buttons, not raised: a button's callback has nobody to raise it to.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.picture = w.HTML()
        self.message = w.HTML()
        self.error: str | None = None
        steps = {tr("Step"): 1, tr("10 steps"): 10, tr("Run to the end"): None}  # label: how many steps (None: until done)
        self.buttons = [w.Button(description=label) for label in steps]
        for button, n in zip(self.buttons, steps.values(), strict=True):
            button.on_click(lambda _, n=n: self.step(n))
        super().__init__([w.HBox(self.buttons), self.message, self.picture])
        self.refresh()

    def refresh(self, note: str = "") -> None:
        """Redraw the engine as it is now."""
        self.picture.value = engine_html(self.engine)
        shown, colour = (self.error, "crimson") if self.error else (note, "#555")
        self.message.value = f'<span style="color:{colour}">{html.escape(shown)}</span>'

    def step(self, n: int | None = 1) -> int:
        """Run ``n`` steps (None: until a step has nothing to decode), redrawing after each; returns how many decoded."""
        self.error, decoded, note = None, 0, ""
        try:
            while n is None or decoded < n:
                if self.engine.step() is None:
                    note = tr("nothing to decode: no request is running or waiting")
                    break
                decoded += 1
                self.refresh()
        except Exception as exc:  # noqa: BLE001 -- shown in the widget: a button's callback has nobody to raise to
            self.error = tr("Error: {error}", error=f"{type(exc).__name__}: {exc}")
        self.refresh(note)
        return decoded
