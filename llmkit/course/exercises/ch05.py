"""Chapter 5 (KV cache reuse): the 10 % threshold, what cache reuse moves, a token's bytes, which cached prompt comes back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llmkit.course import tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, LLAMA, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, one_by_one, quiet_engine
from llmkit.engine.policy import choose_slot
from llmkit.engine.prompt_cache import MIB, choose_entry
from llmkit.engine.request import RequestParams
from llmkit.engine.slot import Slot
from llmkit.engine.tokens import common_prefix

CHAPTER = Chapter(5)


# --- exercise 1: the smallest shared prefix that keeps a slot -------------------------------------------------------


def keeps_slot(k: int, n: int) -> bool:
    """Does an ``n``-token prompt sharing its first ``k`` with slot 1 go there (slot 0 least recently used)?"""
    slots = [Slot(0, 4096), Slot(1, 4096)]
    shared = list(range(1000, 1000 + k))
    slots[1].cache_tokens = [*shared, *range(5000, 5050)]  # the shared prefix, then tokens the prompt does not have
    slots[0].t_last_used, slots[1].t_last_used = 1.0, 2.0
    return choose_slot(slots, RequestParams(), [*shared, *range(9000, 9000 + n - k)]) is slots[1]


def smallest_kept(n: int) -> int:
    return next(k for k in range(1, n + 1) if keeps_slot(k, n))


@CHAPTER.exercise(
    1,
    answers=("smallest_shared",),
    compares=(HIDDEN,),
    writes="the smallest shared prefix that keeps a slot, for any prompt length (a function)",
)
def q1(smallest_shared) -> str:
    rule = expect.function("smallest_shared", smallest_shared, 1)
    lengths = (100, 150, 37, 1, 9, 10, 11, 20, 255, 1000, 4001)  # the notebook's three first, then ones it never tried
    for n in lengths:
        yours = call(rule, n, case=tr("a {n}-token prompt", n=n))
        expect.whole_number(tr("smallest_shared({n})", n=n), yours)
        if yours != smallest_kept(n):
            side = (
                tr("too many: a shorter prefix already keeps the slot")
                if yours > smallest_kept(n)
                else tr("too few: choose_slot passes the slot by")
            )
            raise Wrong(tr("for a {n}-token prompt, yours says {k} shared tokens: {side}", n=n, k=yours, side=side))
    return tr("right for all {n} prompt lengths, from 1 to {longest} tokens (choose_slot, live)", n=len(lengths), longest=max(lengths))


# --- exercise 2: what cache reuse moves ----------------------------------------------------------------------------

LINES = [
    "The harbour opens at six and the first boats leave before sunrise.",
    "Fishermen mend their nets on the quay while the gulls watch.",
    "By noon the market is full of voices, baskets and silver fish.",
    "In the evening the lighthouse keeper climbs the narrow stairs.",
    "Children race along the sea wall, counting the waves.",
    "The baker sells the last loaves to the sailors coming home.",
]  # the chapter's own


def chat_history(first_message: str) -> list[dict]:
    """The chapter's chat: a first user message we edit, then four turns after it."""
    turns = [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": first_message}]
    for i, line in enumerate(LINES[:4]):
        turns += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"Fact {i}: {line}"}]
    return [*turns, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Where do the children race?"}]


class Recorder:
    """Stands in for the llama_context: records the KV moves instead of making them."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return True

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        pass


def cache_moves() -> dict[str, tuple[int, int]]:
    """Each edit of the chapter's chat: (tokens the cache reuse loop moves, tokens of the new prompt)."""
    model = LAB.model()
    original = chat_history("My name is Ana and I live in a small house by the sea.")
    edits = {
        "dropped": (original[:1] + original[3:], 32),
        "inserted": (chat_history("My name is Ana, I am a painter, and I live in a small house by the sea."), 32),
        "too_large": (chat_history("My name is Ana."), 1000),
    }
    moved = {}
    for name, (chat, min_chunk) in edits.items():
        slot, prompt = Slot(0, 4096), model.tokenize_chat(chat)
        slot.cache_tokens = model.tokenize_chat(original)
        moved[name] = (slot.reuse_chunks(cast(Any, Recorder()), prompt, common_prefix(slot.cache_tokens, prompt), min_chunk), len(prompt))
    return moved


@CHAPTER.exercise(2, answers=("share_moved_dropped", "moved_inserted", "moved_too_large"), compares=(LIVE,),
                  writes="predictions: the share of a prompt moved, two token counts")  # fmt: skip
def q2(share_moved_dropped, moved_inserted, moved_too_large) -> str:
    measured = LAB.memo("ch5-cache-moves", cache_moves)
    share = expect.number("share_moved_dropped", share_moved_dropped)
    if not 0 <= share <= 1:
        raise Wrong(tr("share_moved_dropped is a share of the prompt's tokens, between 0 and 1, not {got}", got=share))
    moved, n_prompt = measured["dropped"]
    expect.near("share_moved_dropped", share, moved / n_prompt, 0.1,
                tr("the chat template's tokens are hard to count by eye"))  # fmt: skip
    for name, value in (("moved_inserted", moved_inserted), ("moved_too_large", moved_too_large)):
        expect.whole_number(name, value)
        expect.same(name, value, measured[name.removeprefix("moved_")][0])
    return tr("the cache reuse loop, run on the chapter's chat just now: {share:.0%} of the prompt moved when a message was dropped, "
              "{inserted} tokens when words were inserted, {large} with a minimum chunk of 1000", share=moved / n_prompt,
              inserted=measured["inserted"][0], large=measured["too_large"][0])  # fmt: skip


# --- exercise 3: what a token costs in RAM --------------------------------------------------------------------------


def bytes_measured() -> float:
    """Bytes a token takes in the prompt cache: eight prompts saved, their size over their tokens."""
    from llmkit.engine import Engine, EngineConfig

    with Engine(LAB.model(), EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=64)) as engine:
        for i in range(4):
            engine.complete(f"Note {i}: " + LINES[i % len(LINES)] * 2, max_tokens=1, temperature=0).result()
        cache = engine.prompt_cache
        assert cache is not None and cache.n_tokens
        return cache.size / cache.n_tokens


@CHAPTER.exercise(3, answers=("bytes_per_token", "tokens_in_8192_mib"), compares=(LIVE,),
                  writes="bytes of KV cells a token takes, and how many tokens 8192 MiB hold")  # fmt: skip
def q3(bytes_per_token, tokens_in_8192_mib) -> str:
    measured = LAB.memo("ch5-bytes-per-token", bytes_measured)
    per_token = expect.number("bytes_per_token", bytes_per_token)
    expect.within("bytes_per_token", per_token, measured, 0.1, tr("a saved sequence also carries a small header of its own"))
    held = expect.number("tokens_in_8192_mib", tokens_in_8192_mib)
    expect.within("tokens_in_8192_mib", held, 8192 * MIB / measured, 0.1, tr("as bytes_per_token"))
    return tr("the prompt cache measured {measured:.0f} bytes a token just now", measured=measured)


# --- exercise 4: which cached prompt comes back ---------------------------------------------------------------------


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


A, B, C = seq(1000, 100), seq(2000, 60), seq(3000, 40)
# (what the case is, the cached prompts oldest first, what the slot holds, the new prompt): none of them in the notebook
ENTRY_CASES = [
    ("an empty slot, one entry that starts the prompt", [A], [], A[:80] + seq(7000, 10)),
    ("the slot already holds the prompt's start", [B], A[:90], A[:95]),
    ("two entries, each kept whole: the longer match does not win", [A[:30], A[:70]], [], A[:90]),
    ("an entry that would keep under a quarter of itself", [A], [], A[:20] + seq(7000, 30)),
    ("an entry that would keep exactly a quarter of itself", [A[:80]], [], A[:20] + seq(7000, 30)),
    ("a better match, but it keeps less of itself than the slot keeps", [A[:60] + B], A[:40] + C, A[:50] + seq(7000, 5)),
    ("nothing in common", [B, C], [], A),
    ("the same match twice: the older entry", [A[:50] + B, A[:50] + C], [], A[:60]),
]


def check_rule(rule: Callable) -> None:
    for case, entries, held, prompt in ENTRY_CASES:
        yours = call(rule, [list(e) for e in entries], list(held), list(prompt), case=case)
        if yours is not None and not expect.is_int(yours):
            raise Wrong(tr("{case}: expected an index into entries, or None; got {got}", case=case, got=expect.shown(yours)))
        if yours != choose_entry(entries, held, prompt):
            kind = tr("None (keep what the slot holds)") if yours is None else tr("entry {i}", i=yours)
            raise Wrong(tr("{case}: yours brings back {kind}, not the entry the prompt cache would", case=case, kind=kind))


WORKLOAD = ["library", "harbour", "library again", "recipe", "harbour again", "library at last"]


def workload_prompts() -> list[list[int]]:
    """One slot, three long texts taking turns: each turn pushes the slot's prompt to the cache, a return brings it back."""
    tokenize = LAB.model().tokenize
    texts = {
        "library": "The Riverside library opens at nine. " * 12,
        "harbour": " ".join(LINES * 2),
        "recipe": "Bread: flour, water, salt. " * 14,
    }
    return [tokenize(texts[name.split()[0]] + (f" Question {i}: what next?" if "again" in name or "last" in name else ""))
            for i, name in enumerate(WORKLOAD)]  # fmt: skip


def engine_cache_n(rule: Callable | None, guard: Guard | None = None) -> list[int]:
    """cache_n of each request of the workload, on a real engine with one slot (the rule: the learner's, or llmkit's)."""
    from llmkit.engine import Engine, EngineConfig, RequestParams

    config = EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=64, cache_choice=rule or choose_entry)
    with quiet_engine(), Engine(LAB.model(), config) as engine:
        params = RequestParams.of(max_tokens=1, temperature=0)
        finished = one_by_one(lambda prompt: engine.submit(prompt, params), workload_prompts(), guard)
    failed = [r.error for r in finished if r.error is not None]
    if failed:
        raise Wrong(tr("in the engine, a request failed: {error}", error=failed[0]))
    return [r.outcome.n_cached for r in finished]


def llama_cache_n() -> list[int]:
    """The same workload on the real llama-server, one slot, its RAM prompt cache on: cache_n of each request."""
    server = LAB.server("llama-server", "-np", "1", "-c", "1024", "-t", "1", "--cache-ram", "64")
    answers = servers.completions(server.url, workload_prompts(), n_predict=1, temperature=0, cache_prompt=True)
    return [answer["timings"]["cache_n"] for answer in answers]


@CHAPTER.exercise(4, answers=("choose_entry",), compares=(HIDDEN, ENGINE, LLAMA),
                  writes="which cached prompt the RAM cache brings back (a function), in the engine and beside llama-server")  # fmt: skip
def q4(choose_entry) -> str:
    rule = expect.function("choose_entry", choose_entry, 3)
    check_rule(rule)
    guard = Guard(tr("in the engine"))
    yours = engine_cache_n(guard.wrap(rule), guard)
    theirs = LAB.memo("ch5-llama-cache-n", llama_cache_n)
    for i, (a, b) in enumerate(zip(yours, theirs, strict=True)):
        if a != b:
            raise Wrong(tr("request {i} of the workload ({name}): {yours} prompt tokens from the cache with your rule, "
                           "a different number on llama-server", i=i + 1, name=WORKLOAD[i], yours=a))  # fmt: skip
    return tr("the same entries as the prompt cache on {n} hidden cases; in a real engine your rule reused {yours} prompt tokens "
              "over the workload, as llama-server did", n=len(ENTRY_CASES), yours=sum(yours))  # fmt: skip


# --- exercise 5: the cells a burst holds, unshared and shared ------------------------------------------------------

BURSTS = ((4, 60, (12, 9, 20, 5), 3), (3, 200, (40, 1, 17), 6), (2, 45, (3, 30), 2))  # slots, prefix, suffixes, max_tokens


def burst_prompts(n_common: int, suffixes: tuple[int, ...]) -> list[list[int]]:
    """One prefix, then each request's own tokens (their first ones differ: the prefix is exactly ``n_common``)."""
    prefix = [500 + 7 * i for i in range(n_common)]
    return [[*prefix, 9000 + k, *(3000 + 11 * k + j for j in range(n - 1))] for k, n in enumerate(suffixes)]


def engine_cells(n_slots: int, prompts: list[list[int]], max_tokens: int, share: bool) -> int:
    """The KV cells the slots of a real engine hold once the burst has been answered (``/metrics``' kv_cells_used)."""
    from llmkit.engine import Engine, EngineConfig

    config = EngineConfig(n_parallel=n_slots, n_ctx=2048, n_threads=1, kv_unified=True, kv_share=share, cache_ram_mib=0)
    with quiet_engine(), Engine(LAB.model(), config) as engine:
        burst = [engine.submit(p, RequestParams.of(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts]
        for request in burst:
            request.result()
        return engine.status().cells.used


@CHAPTER.exercise(5, answers=("cells_held",), compares=(HIDDEN, ENGINE),
                  writes="the KV cells a burst holds, unshared and with --kv-share (a function), in a real engine")  # fmt: skip
def q5(cells_held) -> str:
    rule = expect.function("cells_held", cells_held, 3)
    for n_slots, n_common, suffixes, max_tokens in BURSTS:
        prompts = burst_prompts(n_common, suffixes)
        lengths = [len(p) for p in prompts]
        case = tr("{n} prompts of {lengths} tokens sharing their first {common}, {k} tokens each", n=len(prompts),
                  lengths=lengths, common=n_common, k=max_tokens)  # fmt: skip
        yours = expect.whole_numbers("cells_held", call(rule, lengths, n_common, max_tokens, case=case))
        if len(yours) != 2:
            raise Wrong(tr("cells_held returns two numbers: the cells held unshared, then shared"))
        for (kind, share), number in zip(((tr("unshared"), False), (tr("shared"), True)), yours, strict=True):
            held = engine_cells(n_slots, prompts, max_tokens, share)
            if number != held:
                raise Wrong(tr("{case}, {kind}: yours says {yours} cells, the engine's slots held {held}", case=case, kind=kind,
                               yours=number, held=held))  # fmt: skip
    return tr("right on {n} bursts: in a real engine, the cells its slots held unshared and with --kv-share", n=len(BURSTS))
