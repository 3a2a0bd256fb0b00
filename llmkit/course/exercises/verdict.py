"""What a check found (``Verdict``) and its statuses: the bottom of the exercises, which the progress store (``done``)
and the checks (``core``) both read.

    pass            the answer is right (the check's note says what was measured)
    fail            it differs (the message says where, never what is right)
    not answered    still ``...``: nothing tried, nothing recorded
    error           the learner's code raised (their traceback), or the check itself could not run
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from llmkit.course import tr

PASS, FAIL, UNANSWERED, ERROR = "pass", "fail", "not answered", "error"
STATUSES = (PASS, FAIL, UNANSWERED, ERROR)

# What a grading run reads back from a check cell's output: in the output's metadata, not a mime type of its own
# (a book would have to render one), under this key
VERDICT_KEY = "llmkit_verdict"
MARKS = {PASS: "✓", FAIL: "✗", UNANSWERED: "…", ERROR: "✗"}
COLOURS = {PASS: ("#e6f4ea", "#1e7b34"), FAIL: ("#fdecea", "#b3261e"), UNANSWERED: ("#f1f3f4", "#5f6368"), ERROR: ("#fdecea", "#b3261e")}


@dataclass(frozen=True)
class Verdict:
    """What a check found: ``status`` (pass, fail, not answered, error), a one-paragraph ``message``, and for an
    error the learner's traceback (``detail``)."""

    chapter: int
    number: int
    status: str
    message: str
    detail: str = ""
    theirs: bool = True  # an error: raised by the learner's code (else the check itself could not run)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def __bool__(self) -> bool:
        return self.passed

    def headline(self) -> str:
        words = {
            PASS: tr("correct"),
            FAIL: tr("not yet"),
            UNANSWERED: tr("not answered yet"),
            ERROR: tr("your code raised an error") if self.theirs else tr("the check could not run"),
        }
        return tr("Exercise {chapter}.{number}", chapter=self.chapter, number=self.number) + f" {MARKS[self.status]} {words[self.status]}"

    def __str__(self) -> str:
        return "\n".join(part for part in (f"{self.headline()}: {self.message}", self.detail.rstrip()) if part)

    def to_json(self) -> dict:
        return {"chapter": self.chapter, "number": self.number, "status": self.status, "message": self.message}

    def _repr_html_(self) -> str:
        back, ink = COLOURS[self.status]
        detail = (
            f'<pre style="margin:0.4em 0 0 0; font-size:85%; white-space:pre-wrap">{html.escape(self.detail)}</pre>' if self.detail else ""
        )
        return (
            f'<div class="llmkit-verdict llmkit-{self.status.replace(" ", "-")}" style="background:{back}; '
            f'border-left:4px solid {ink}; padding:0.4em 0.8em; margin:0.2em 0">'
            f'<strong style="color:{ink}">{html.escape(self.headline())}</strong>: {html.escape(self.message)}{detail}</div>'
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return {"text/plain": str(self), "text/html": self._repr_html_()}, {VERDICT_KEY: self.to_json()}
