"""What the scheduler asks of the KV cache: ``KVMemory``, the part of ``llama.Context`` that slots and the prompt cache
use (llama.cpp's ``llama_memory_*`` and ``llama_state_seq_*``). ``llama.Context`` satisfies it; the fleet simulation's
``TokenMemory`` (``llmkit.course.sim.replica``) implements it over token counts, so the same ``Scheduler`` runs there.
"""

from __future__ import annotations

import mmap
from typing import Protocol


class KVMemory(Protocol):
    """Sequences of KV cells, one per slot (its id is the slot's index)."""

    n_ctx: int  # cells in all
    n_ctx_seq: int  # cells one sequence may hold

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop the sequence's cells at positions [p0, p1) (p1 < 0: to the end); False: this memory cannot cut there."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Sequence ``dst`` holds ``src``'s cells at [p0, p1) too (on a unified cache: the same cells, no copy)."""
        ...

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move the sequence's cells at [p0, p1) by ``delta`` positions."""
        ...

    def seq_state(self, seq_id: int) -> mmap.mmap:
        """A copy of the sequence's cells (what the prompt cache keeps)."""
        ...

    def set_seq_state(self, seq_id: int, data: mmap.mmap | bytearray) -> bool:
        """Replace the sequence's cells with a copy ``seq_state`` made; False: refused."""
        ...

    @property
    def can_shift(self) -> bool:
        """Whether cells can move to other positions (``seq_add``)."""
        ...
