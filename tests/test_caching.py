"""The KV cache at llama-server's level, with the real model: the host-RAM prompt cache, cache reuse
by moving chunks, context shift, and the unified KV cache of ``-np`` auto."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from llmkit.course.bench.scenarios.soak import rss_mb
from llmkit.engine import End, Engine, EngineConfig, EngineError, RequestParams
from llmkit.engine.prompt_cache import MIB

LINES = [
    "The harbour opens at six and the first boats leave before sunrise.",
    "Fishermen mend their nets on the quay while the gulls watch.",
    "By noon the market is full of voices, baskets and silver fish.",
    "In the evening the lighthouse keeper climbs the narrow stairs.",
    "Children race along the sea wall, counting the waves.",
    "The baker sells the last loaves to the sailors coming home.",
]
SHARED = " ".join(LINES * 3)  # ~230 tokens that several prompts start with


def greedy(engine: Engine, text: str, **kw):
    return engine.complete(text, max_tokens=12, temperature=0, **kw)


QUESTION = SHARED + " Question: when do the boats leave? Answer:"


def test_a_prefix_comes_back_from_ram_on_another_slot_exactly_as_it_left(model):
    # The same request after the same history, once on the slot that holds the prefix, once after the
    # prefix went to RAM and came back on the other slot: the cells are copied bit for bit, so the
    # greedy output is the same. (Any prefix hit reads the rest of the prompt in a smaller batch than
    # a cold run does, and llama.cpp's float sums depend on the batch shape: the tiny model's greedy
    # choice can differ from the cold one's. llama-server's cache has the same property.)
    with Engine(model, EngineConfig(n_parallel=2, n_ctx=2048, n_threads=1)) as engine:
        first = greedy(engine, SHARED + " Question: what do the gulls do? Answer:")
        first.result()
        same_slot = greedy(engine, QUESTION, id_slot=first.id_slot)
        same_slot.result()
    with Engine(model, EngineConfig(n_parallel=2, n_ctx=2048, n_threads=1)) as engine:
        first = greedy(engine, SHARED + " Question: what do the gulls do? Answer:")
        first.result()
        # two unrelated prompts: both slots now hold something else, the shared prefix sits in RAM only
        for text in ("A recipe for bread: flour, water, salt.", "Rules of chess: the king moves one square."):
            greedy(engine, text).result()
        shared = engine.model.tokenize(SHARED)
        assert all(s.cache_tokens[:20] != shared[:20] for s in engine.slots)
        hits = engine.prompt_cache.hits
        from_ram = greedy(engine, QUESTION)
        assert from_ram.result() == same_slot.result()
        assert from_ram.id_slot != first.id_slot and engine.prompt_cache.hits == hits + 1
        assert from_ram.outcome.timings.cache_n == same_slot.outcome.timings.cache_n >= len(shared) - 2
        assert engine.slots[from_ram.id_slot].n_restored == 1


def test_the_prompt_cache_stays_within_its_limit_and_evicts_the_oldest(model):
    limit_mib = 4  # about 180 tokens of this model's KV cells (~22.5 KB a token)
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=limit_mib)) as engine:
        cache = engine.prompt_cache
        for i in range(8):
            greedy(engine, f"Note {i}: " + LINES[i % len(LINES)] * 2).result()
            assert cache.size <= limit_mib * MIB
        assert cache.saves >= 7 and cache.evictions >= 1
        assert 1 <= len(cache.entries) < cache.saves
        newest = engine.model.tokenize("Note 6: " + LINES[0] * 2)
        assert cache.entries[-1].tokens[: len(newest)] == newest  # the oldest went first


def test_no_prompt_cache_with_cache_ram_0(model):
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=0)) as engine:
        assert engine.prompt_cache is None
        greedy(engine, SHARED).result()
        greedy(engine, "Something else entirely.").result()
        again = greedy(engine, SHARED)
        again.result()
        assert again.outcome.timings.cache_n < 5  # the one slot was overwritten and nothing kept it


def chat_history(first_message: str) -> list[dict]:
    turns = [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": first_message}]
    for i, line in enumerate(LINES * 2):
        turns += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": f"Fact {i}: {line}"}]
    return [*turns, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Where do the children race?"}]


def test_cache_reuse_moves_the_chunk_after_an_edit_instead_of_reading_it_again(model):
    # llama-server's loop skips cache tokens, never prompt tokens: it catches text taken OUT of the
    # cached prompt (a shortened or dropped message), not text put in
    original = chat_history("My name is Ana and I live in a small house by the sea.")
    edited = chat_history("My name is Ana.")
    runs = {}
    for n_cache_reuse in (32, 0):
        with Engine(model, EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, cache_ram_mib=0, cache_reuse=n_cache_reuse)) as engine:
            engine.chat(original, max_tokens=1, temperature=0).result()
            runs[n_cache_reuse] = engine.chat(edited, max_tokens=12, temperature=0)
            runs[n_cache_reuse].result()
            cold = engine.chat(edited, max_tokens=12, temperature=0, cache_prompt=False)
            cold.result()
    n_prompt = len(model.tokenize_chat(edited))
    reused, plain = runs[32].outcome.timings, runs[0].outcome.timings
    assert reused.n_cache_reuse > 0.8 * n_prompt  # the history after the edit was moved, not read
    assert reused.prompt_n <= 0.15 * n_prompt
    assert reused.cache_n + reused.prompt_n == n_prompt
    assert plain.n_cache_reuse == 0 and plain.prompt_n > 0.8 * n_prompt
    # the moved cells were computed with the removed words still before them: an approximation
    # (llama-server's too), which a few greedy tokens of this chat do not notice
    assert runs[32].result() == runs[0].result() == cold.result()


def test_context_shift_keeps_generating_past_the_slot(model):
    prompt = "Count: one, two, three, four, five, six,"
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=256, n_threads=1, context_shift=True)) as engine:
        r = engine.complete(prompt, max_tokens=400, temperature=0, ignore_eos=True, n_keep=-1)
        r.result()
        assert r.outcome.n_output == 400 > engine.n_ctx_slot
        assert r.outcome.end is End.LIMIT and r.outcome.truncated
        n_prompt = len(engine.model.tokenize(prompt))
        assert engine.slots[0].cache_tokens[:n_prompt] == engine.model.tokenize(prompt)  # n_keep = -1 kept the prompt
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=256, n_threads=1)) as engine:
        r = engine.complete(prompt, max_tokens=400, temperature=0, ignore_eos=True)
        r.result()
        assert r.outcome.end is End.LIMIT and r.outcome.truncated and r.outcome.n_output < engine.n_ctx_slot


def test_np_auto_is_four_slots_on_a_unified_kv_cache_serving_four_at_once(model):
    with Engine(model, EngineConfig(n_ctx=2048, n_threads=1)) as engine:
        assert engine.config.kv_unified and len(engine.slots) == 4
        assert all(s.n_ctx == 2048 for s in engine.slots)  # each slot may use the whole context
        requests = [greedy(engine, f"{i}. " + line) for i, line in enumerate(LINES[:4])]
        assert all(r.result() for r in requests)
        assert len({r.id_slot for r in requests}) == 4
        assert max(s.n_slots for s in engine.steps) == 4  # one decode held all four


def test_a_full_unified_kv_cache_clears_idle_slots_and_goes_on(model):
    with Engine(model, EngineConfig(n_ctx=512, n_threads=1, cache_idle_slots=False, cache_ram_mib=0)) as engine:
        for line in LINES[:3]:  # three slots left holding most of the 512 cells
            greedy(engine, line * 9).result()
        free = 512 - sum(s.n_past for s in engine.slots)
        assert len(engine.model.tokenize(LINES[3] * 9)) > free
        last = greedy(engine, LINES[3] * 9)
        assert last.result() and last.error is None
        assert any(s.n_past == 0 for s in engine.slots if s.id != last.id_slot)


@pytest.mark.parametrize("n_parallel", [-1, 2])
def test_idle_slots_are_saved_and_cleared_only_on_a_unified_cache(model, n_parallel):
    with Engine(model, EngineConfig(n_parallel=n_parallel, n_ctx=1024, n_threads=1)) as engine:
        first = greedy(engine, SHARED)
        first.result()
        greedy(engine, "Another prompt.").result()
        held = engine.slots[first.id_slot].n_past
        assert (held == 0) == engine.config.kv_unified
        assert any(e.tokens[:10] == engine.model.tokenize(SHARED)[:10] for e in engine.prompt_cache.entries)


# --- over HTTP: the slot server's flags, /props, /slots, /metrics ------------------------------


def test_the_slot_server_with_llama_servers_cache_flags():
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from llmkit.course import launch

    flags = ("-c", "512", "-t", "1", "--temp", "0", "--metrics", "--cache-reuse", "32", "--context-shift")
    with launch.serve("slots", *flags) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        props = http.get("/props").json()
        engine = props["engine"]  # llmkit's own: the EngineConfig in effect
        assert props["total_slots"] == 4 and engine["kv_unified"] and props["default_generation_settings"]["n_ctx"] == 512
        assert engine["cache_reuse"] == 32 and engine["context_shift"] and props["prompt_cache"]["limit_bytes"] == 8192 * MIB

        def complete(prompt: str, **body) -> dict:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **body})
            assert r.status_code == 200, r.text
            return r.json()

        def hits() -> float:
            samples = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
            return samples["llamacpp:prompt_cache_hits_total"]

        complete(SHARED + " First question:")
        complete("Something else entirely.")  # on a unified cache, idle slots are copied to RAM and cleared
        before = hits()
        again = complete(SHARED + " Second question:")
        assert again["timings"]["cache_n"] > 200 and hits() == before + 1
        assert sum(s["n_restored_from_cache"] for s in http.get("/slots").json()) >= 1

        long = complete("Count: one, two, three,", max_tokens=600, ignore_eos=True, n_keep=-1)
        assert long["usage"]["completion_tokens"] == 600 > 512  # past the slot's context, by context shift

        r = http.post("/v1/completions", json={"prompt": "Hi", "n_keep": -2})
        assert r.status_code == 400 and "n_keep" in r.text


def test_a_dropped_prompt_copy_gives_its_memory_back(model):
    # An evicted prompt must leave the process, not stay in malloc's heap for reuse: after a few copies of
    # several sizes have come and gone (malloc then keeps blocks of that size), dropping one more gives back
    # about its size.
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1)) as engine:
        greedy(engine, SHARED).result()  # slot 0 holds ~240 tokens: a copy of ~5 MiB
        for n in range(6):
            copies = [engine.ctx.seq_state(0) for _ in range(1 + n % 3)]
            del copies
        copy = engine.ctx.seq_state(0)
        size, before = len(copy), rss_mb(os.getpid())[0]
        del copy
        assert size > 4 * MIB and (before - rss_mb(os.getpid())[0]) * MIB > 0.9 * size


# --- kv_share: a prefix's cells shared by the slots (llmkit's own, beyond llama-server) ------------------------------

QUESTIONS = ["when do the boats leave?", "who mends the nets?", "what does the baker sell?", "who climbs the stairs?"]


def test_a_burst_with_one_prefix_reads_it_once_and_every_request_takes_its_cells(model):
    config = EngineConfig(n_parallel=4, n_ctx=4096, n_threads=1, kv_unified=True, kv_share=True)
    prompts = [model.tokenize(f"{SHARED} Question: {q} Answer:") for q in QUESTIONS]
    n_common = min(next(i for i, t in enumerate(p) if t != prompts[0][i]) for p in prompts[1:])
    with Engine(model, config) as engine:
        burst = [engine.submit(p, RequestParams.of(max_tokens=4, temperature=0)) for p in prompts]
        for r in burst:
            r.result()
        read = sum(r.outcome.timings.prompt_n for r in burst)
        once = n_common + sum(len(p) - n_common for p in prompts)  # the prefix once, every question
        assert once <= read <= 1.1 * once, (read, once)  # where llama-server reads the prefix 4 times
        assert engine.counters.prompt_tokens_shared_total >= 3 * (n_common - 32)  # three took it (a waiter reads < 32 more)
        status = engine.status()
        assert all(s.n_shared >= n_common - 32 for s in status.slots)  # what /slots reports: each holds it shared
        held = sum(s.n_cached for s in status.slots)  # the cells four unshared slots would use
        assert held - 3 * n_common <= status.cells.used <= held - 3 * (n_common - 32)  # one prefix and four suffixes


def test_a_request_that_takes_shared_cells_writes_what_it_writes_on_the_slot_that_holds_them(model):
    # The same two requests one after the other: the second, on the other slot, takes the first's prefix from its idle
    # slot with kv_share; without, it runs on the first's slot and keeps its prefix there (llama-server's reuse; and
    # that is what a restore from RAM writes too: the first test above). The same cells, the same rest of the prompt
    # read, the same text.
    first, second = (model.tokenize(f"{SHARED} Question: {q} Answer:") for q in QUESTIONS[:2])
    answers = {}
    for share, slot in ((True, 1), (False, 0)):
        with Engine(model, EngineConfig(n_parallel=2, n_ctx=2048, n_threads=1, kv_unified=True, kv_share=share)) as engine:
            engine.submit(first, RequestParams.of(max_tokens=8, temperature=0, id_slot=0)).result()
            then = engine.submit(second, RequestParams.of(max_tokens=24, temperature=0, id_slot=slot))
            answers[share] = then.result(), then.outcome.timings.cache_n
            assert (engine.counters.prompt_tokens_shared_total == then.outcome.timings.cache_n) is share
    assert answers[True] == answers[False] and answers[True][1] > 200


def test_a_prefix_no_slot_holds_stays_resident_and_writes_what_its_copy_restored_from_ram_writes(model):
    # One slot. A request on the shared prefix, then one on another text: with kv_share the first's cells stay in a
    # resident sequence (kv_resident) when the slot is reused; without, llama-server's way, its prompt goes to the RAM
    # prompt cache and comes back. A third request on the prefix takes the cells either way: the same text.
    first, third = (model.tokenize(f"{SHARED} Question: {q} Answer:") for q in QUESTIONS[:2])
    other = model.tokenize(" ".join(reversed(LINES)) * 3)
    answers = {}
    for share in (True, False):
        config = EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1, kv_unified=True, kv_share=share, cache_ram_mib=0 if share else 64)
        with Engine(model, config) as engine:
            for prompt in (first, other):
                engine.submit(prompt, RequestParams.of(max_tokens=4, temperature=0)).result()
            then = engine.submit(third, RequestParams.of(max_tokens=24, temperature=0))
            answers[share] = then.result(), then.outcome.timings.cache_n
            assert (engine.counters.prompt_tokens_shared_total == then.outcome.timings.cache_n) is share
            status = engine.status()  # and the other text's cells stay beside them, in the KV cache (kv_share) or in RAM
            assert (status.cells.used > status.slots[0].n_cached + 200) is share
    assert answers[True] == answers[False] and answers[True][1] > 200


def answered(request) -> bool:
    try:
        request.result()
        return True
    except EngineError:
        return False


def test_shared_cells_run_at_once_a_burst_whose_copies_would_not_fit(model):
    # Four requests on one ~240-token prefix, in a unified KV cache of 512 cells: unshared, two of them fill it (as on
    # llama-server with the same -c, -np 4 -kvu: a decode finds no room, and its requests fail); shared, the prefix is
    # held once and all four run in the same steps.
    prompts = [model.tokenize(f"{SHARED} Question: {q} Answer:") for q in QUESTIONS]
    ran = {}
    for share in (True, False):
        config = EngineConfig(n_parallel=4, n_ctx=512, n_threads=1, kv_unified=True, kv_share=share, cache_ram_mib=0)
        with Engine(model, config) as engine:
            assert 2 * (len(prompts[0]) + 4) < engine.ctx.n_ctx < 3 * len(prompts[0])  # room for two unshared (llama.cpp pads -c)
            burst = [engine.submit(p, RequestParams.of(max_tokens=4, temperature=0)) for p in prompts]
            ran[share] = sum(answered(r) for r in burst), max(step.n_slots for step in engine.steps), engine.status().cells
    assert ran[True][:2] == (4, 4)  # shared: every request answered, all four in the same steps ...
    assert ran[True][2].used < 512 and ran[True][2].shared > 200  # ... on one prefix's cells, held by the four
    assert ran[False][0] < 4, ran[False]  # unshared: the cache cannot hold them, and some failed


def test_under_pressure_no_request_fails_for_cells_an_idle_prefix_held(model, caplog):
    # kv_share keeps idle slots' cells for later requests. Six prefixes of ~230 tokens, four slots of a 1024-cell cache,
    # two clients that each send a request at a time (so the running ones always fit), answers of 60-150 tokens,
    # some clients leaving early: as answers grow beside idle slots' kept cells the cache fills, and idle slots' cells
    # must make room (least recently used first) before any request fails.
    rng = random.Random(7)
    prefixes = [model.tokenize(f"Tenant {k}: {LINES[k % len(LINES)]} " * 14)[:230] for k in range(6)]
    config = EngineConfig(n_parallel=4, n_ctx=1024, n_threads=1, kv_unified=True, kv_share=True, cache_ram_mib=0)
    outcomes: list[tuple[bool, bool]] = []  # (left early, answered)

    def client(seed: int) -> None:
        own = random.Random(seed)
        for k in range(8):
            prompt = own.choice(prefixes) + model.tokenize(f" Question {seed}.{k}?", add_special=False)
            request = engine.submit(prompt, RequestParams.of(max_tokens=own.randrange(60, 150), temperature=0, ignore_eos=True))
            leaves = own.random() < 0.25
            if leaves:
                threading.Timer(own.uniform(0, 1.0), request.cancel).start()
            outcomes.append((leaves, answered(request)))
            time.sleep(own.uniform(0, 0.3))

    with Engine(model, config) as engine, caplog.at_level("WARNING", logger="llmkit.engine"):
        assert 2 * (230 + 160) < engine.ctx.n_ctx < 4 * (230 + 60)  # two running requests fit; four slots' worth does not
        clients = [threading.Thread(target=client, args=(rng.randrange(1000),)) for _ in range(2)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        failed = engine.status().counters.requests_failed_total
    assert failed == 0 and all(ok for leaves, ok in outcomes if not leaves), outcomes
    assert any("purging" in r.message for r in caplog.records)  # the cache filled, and idle cells made room
