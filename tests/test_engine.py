"""The slot engine with the real model: batching, prefix reuse, queueing, cancellation, limits, faults."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from llmkit.engine import ContextSizeError, End, Engine, EngineConfig, EngineError, LlamaServerPolicy, PriorityPolicy, RequestParams, Status
from llmkit.engine.prompt_cache import PromptCache
from llmkit.engine.request import Piece, Request
from llmkit.llama import DecodeError
from llmkit.sampling import Sampler
from llmkit.text import StopMatcher

from helpers import wait_until

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three fruits.",
    "Why is the sky blue?",
]
SYSTEM = "You are a patient teacher who explains things to children in short, friendly sentences. " * 4


def chat(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine(model):
    # 4 slots of 1024 tokens; one thread: the test machine's two cores are shared
    with Engine(model, EngineConfig(n_parallel=4, n_ctx=4096, n_threads=1)) as e:
        yield e


def wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    wait_until(lambda: not (engine.status().n_busy or engine.status().n_waiting), timeout)


def busy_and_waiting(engine: Engine) -> tuple[int, int]:
    status = engine.status()
    return status.n_busy, status.n_waiting


def test_batched_greedy_output_equals_output_alone(engine):
    alone = []
    for q in QUESTIONS:
        r = engine.chat(chat(q), max_tokens=48, temperature=0, cache_prompt=False)
        alone.append(r.result())
    requests = [engine.chat(chat(q), max_tokens=48, temperature=0, cache_prompt=False) for q in QUESTIONS]
    together = [r.result() for r in requests]
    assert together == alone
    assert len({r.id_slot for r in requests}) == 4, "the four requests should have run side by side"


def test_prefix_cache_hit_gives_the_same_output_and_reports_cache_n(engine):
    cold = engine.chat(chat("Name two colours.", SYSTEM), max_tokens=32, temperature=0, cache_prompt=False)
    cold_text = cold.result()
    assert cold.outcome.timings.cache_n == 0
    warm = engine.chat(chat("Name two colours.", SYSTEM), max_tokens=32, temperature=0)
    assert warm.result() == cold_text
    assert warm.id_slot == cold.id_slot
    # the whole prompt was cached; one token is evaluated again for its logits
    assert warm.outcome.timings.cache_n == len(warm.prompt) - 1
    assert warm.outcome.timings.prompt_n == 1
    other = engine.chat(chat("Name two animals.", SYSTEM), max_tokens=8, temperature=0)
    other.result()
    assert other.id_slot == cold.id_slot, "the slot holding the system prompt is the most similar"
    assert other.outcome.timings.cache_n >= len(engine.model.tokenize_chat(chat("", SYSTEM))) - 8


def test_cache_prompt_false_evaluates_everything(engine):
    engine.chat(chat("Hello!", SYSTEM), max_tokens=4, temperature=0).result()
    r = engine.chat(chat("Hello!", SYSTEM), max_tokens=4, temperature=0, cache_prompt=False)
    r.result()
    assert r.outcome.timings.cache_n == 0 and r.outcome.timings.prompt_n == len(r.prompt)


def test_two_system_prompts_keep_to_their_own_slots(engine):
    systems = [
        "You are a pirate. Answer like a pirate would, with lots of arrr. " * 3,
        "You are a formal butler. Answer politely and briefly, sir. " * 3,
    ]
    first = [engine.chat(chat("Hi", s), max_tokens=4, temperature=0) for s in systems]
    for r in first:
        r.result()
    again = [engine.chat(chat("Bye", s), max_tokens=4, temperature=0) for s in systems]
    for r in again:
        r.result()
    assert [r.id_slot for r in again] == [r.id_slot for r in first]
    assert all(r.outcome.timings.cache_n > 20 for r in again)


def test_more_requests_than_slots_wait_in_a_queue_and_all_finish(engine):
    requests = [engine.chat(chat(f"Count from {i} to {i + 5}."), max_tokens=24, temperature=0) for i in range(7)]
    # slots fill between steps (a slow step delays the next admissions): wait for it, don't guess how long
    seen = []  # one snapshot, taken when the slots are full: first come, first served, the last three wait in order
    wait_until(lambda: (seen.append(engine.status()), (seen[-1].n_busy, seen[-1].n_waiting) == (4, 3))[1], timeout=10)
    assert {s.job.id_task for s in seen[-1].slots if s.job} == {r.id for r in requests[:4]}
    assert [w.id for w in seen[-1].waiting] == [r.id for r in requests[4:]]
    texts = [r.result() for r in requests]
    assert all(texts) and all(r.outcome.end in (End.EOS, End.WORD, End.LIMIT) for r in requests)
    wait_idle(engine)


def test_cancel_frees_the_slot_within_a_second(engine):
    r = engine.complete("Once upon a time", max_tokens=-1, temperature=0.8, seed=3, ignore_eos=True)
    pieces = iter(r)
    next(pieces)
    assert engine.status().n_busy == 1
    t0 = time.monotonic()
    pieces.close()  # the consumer goes away
    wait_idle(engine, timeout=1.0)
    assert time.monotonic() - t0 < 1.0
    assert r.outcome.end is End.CANCELLED


def test_cancel_while_waiting_in_the_queue(engine):
    blockers = [engine.complete("Tell me a story", max_tokens=64, temperature=0, ignore_eos=True) for _ in range(4)]
    queued = engine.complete("Never runs", max_tokens=8)
    wait_until(lambda: engine.status().n_busy == 4, timeout=30)
    assert queued.status.value == "waiting"
    queued.cancel()
    wait_until(lambda: queued.done, timeout=10)
    assert queued.outcome.end is End.CANCELLED and queued.outcome.output == () and queued.id_slot is None
    assert not all(b.done for b in blockers)  # it left the queue at once, not when a slot came free
    for b in blockers:
        b.result()
    wait_idle(engine)


def test_prompt_longer_than_the_slot_is_refused(engine):
    long_prompt = engine.model.tokenize("word " * 1100)
    with pytest.raises(ContextSizeError) as info:
        engine.submit(long_prompt)
    assert info.value.n_prompt_tokens == len(long_prompt) and info.value.n_ctx == engine.n_ctx_slot == 1024
    assert "exceeds the available context size" in str(info.value)
    assert busy_and_waiting(engine) == (0, 0)


def test_generation_stops_with_length_at_the_end_of_the_slot(engine):
    prompt = engine.model.tokenize("word " * 990)
    r = engine.submit(prompt, RequestParams.of(temperature=0, ignore_eos=True))
    r.result()
    assert r.outcome.end is End.LIMIT
    assert len(prompt) + r.outcome.n_output == engine.n_ctx_slot + 1  # the last token is sampled, never decoded


def test_max_tokens_and_zero(engine):
    r = engine.complete("One, two, three,", max_tokens=5, temperature=0, ignore_eos=True)
    r.result()
    assert (r.outcome.n_output, r.outcome.end, r.outcome.timings.predicted_n) == (5, End.LIMIT, 5)
    r = engine.complete("One, two, three,", max_tokens=0)
    assert r.result() == "" and r.outcome.end is End.LIMIT


def test_stop_string_split_across_tokens_is_never_emitted(engine):
    free = engine.complete("1, 2, 3, 4, 5, 6, 7,", max_tokens=24, temperature=0)
    text = free.result()
    stop = " 10, 11"  # several tokens long
    assert stop in text
    r = engine.complete("1, 2, 3, 4, 5, 6, 7,", max_tokens=24, temperature=0, stop=[stop])
    pieces = [p.text for p in r]
    assert r.outcome.end in (End.EOS, End.WORD)
    assert "".join(pieces) == text[: text.index(stop)]
    assert not any("10" in p for p in pieces)


def test_a_failing_request_fails_alone(engine, monkeypatch):
    real = engine.ctx.logprobs

    def explode(i, token, n_probs):
        if n_probs == 7:  # only the request that asked for 7 alternatives
            raise RuntimeError("boom in the sampler")
        return real(i, token, n_probs)

    monkeypatch.setattr(engine.ctx, "logprobs", explode)
    good = [engine.chat(chat(q), max_tokens=24, temperature=0) for q in QUESTIONS[:3]]
    bad = engine.submit(engine.model.tokenize_chat(chat("Hi")), RequestParams.of(temperature=0, n_probs=7))
    with pytest.raises(EngineError, match="boom in the sampler"):
        bad.result()
    assert all(r.result() for r in good)
    assert all(r.error is None for r in good)
    # a grammar that does not parse fails at slot start, alone too
    broken = engine.submit(engine.model.tokenize("x"), RequestParams.of(grammar="root ::= (((("))
    with pytest.raises(ValueError, match="grammar"):
        broken.result()
    wait_idle(engine)


def test_logprobs_are_reported_when_asked(engine):
    r = engine.submit(engine.model.tokenize("The capital of France is"), RequestParams.of(temperature=0, max_tokens=3, n_probs=3))
    pieces = list(r)
    lps = [lp for p in pieces for lp in p.logprobs]
    assert len(lps) == r.outcome.n_output == 3
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert lp.top[0][0] == lp.token and lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_async_iteration(engine):
    async def main():
        requests = [engine.chat(chat(q), max_tokens=16, temperature=0) for q in QUESTIONS[:2]]

        async def collect(r):
            return "".join([p.text async for p in r])

        return await asyncio.gather(*(collect(r) for r in requests))

    texts = asyncio.run(main())
    sync = [engine.chat(chat(q), max_tokens=16, temperature=0).result() for q in QUESTIONS[:2]]
    assert texts == sync


def test_timings_and_counters_add_up(engine):
    before = engine.status().counters.snapshot()
    requests = [engine.chat(chat(q), max_tokens=10, temperature=0) for q in QUESTIONS[:3]]
    for r in requests:
        r.result()
    after = engine.status().counters.snapshot()
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == sum(r.outcome.timings.predicted_n for r in requests)
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(r.outcome.timings.prompt_n for r in requests)
    assert after["prompt_tokens_cached_total"] - before["prompt_tokens_cached_total"] == sum(r.outcome.timings.cache_n for r in requests)
    assert after["n_decode_total"] > before["n_decode_total"]
    for r in requests:
        t = r.outcome.timings.to_dict()
        assert t["prompt_n"] + t["cache_n"] == len(r.prompt) and t["predicted_n"] == r.outcome.n_output
        assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0


def test_samplers_and_requests_are_freed(engine):
    wait_idle(engine)
    live_before = Sampler.live
    refs = []
    for _ in range(3):
        batch = [engine.chat(chat(q), max_tokens=4, temperature=0.7, seed=1, repeat_penalty=1.1) for q in QUESTIONS]
        for r in batch:
            r.result()
        refs += [weakref.ref(r) for r in batch]
        del batch, r
    wait_idle(engine)
    assert Sampler.live == live_before, "every slot's sampler chain was freed"
    gc.collect()
    assert all(ref() is None for ref in refs), "finished requests are not kept alive by the engine"


def test_submit_validation(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.submit([])
    with pytest.raises(ValueError, match="id_slot"):
        engine.submit([1, 2], RequestParams(id_slot=9))
    r = engine.submit(engine.model.tokenize("Hi"), RequestParams(max_tokens=2, id_slot=2))
    r.result()
    assert r.id_slot == 2


def test_request_objects_stand_alone():
    r = Request([1, 2, 3])
    assert r.status.value == "waiting" and not r.done


def test_an_async_reader_is_woken_by_wake_not_by_each_emit():
    """The engine emits every slot's piece, then wakes the readers once (see Engine.update_slots): a reader's
    event loop must not run between two slots' samplers."""
    request = Request([1, 2, 3])

    async def main() -> list[list[str]]:
        seen: list[list[str]] = []
        read = []

        async def reader() -> None:
            async for piece in request:
                read.append(piece.text)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.05)  # the reader waits for its first piece
        await asyncio.to_thread(lambda: (request.emit(Piece("a", [1])), request.emit(Piece("b", [2]))))  # the engine thread
        await asyncio.sleep(0.1)
        seen.append(list(read))
        await asyncio.to_thread(request.wake)
        await asyncio.sleep(0.1)
        seen.append(list(read))
        await asyncio.to_thread(request.finish, End.EOS)  # the end wakes it at once
        await asyncio.wait_for(task, 5)
        return seen

    assert asyncio.run(main()) == [[], ["a", "b"]]


# --- stepping by hand, plan then commit, the loop's guard ---------------------------------------


@pytest.fixture
def by_hand(model):
    """An engine with no thread: the test runs its steps. 1 slot, 128 tokens per decode."""
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_batch=128, n_threads=1), start=False) as e:
        yield e


def run(engine: Engine, request: Request) -> list:
    steps = []
    while not request.done:
        steps.append(engine.step())
    return steps


def test_an_engine_stepped_by_hand_shows_each_batch(by_hand):
    r = by_hand.complete("word " * 200, max_tokens=3, temperature=0, ignore_eos=True)
    assert by_hand.status().n_waiting == 1 and r.status.value == "waiting"
    steps = run(by_hand, r)
    shares = [(s.batch[0].n_tokens, s.batch[0].is_prompt, s.batch[0].sampled) for s in steps]
    n = len(r.prompt)
    assert shares == [(128, True, False), (n - 128, True, True), (1, False, True), (1, False, True)]
    assert by_hand.slots[0].cache_tokens == r.prompt + list(r.outcome.output[:2])  # the last token is sampled, never decoded
    assert by_hand.step() is None  # nothing to do


def test_step_is_refused_while_the_thread_runs_the_loop(model):
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=256, n_threads=1)) as running, pytest.raises(RuntimeError, match="start=False"):
        running.step()


def test_cache_tokens_are_exactly_the_kv_cache_whenever_llama_decode_runs(by_hand, monkeypatch):
    real, seen = by_hand.ctx.decode, []

    def decode(batch):
        seen.append(all(by_hand.ctx.seq_pos_max(s.id) == len(s.cache_tokens) - 1 for s in by_hand.slots))
        real(batch)

    monkeypatch.setattr(by_hand.ctx, "decode", decode)
    run(by_hand, by_hand.complete("word " * 200, max_tokens=3, temperature=0, ignore_eos=True))
    assert seen == [True] * 4


def test_a_failed_decode_leaves_what_earlier_steps_committed(by_hand, monkeypatch):
    real, calls = by_hand.ctx.decode, []

    def decode(batch):  # the second decode writes its cells, then fails
        calls.append(batch.n_tokens)
        real(batch)
        if len(calls) == 2:
            raise DecodeError("llama_decode failed with code -3")

    monkeypatch.setattr(by_hand.ctx, "decode", decode)
    r = by_hand.complete("word " * 200, max_tokens=3, temperature=0)
    run(by_hand, r)
    assert isinstance(r.error, EngineError) and "code -3" in str(r.error)
    slot = by_hand.slots[0]
    assert slot.cache_tokens == r.prompt[:128] and by_hand.ctx.seq_pos_max(0) == 127  # the first chunk, and only it
    again = by_hand.complete("word " * 200, max_tokens=3, temperature=0)
    run(by_hand, again)
    assert again.error is None and again.outcome.timings.cache_n == 128  # and it is reused


def test_a_prompt_cache_that_raises_fails_the_request_it_concerns_and_the_loop_goes_on(model, monkeypatch, caplog):
    def save(self, ctx, seq_id, tokens):
        raise OSError("no memory for the copy")

    with Engine(model, EngineConfig(n_parallel=1, n_ctx=512, n_threads=1)) as engine:
        engine.complete("The first prompt", max_tokens=2).result()
        monkeypatch.setattr(PromptCache, "save", save)
        swapped = engine.complete("Another prompt, which the slot's cache does not serve", max_tokens=2)
        wait_until(lambda: swapped.done, timeout=30)
        assert isinstance(swapped.error, OSError)
        monkeypatch.undo()
        third = engine.complete("A third prompt", max_tokens=2)
        wait_until(lambda: third.done, timeout=30)  # (the old engine's thread had died saving the idle slot: this waited forever)
        assert third.error is None and third.outcome is not None and third.outcome.output
    assert "no memory for the copy" in caplog.text


# --- the published status, and priority with preemption -------------------------------------------------------


class PausedOnce(LlamaServerPolicy):
    """llama-server's policy, but its first ``prompt_order`` call (inside a step, after admission) waits for ``go``."""

    def __init__(self) -> None:
        self.inside, self.go = threading.Event(), threading.Event()

    def prompt_order(self, reading):
        if not self.inside.is_set():
            self.inside.set()
            self.go.wait(30)
        return super().prompt_order(reading)


def test_a_status_read_from_another_thread_is_the_state_at_the_end_of_a_step(model):
    policy = PausedOnce()
    with Engine(model, EngineConfig(n_parallel=2, n_ctx=1024, n_threads=1, policy=policy)) as engine:
        r = engine.complete("The harbour opens at six and the first boats leave before sunrise.", max_tokens=4, temperature=0)
        assert policy.inside.wait(30)  # the engine's thread is in the middle of a step: admitted, not yet decoded
        seen: list = []
        reader = threading.Thread(target=lambda: seen.append(engine.status()))
        reader.start()
        reader.join(0.3)
        assert not seen, "a reader got the engine's state in the middle of a step"
        policy.go.set()
        reader.join(30)
        (status,) = seen
        job = status.slots[r.id_slot].job
        assert job is not None and job.status == "generating" and job.n_prompt_tokens_processed == len(r.prompt)
        assert status.step >= 1 and status.slots[r.id_slot].n_cached == len(r.prompt)  # the step's prompt, all in the KV cache
        r.result()


STORY = "Once upon a time, in a village by the sea, there lived an old fisherman who"


def preempted_run(model, cache_ram_mib: int) -> tuple[str, str, Engine]:
    """A low-priority story preempted after 10 tokens by a high-priority question, on one slot; both texts."""
    config = EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=cache_ram_mib, policy=PriorityPolicy())
    engine = Engine(model, config, start=False)
    low = engine.complete(STORY, max_tokens=40, temperature=0, ignore_eos=True, priority=5)
    while low.id_slot is None or len(low.text_parts) < 10:
        engine.step()
    high = engine.chat(chat("What is the capital of France?"), max_tokens=12, temperature=0, priority=0)
    engine.step()  # the question takes the slot: the story waits, its KV cache in RAM (if the cache takes it)
    assert (low.status, low.id_slot, high.id_slot) == (Status.WAITING, None, 0)
    assert [w.id for w in engine.status().waiting] == [low.id] and engine.counters.requests_preempted_total == 1
    n_sent = len(low.text_parts)
    while not high.done:
        engine.step()
        assert len(low.text_parts) == n_sent  # the story's stream is paused, not broken
    while not low.done:
        engine.step()
    assert low.error is None and low.outcome is not None and low.outcome.n_output == 40 and low.id_slot == 0  # the slot, taken again
    return low.result(), high.result(), engine


@pytest.mark.parametrize("cache_ram_mib", [8192, 0], ids=["kv-kept-in-ram", "kv-recomputed"])
def test_a_preempted_request_goes_on_with_the_same_greedy_text(model, cache_ram_mib):
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1), start=False) as alone:
        never_stopped = alone.complete(STORY, max_tokens=40, temperature=0, ignore_eos=True)
        while not never_stopped.done:
            alone.step()
    text, answer, engine = preempted_run(model, cache_ram_mib)
    with engine:
        assert text == never_stopped.result() and answer  # the question was answered meanwhile
        assert engine.slots[0].n_restored == (1 if cache_ram_mib else 0)  # from the prompt cache, or read again


# --- a policy with a bug costs its own decision, never a request ---------------------------------------------------------


class Raises(LlamaServerPolicy):
    name = "raises"

    def order(self, waiting, slots):
        raise RuntimeError("a bug in order")

    def prompt_order(self, reading):
        raise RuntimeError("a bug in prompt_order")


class BusySlot(LlamaServerPolicy):
    name = "busy-slot"

    def choose_slot(self, slots, request, tokens):
        return next((s for s in slots if not s.is_idle), slots[0])  # a slot with a job on it, whenever there is one


class Stranger(LlamaServerPolicy):
    name = "stranger"

    def order(self, waiting, slots):
        return [Request([1, 2, 3]), *waiting]  # a request that is not waiting, first


class IdleVictim(PriorityPolicy):
    name = "idle-victim"

    def choose_slot(self, slots, request, tokens):
        return None  # never an idle slot: every admission is a preemption ...

    def victim(self, slots, request):
        return slots[0]  # ... of slot 0, idle or not


@pytest.mark.parametrize("policy", [Raises(), BusySlot(), Stranger(), IdleVictim()], ids=lambda p: p.name)
def test_a_policy_that_raises_or_chooses_what_cannot_be_loses_no_request_and_says_so_once(model, policy, caplog):
    config = EngineConfig(n_parallel=2, n_ctx=1024, n_threads=1, policy=policy)
    with Engine(model, config) as engine, caplog.at_level("WARNING", logger="llmkit.engine"):
        requests = [engine.complete(f"Count to {k}:", max_tokens=6, temperature=0, ignore_eos=True) for k in range(4)]
        outcomes = [r.result() and r.outcome for r in requests]
    assert all(o is not None and o.end is End.LIMIT and o.n_output == 6 for o in outcomes), outcomes  # every one answered
    said = [r.message for r in caplog.records if f"scheduling policy {policy.name}" in r.message]
    assert 1 <= len(said) <= 2 and all("llama-server's rule" in m or "arrival order" in m for m in said), said  # once a kind


class Remembers(LlamaServerPolicy):
    """A policy with a memory: it hears every step and every end (the hooks), and orders by what it heard."""

    name = "remembers"

    def __init__(self):
        self.steps: list[int] = []  # tokens of each step it observed
        self.ended: list[tuple[int, str]] = []  # (request id, End or error) in the order they ended

    def observe(self, step):
        self.steps.append(step.n_prompt + step.n_generated)

    def finished(self, request, result):
        self.ended.append((request.id, getattr(result, "end", type(result).__name__)))


def test_a_policy_keeps_state_and_hears_every_step_and_every_end(model):
    policy = Remembers()
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=512, n_threads=1, policy=policy), start=False) as engine:
        first, second = engine.complete("One", max_tokens=3, ignore_eos=True), engine.complete("Two", max_tokens=3, ignore_eos=True)
        second.cancel()  # leaves the queue without a slot: its end is heard too
        records = list(iter(engine.step, None))
    assert policy.steps == [r.n_prompt + r.n_generated for r in records] and len(records) == 3  # each step, as it ran
    assert policy.ended == [(second.id, End.CANCELLED), (first.id, End.LIMIT)]


# --- the seams: your own sampler, stop matcher, drafter and prompt-cache rule, given in EngineConfig -------------------


class CountedSampler(Sampler):
    calls = 0

    def sample(self, ctx, row):
        CountedSampler.calls += 1
        return super().sample(ctx, row)


class CountedStops(StopMatcher):
    pushes = 0

    def push(self, text):
        CountedStops.pushes += 1
        return super().push(text)


class RepeatLast:
    """A drafter of its own: the last token, twice (it carries its own n_max; no --spec-type needed)."""

    n_max = 2

    def __init__(self):
        self.drafted = 0

    def begin(self, seq, prompt):
        pass

    def draft(self, seq, tokens, last, n_max):
        self.drafted += 1
        return [last] * min(2, n_max)

    def accept(self, seq, n_drafted, n_accepted):
        pass


def test_a_sampler_a_stop_matcher_a_drafter_and_a_cache_rule_of_your_own_are_used_and_named(model):
    drafter, chosen = RepeatLast(), []

    def newest(entries, held, prompt):
        chosen.append(len(entries))
        return len(entries) - 1 if entries else None

    config = EngineConfig(n_parallel=1, n_ctx=1024, n_threads=1, cache_ram_mib=64, sampler=CountedSampler, stop_matcher=CountedStops,
                          drafter=drafter, cache_choice=newest)  # fmt: skip
    with Engine(model, config) as engine:
        first = engine.complete("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
        first.result()
        engine.complete("The capital of France", max_tokens=2, temperature=0).result()  # another prompt: a swap, the rule asked
        named = engine.config.to_dict()
    assert CountedSampler.calls >= 8 and CountedStops.pushes >= 8 and drafter.drafted > 0 and chosen
    assert first.outcome is not None and first.outcome.timings.draft_n > 0  # drafted under --spec-type none
    assert (named["sampler"], named["stop_matcher"], named["drafter"], named["cache_choice"], named["policy"]) == (
        "test_engine.CountedSampler", "test_engine.CountedStops", "test_engine.RepeatLast",
        "test_engine.test_a_sampler_a_stop_matcher_a_drafter_and_a_cache_rule_of_your_own_are_used_and_named.<locals>.newest",
        "llama-server",
    )  # fmt: skip


class Stuck(LlamaServerPolicy):
    """A policy that stops in ``order`` until the test lets it go (a slow plug-in, made deterministic)."""

    name = "stuck"

    def __init__(self):
        self.inside, self.go = threading.Event(), threading.Event()

    def order(self, waiting, slots):
        self.inside.set()
        self.go.wait(60)
        return list(waiting)


def test_a_policy_that_takes_its_time_delays_no_submit(model):
    # The policy decides on a snapshot, outside the lock the server's event loop takes to submit: while it is stuck
    # in order(), a request is still accepted (a deadlock guard of 30 s, not a timer: it returns at once or never).
    policy = Stuck()
    with Engine(model, EngineConfig(n_parallel=1, n_ctx=512, n_threads=1, policy=policy)) as engine:
        first = engine.complete("One", max_tokens=2, temperature=0)
        assert policy.inside.wait(30)  # the engine's thread is in the policy now
        submitted = []
        thread = threading.Thread(target=lambda: submitted.append(engine.complete("Two", max_tokens=2, temperature=0)))
        thread.start()
        thread.join(30)
        assert submitted and not thread.is_alive()  # accepted while the policy was stuck
        policy.go.set()
        assert first.result() is not None and submitted[0].result() is not None


class Breaks:
    """A drafter that raises in each method, or drafts what no model can decode: its drafts are lost, nothing else."""

    n_max = 3

    def __init__(self, how: str):
        self.how = how

    def begin(self, seq, prompt):
        if self.how == "raises":
            raise RuntimeError("a bug in begin")

    def draft(self, seq, tokens, last, n_max):
        if self.how == "raises":
            raise RuntimeError("a bug in draft")
        return [10**9, -1][:n_max] if self.how == "nonsense" else [last] * (n_max + 5)  # out of the vocabulary; too long

    def accept(self, seq, n_drafted, n_accepted):
        raise RuntimeError("a bug in accept")


class BoomStops(StopMatcher):
    """A stop matcher that breaks on one request's stop string only."""

    def push(self, text):
        if "boom" in self.stops:
            raise RuntimeError("a bug in push")
        return super().push(text)


@pytest.mark.parametrize("how", ["raises", "nonsense", "too long"])
def test_a_drafter_that_breaks_loses_its_drafts_and_no_request(model, how, caplog):
    config = EngineConfig(n_parallel=2, n_ctx=1024, n_threads=1, drafter=Breaks(how))
    with Engine(model, config) as engine, caplog.at_level("WARNING", logger="llmkit.engine"):
        requests = [engine.complete(f"Count to {k}:", max_tokens=6, temperature=0, ignore_eos=True) for k in range(3)]
        outcomes = [r.result() is not None and r.outcome for r in requests]
    assert all(o and o.end is End.LIMIT and o.n_output == 6 and o.timings.draft_n == 0 for o in outcomes), outcomes
    said = [r.message for r in caplog.records if "drafter Breaks" in r.message]
    assert said and len(said) == len(set(said)) <= 2, said  # each kind once


def test_a_stop_matcher_that_raises_ends_its_own_request_only(model):
    with Engine(model, EngineConfig(n_parallel=2, n_ctx=1024, n_threads=1, stop_matcher=BoomStops)) as engine:
        broken = engine.complete("Count to ten:", max_tokens=6, temperature=0, stop=["boom"])
        fine = engine.complete("Count to five:", max_tokens=6, temperature=0, ignore_eos=True)
        with pytest.raises(EngineError, match="sampling failed: a bug in push"):
            broken.result()
        assert fine.result() is not None and fine.outcome is not None and fine.outcome.end is End.LIMIT
