"""The typed blocks of a streamed answer, one open at a time: what the Responses and Messages dialects both write.

Both APIs write an answer as a list of typed blocks, text or a tool call (Responses' output items, Messages'
content blocks). A stream starts a block, writes deltas into it, and stops it when a delta of another kind comes
(a call after text, text after a call), when the next call starts, or when the answer ends. ``Blocks`` is that
state machine, once; each dialect says what its events are (``BlockEvents``).

    blocks = Blocks(my_events)
    blocks.push(deltas)        # per piece: started / wrote events, a stopped one where a block ends
    blocks.close(status)       # at the end: the open block's stopped events
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from llmkit.server.tools import Delta

Kind = Literal["text", "call"]


class BlockEvents(Protocol):
    """A dialect's events for its typed blocks (``index``: the block's place in the answer, from 0)."""

    def started(self, index: int, delta: Delta) -> list[dict]:
        """A block begins: text (``delta.index < 0``), or the call that ``delta`` names."""
        ...

    def wrote(self, index: int, delta: Delta) -> list[dict]:
        """A piece of its text or of its call's arguments."""
        ...

    def stopped(self, index: int, written: str, status: str) -> list[dict]:
        """It ends: ``written`` is all it wrote; ``status``: how the answer stood when it closed."""
        ...


@dataclass
class Blocks:
    """The blocks a stream has started, and the open one (its kind, what it has written)."""

    events: BlockEvents
    n: int = 0  # blocks started so far; the open one, if any, is the last
    kind: Kind | None = None  # the open block's kind; None: none is open
    written: list[str] = field(default_factory=list)  # what the open block has written so far

    def push(self, deltas: list[Delta]) -> list[dict]:
        """A piece's deltas as events: a new block where the kind changes or a call starts, then what it writes."""
        events: list[dict] = []
        for d in deltas:
            kind: Kind = "text" if d.index < 0 else "call"
            if kind != self.kind or d.name:
                events += self.close("completed")
                self.n, self.kind, self.written = self.n + 1, kind, []
                events += self.events.started(self.n - 1, d)
            if written := d.content or d.arguments:
                self.written.append(written)
                events += self.events.wrote(self.n - 1, d)
        return events

    def close(self, status: str) -> list[dict]:
        """Stop the open block, if any."""
        if self.kind is None:
            return []
        self.kind = None
        return self.events.stopped(self.n - 1, "".join(self.written), status)
