"""Shared prefix cells (``kv_share``) on a model of llama.cpp's unified KV cache, no model: milliseconds.

``UnifiedKV`` keeps what llama.cpp's unified cache keeps per cell, a position, the token written there and the set of
sequences that hold it (``llama_kv_cells``): ``seq_cp`` adds a sequence to cells, ``seq_rm`` takes it away (a cell no
sequence holds is free), ``seq_add`` moves cells, and refuses, as a test must, to move a cell another sequence holds
(llama.cpp would move it for both: the other sequence's cache would silently hold a token at the wrong place). The
slots (``Slot``) and the choice of a donor (``scheduler.prefix_donor``) are the engine's own code. After every
operation each slot's ``cache_tokens`` must be exactly its cells, the cells in use exactly one per distinct prefix
position held (a prefix shared by N sequences is held once), and the cells the engine counts (``status.Cells``, what
``/metrics`` reports) exactly the model's.
"""

from __future__ import annotations

import random

import pytest

from llmkit.engine.scheduler import prefix_donor, waits_for_cells
from llmkit.engine.slot import Slot
from llmkit.engine.status import Cells


class UnifiedKV:
    """A unified KV cache's cells: id -> [pos, token, seqs] (what ``Slot`` asks of ``llama.Context``, and ``write``)."""

    can_shift = True

    def __init__(self) -> None:
        self.cells: dict[int, list] = {}
        self.next_id = 0

    def held(self, seq: int) -> list[list]:
        return sorted((c for c in self.cells.values() if seq in c[2]), key=lambda c: c[0])

    def write(self, seq: int, pos: int, tokens: list[int]) -> None:
        """What a decode does: new cells for ``tokens`` at ``pos``, ``pos + 1``, ... of ``seq``."""
        for k, token in enumerate(tokens):
            self.cells[self.next_id] = [pos + k, token, {seq}]
            self.next_id += 1

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        for key, cell in list(self.cells.items()):
            if seq in cell[2] and p0 <= cell[0] and (p1 < 0 or cell[0] < p1):
                cell[2].discard(seq)
                if not cell[2]:
                    del self.cells[key]
        return True

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        for cell in self.cells.values():
            if src in cell[2] and p0 <= cell[0] and (p1 < 0 or cell[0] < p1):
                cell[2].add(dst)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        for cell in self.cells.values():
            if seq in cell[2] and p0 <= cell[0] < p1:
                assert cell[2] == {seq}, f"sequence {seq} moved a cell that {cell[2] - {seq}} hold too"
                cell[0] += delta


def check(kv: UnifiedKV, slots: list[Slot]) -> None:
    for slot in slots:
        cells = kv.held(slot.id)
        assert [c[0] for c in cells] == list(range(len(cells))), f"slot {slot.id}: its positions"
        assert [c[1] for c in cells] == slot.cache_tokens, f"slot {slot.id}: its cells are its cache_tokens"
    prefixes = {tuple(s.cache_tokens[: n + 1]) for s in slots for n in range(len(s.cache_tokens))}
    shared = {(c[0], tuple(c[2])) for c in kv.cells.values() if len(c[2]) > 1}
    assert len(kv.cells) >= len(prefixes)  # never fewer cells than distinct prefixes ...
    assert shared or len(kv.cells) == sum(map(len, (s.cache_tokens for s in slots)))  # ... and sharing is what saves cells
    counted = Cells.of(slots, Cells.holders(slots))  # what /metrics reports, from the slots' own bookkeeping
    assert all(len(slot.cells) == slot.n_past for slot in slots)
    assert (counted.used, counted.shared) == (len(kv.cells), sum(len(c[2]) > 1 for c in kv.cells.values()))


def launch(kv: UnifiedKV, slots: list[Slot], slot: Slot, prompt: list[int], n_cache_reuse: int | None = None) -> int:
    """What Engine.launch and the prompt's steps do with kv_share: take a donor's cells, keep what the slot holds, read
    the rest. Returns how many prompt tokens were read."""
    if (found := prefix_donor(slots, slot, prompt)) is not None:
        slot.share_from(kv, *found)  # type: ignore[arg-type]
    n_keep, _ = slot.reuse(kv, prompt, True, n_cache_reuse)  # type: ignore[arg-type]
    kv.write(slot.id, n_keep, prompt[n_keep:])
    slot.append(prompt[n_keep:])
    return len(prompt) - n_keep


SYSTEM = list(range(100, 140))  # a tenant's 40-token prefix


def test_a_prefix_another_slot_holds_is_taken_not_read_and_held_once():
    kv, slots = UnifiedKV(), [Slot(i, 4096) for i in range(3)]
    assert launch(kv, slots, slots[0], [*SYSTEM, 1, 2, 3]) == 43
    assert launch(kv, slots, slots[1], [*SYSTEM, 4, 5]) == 2  # the 40 shared cells taken with seq_cp
    assert launch(kv, slots, slots[2], [*SYSTEM, 1, 2, 9]) == 1  # the longest holder: slot 0, 42 tokens
    check(kv, slots)
    assert len(kv.cells) == 43 + 2 + 1  # one prefix and three suffixes
    assert [len(c[2]) for c in sorted(kv.cells.values(), key=lambda c: c[0])][:40] == [3] * 40


def test_the_last_token_of_a_whole_prompt_held_elsewhere_is_read_again():
    kv, slots = UnifiedKV(), [Slot(i, 4096) for i in range(2)]
    launch(kv, slots, slots[0], [*SYSTEM, 1])
    assert launch(kv, slots, slots[1], [*SYSTEM, 1]) == 1  # its logits are needed: llama-server's rule too
    check(kv, slots)


def test_shared_cells_never_move_cache_reuse_and_context_shift_keep_them_in_place():
    kv, slots = UnifiedKV(), [Slot(i, 64) for i in range(2)]
    launch(kv, slots, slots[0], [*SYSTEM, *range(10)])
    launch(kv, slots, slots[1], [*SYSTEM, *range(20, 30)])
    # slot 0 gets a prompt whose first tokens differ, then repeats its old ones: --cache-reuse would move them back,
    # but they are shared with slot 1, so they are read instead
    read = launch(kv, slots, slots[0], [7, *SYSTEM[5:]], n_cache_reuse=4)
    assert read == 36
    check(kv, slots)
    slots[1].shift_context(kv, n_keep=4)  # type: ignore[arg-type]  # keeps at least its shared cells
    check(kv, slots)


@pytest.mark.parametrize("seed", range(20))
def test_any_sequence_of_operations_keeps_every_slot_exactly_its_cells(seed):
    rng, kv, slots = random.Random(seed), UnifiedKV(), [Slot(i, 96) for i in range(4)]
    prefixes = [list(range(100 * k, 100 * k + rng.randrange(5, 40))) for k in range(1, 4)]
    for _ in range(60):
        slot = rng.choice(slots)
        op = rng.choice(["launch", "launch", "generate", "reject", "shift", "clear"])
        if op == "launch":
            prompt = [*rng.choice(prefixes), *(rng.randrange(10) for _ in range(rng.randrange(1, 12)))]
            launch(kv, slots, slot, prompt[:90], n_cache_reuse=rng.choice([None, 3]))
        elif op == "generate" and slot.n_past < 90:
            tokens = [rng.randrange(10) for _ in range(rng.randrange(1, 6))]
            kv.write(slot.id, slot.n_past, tokens)
            slot.append(tokens)
        elif op == "reject" and slot.n_past:  # a rejected draft: cut back
            slot.truncate(kv, rng.randrange(slot.n_past))  # type: ignore[arg-type]
        elif op == "shift" and slot.n_past > 8:
            slot.shift_context(kv, rng.randrange(4))  # type: ignore[arg-type]
        elif op == "clear":
            slot.clear_prompt(kv)  # type: ignore[arg-type]
        check(kv, slots)


def test_a_request_waits_for_the_prefix_a_slot_is_reading_not_for_one_held_already():
    class Reading:  # what waits_for_cells reads of a job: its context, and whether it is all in
        def __init__(self, context: list[int], done: int):
            self.context, self.is_generating = context, done == len(context)

    slots = [Slot(i, 4096) for i in range(2)]
    slots[0].job = Reading([*SYSTEM, 1, 2], 0)  # type: ignore[assignment]  # reading its 42 tokens
    assert waits_for_cells(slots, [*SYSTEM, 3], min_shared=32)  # 40 coming: wait for them
    assert not waits_for_cells(slots, [*SYSTEM[:20], 3], min_shared=32)  # 20: read them
    slots[1].cache_tokens = SYSTEM[:30]  # 30 of them held already: 10 more coming is not worth a wait
    assert not waits_for_cells(slots, [*SYSTEM, 3], min_shared=32)
    slots[0].job = Reading([*SYSTEM, 1, 2], 42)  # type: ignore[assignment]  # read: nothing to wait for
    assert not waits_for_cells(slots, [*SYSTEM, 3], min_shared=32)
