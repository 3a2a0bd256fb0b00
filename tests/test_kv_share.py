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

from llmkit.course.sim.replica import start_job
from llmkit.engine.config import EngineConfig
from llmkit.engine.kv_events import DEVICE, KVEventTracker, Mirror, block_names
from llmkit.engine.policy import POLICIES
from llmkit.engine.request import End, Request, RequestParams, Status
from llmkit.engine.scheduler import Scheduler
from llmkit.engine.sharing import prefix_donor, waits_for_cells
from llmkit.engine.slot import Slot
from llmkit.engine.status import Cells
from llmkit.engine.steps import Counters
from llmkit.engine.tokens import common_prefix
from llmkit.llama import KVCacheFullError


class UnifiedKV:
    """A unified KV cache's cells: id -> [pos, token, seqs] (what ``Slot`` asks of ``llama.Context``, and ``write``);
    ``limit``: how many cells it has (a decode that needs more raises ``KVCacheFullError``, as llama.cpp's)."""

    can_shift = True

    def __init__(self, limit: int = 1 << 30) -> None:
        self.cells: dict[int, list] = {}
        self.next_id = 0
        self.n_ctx = self.n_ctx_seq = self.limit = limit

    def held(self, seq: int) -> list[list]:
        return sorted((c for c in self.cells.values() if seq in c[2]), key=lambda c: c[0])

    def write(self, seq: int, pos: int, tokens: list[int]) -> None:
        """What a decode does: new cells for ``tokens`` at ``pos``, ``pos + 1``, ... of ``seq``."""
        if len(self.cells) + len(tokens) > self.limit:
            raise KVCacheFullError(f"{len(tokens)} cells wanted, {self.limit - len(self.cells)} free")
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


# --- the scheduler's own decisions on that model: resident prefixes (kv_resident), reference counts, eviction ---------


class Served:
    """A ``Scheduler`` with ``kv_share`` over ``UnifiedKV``, stepped as the engine steps it (admit, plan, decode with
    ``clear_idle_slot`` when the cache is full, commit, sample: each answer is ``n_answer`` tokens 7), and after every
    step checked against the model: every sequence's cells, each cell's reference count (how many sequences hold it), the
    cells ``/metrics`` counts, and what the KV events told a reader (``Mirror``) against the blocks the sequences hold."""

    def __init__(self, n_slots: int = 2, n_resident: int = 2, limit: int = 1 << 30, block_size: int = 4, policy: str = "llama-server"):
        config = EngineConfig(
            n_parallel=n_slots,
            n_ctx=4096,
            kv_unified=True,
            kv_share=True,
            kv_resident=n_resident,
            cache_ram_mib=0,
            policy=POLICIES[policy](),
        )
        self.kv, self.block_size = UnifiedKV(limit), block_size
        self.scheduler = Scheduler(config.resolved(), self.kv, start_job, Counters())  # type: ignore[arg-type]
        self.events, self.told = KVEventTracker(block_size, shares=True), Mirror()
        self.n_answer: dict[int, int] = {}
        self.n_read = 0  # prompt tokens decoded

    def submit(self, prompt: list[int], n_answer: int = 2) -> Request:
        request = Request(prompt, RequestParams(max_tokens=n_answer))
        self.n_answer[request.id] = n_answer
        self.scheduler.add(request)
        return request

    def step(self) -> None:
        self.scheduler.admit()
        plan = self.scheduler.plan(512, {})
        while True:
            try:
                for chunk in plan:
                    self.kv.write(chunk.slot.id, chunk.pos, chunk.tokens)
                break
            except KVCacheFullError:
                for chunk in plan:
                    self.kv.seq_rm(chunk.slot.id, chunk.pos, -1)
                assert self.scheduler.clear_idle_slot(), "the cache is full of cells running requests hold"
        Scheduler.commit(plan)
        self.n_read += sum(len(chunk.tokens) for chunk in plan if chunk.is_prompt)
        for chunk in [c for c in plan if c.i_logits >= 0]:
            job = chunk.job
            job.last_token = 7
            job.output.append(7)
            if len(job.output) == self.n_answer[job.request.id]:
                self.scheduler.end(job.request, job.outcome(End.LIMIT, chunk.slot.id, chunk.slot.n_past), chunk.slot)
        self.told.apply(self.events.update(self.scheduler.holders, None))
        self.check()

    def run(self, *requests: Request) -> None:
        while not all(r.done for r in requests):
            self.step()
        assert all(r.error is None for r in requests)

    def check(self) -> None:
        holders = self.scheduler.holders
        check(self.kv, holders)
        physical: dict[int, set[int]] = {}  # the model's cell -> the ids the sequences' bookkeeping gives it
        for holder in holders:
            for cell, model_cell in zip(holder.cells, self.kv.held(holder.id), strict=True):
                physical.setdefault(id(model_cell), set()).add(cell)
        assert all(len(ids) == 1 for ids in physical.values()), "one cell, one id"
        counts = Cells.holders(holders)
        for model_cell in self.kv.cells.values():
            (cell,) = physical[id(model_cell)]
            assert counts[cell] == len(model_cell[2]), "a cell's reference count is the sequences that hold it"
        blocks = {name for h in holders for name in block_names(h.cache_tokens, self.block_size, 0, None)}
        assert set(self.told.tiers.get(DEVICE, {})) == blocks, "the KV events told exactly the blocks held"

    def resident(self) -> list[list[int]]:
        return [r.cache_tokens for r in self.scheduler.resident if r.cache_tokens]


T1, T2, T3 = (list(range(k, k + 40)) for k in (100, 200, 300))  # three tenants' 40-token system prompts


def test_a_prefix_no_slot_holds_stays_resident_is_shared_again_and_is_evicted_first_when_the_cache_needs_room():
    served = Served(n_slots=1, n_resident=2, limit=200)
    served.run(served.submit([*T1, 1]))  # T1 read: the slot keeps it
    served.run(served.submit([*T2, 2]))  # the slot is reused: T1 stays in a resident sequence, not in the slot
    assert served.resident() == [[*T1, 1, 7]]
    before = served.n_read
    served.run(served.submit([*T1, 3, 4]))  # T1 again: its 40 cells are taken from the resident, 2 tokens read
    assert served.n_read - before == 2
    assert served.scheduler.counters.prompt_tokens_shared_total >= 40
    served.run(served.submit([*T3, 5]))  # T1's second prompt stays too, in the place of T2's, the least recently used
    assert sorted(served.resident()) == [[*T1, 1, 7], [*T1, 3, 4, 7]]  # their common 40 cells held once (check())
    served.run(served.submit([*T1, 3, 4, 7, 8, 9]))  # T3's stays, in the place of the least recently used, [*T1, 1, 7]
    served.run(served.submit([*T2, 5]))  # a prompt that grew a resident one replaces it (a leaf of the radix tree grew)
    assert sorted(served.resident()) == [[*T1, 3, 4, 7, 8, 9, 7], [*T3, 5, 7]]
    served.run(served.submit(list(range(1000, 1130))))  # 130 new cells in a cache of 200: the residents make room
    assert len(served.kv.cells) <= 200 and len(served.resident()) < 2


def test_lpm_starts_first_the_request_whose_prefix_a_resident_sequence_holds():
    served = Served(n_slots=1, n_resident=2, policy="lpm")
    served.run(served.submit([*T1, 1]))
    busy = served.submit([*T2, 2], n_answer=3)  # the slot is reused: T1 stays resident
    served.step()
    later = [served.submit([*T3, 3]), served.submit([*T1, 4])]  # T3 came first; T1's cells are held
    served.run(busy)
    served.step()
    assert [r.status for r in later] == [Status.WAITING, Status.RUNNING]


@pytest.mark.parametrize("seed", range(10))
def test_requests_at_random_never_fail_for_want_of_cells_a_resident_prefix_held(seed):
    rng = random.Random(seed)
    served = Served(n_slots=3, n_resident=4, limit=3 * (40 + 30 + 6) + 20)  # the running requests' cells, and a little room
    tenants = [list(range(100 * k, 100 * k + 40)) for k in range(1, 6)]
    requests = []
    for _ in range(40):
        if rng.random() < 0.6:
            tail = [rng.randrange(10) for _ in range(rng.randrange(1, 30))]
            requests.append(served.submit([*rng.choice(tenants), *tail], n_answer=rng.randrange(1, 6)))
        if rng.random() < 0.1 and requests:
            rng.choice(requests).cancel()
        served.step()
    served.run(*[r for r in requests if not r.cancelled])
    assert served.scheduler.counters.prompt_tokens_shared_total > 0


def test_common_prefix_is_the_length_a_loop_over_the_tokens_finds():
    def loop(a: list[int], b: list[int]) -> int:  # server_tokens::get_common_prefix's way
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(200))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(200))]
        assert common_prefix(a, b) == loop(a, b) == common_prefix(b, a)
    assert common_prefix([], [1]) == 0 and common_prefix([1] * 100, [1] * 100) == 100
