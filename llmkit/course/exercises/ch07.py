"""Chapter 7 (reading llama-server): which slot, where a long prompt is refused, decodes per prompt, a Messages request
with tools, and get_available_slot in Python."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, LLAMA, SOURCE, Chapter, Guard, Wrong, call
from llmkit.course.exercises.lab import LAB, metric, one_by_one, quiet_engine, slot_of
from llmkit.engine import testing
from llmkit.engine.policy import LlamaServerPolicy
from llmkit.engine.request import Request, RequestParams
from llmkit.engine.slot import Slot
from llmkit.engine.tokens import common_prefix

CHAPTER = Chapter(7)
FLAGS = ("-np", "2", "-c", "4096", "-t", "1", "--temp", "0", "--seed", "1")
SERVERS = ("llmkit", "llmkit --cache-ram 0", "llama-server", "llama-server --cache-ram 0")


# --- exercise 1: predict the slot -----------------------------------------------------------------------------------

LONG_A = "You are a museum guide. " + " ".join(f"Room {i} shows paintings of the {i}th century." for i in range(20))


def three_requests(kind: str, *extra: str) -> tuple[float, str]:
    """A, B, A again (another question): the share of A again's prompt read from the cache, and how B's slot was chosen
    (llama-server's log; llmkit: whether B took A's slot)."""
    server = LAB.server(kind, *FLAGS, *extra)

    def ask(system: str, question: str) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=300).json()

    before = server.log()
    answers = [ask(LONG_A, "Which room has the maps?"), ask("Translate to German.", "Good evening."), ask(LONG_A, "Where is the cafe?")]
    chosen = [line for line in server.log()[len(before) :].splitlines() if "get_availabl" in line]
    b_rule = chosen[1] if kind == "llama-server" and len(chosen) > 1 else ""
    return answers[2]["timings"]["cache_n"] / answers[2]["usage"]["prompt_tokens"], b_rule


def shares_and_rule() -> tuple[dict[str, float], bool]:
    runs = {
        "llmkit": three_requests("slots"),
        "llmkit --cache-ram 0": three_requests("slots", "--cache-ram", "0"),
        "llama-server": three_requests("llama-server"),
        "llama-server --cache-ram 0": three_requests("llama-server", "--cache-ram", "0"),
    }
    return {name: share for name, (share, _) in runs.items()}, "LCP similarity" in runs["llama-server"][1]


@CHAPTER.exercise(1, answers=("b_by_similarity", "share_cached"), compares=(LIVE, LLAMA),
                  writes="a prediction (True or False) and the share of a prompt read from the cache on four servers (a dict)")  # fmt: skip
def q1(b_by_similarity, share_cached) -> str:
    expect.truth("b_by_similarity", b_by_similarity)
    expect.mapping("share_cached", share_cached, SERVERS)
    for name in SERVERS:
        share = expect.number(f"share_cached[{name!r}]", share_cached[name])
        if not 0 <= share <= 1:
            raise Wrong(tr("share_cached[{name!r}] is a share of the prompt, between 0 and 1, not {got}", name=name, got=share))
    shares, by_similarity = LAB.memo("ch7-three-requests", shares_and_rule)
    expect.same("b_by_similarity", b_by_similarity, by_similarity)
    for name in SERVERS:
        expect.near(f"share_cached[{name!r}]", share_cached[name], shares[name], 0.15,
                    tr("the template's and the question's tokens are hard to count by eye"))  # fmt: skip
    return tr("measured just now: {shares}", shares=", ".join(f"{name} {share:.2f}" for name, share in shares.items()))


# --- exercise 2: where a prompt that is too long is refused ---------------------------------------------------------

TOO_LONG = {"messages": [{"role": "user", "content": "word " * 2500}], "max_tokens": 4, "stream": True}
HALF = 24  # events of a busy stream: half way through its answer
BUSY = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 48, "ignore_eos": True, "stream": True}


def refused_while_busy(url: str) -> tuple[int, bool]:
    """Both slots busy with a stream each, then the too-long prompt: (the n_ctx it reports, refused before a stream ended?)."""
    got, started = [0, 0], threading.Barrier(3, timeout=300)

    def busy(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=BUSY, timeout=300) as r:
            started.wait()
            for line in r.iter_lines():
                got[i] += line.startswith("data: ")

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(busy, i) for i in (0, 1)]
        started.wait()
        refused = httpx.post(f"{url}/v1/chat/completions", json=TOO_LONG, timeout=300)
        at_refusal = list(got)
        for run in running:
            run.result()
    return refused.json()["error"]["n_ctx"], max(at_refusal) < HALF


def refusals() -> dict[str, tuple[int, bool]]:
    return {
        "llmkit": refused_while_busy(LAB.server("slots", *FLAGS).url),
        "llama-server": refused_while_busy(LAB.server("llama-server", *FLAGS).url),
    }


@CHAPTER.exercise(2, answers=("n_ctx_reported", "refused_at_once"), compares=(LIVE, LLAMA),
                  writes="a prediction (a number) and which server refuses at once (a dict of True or False)")  # fmt: skip
def q2(n_ctx_reported, refused_at_once) -> str:
    expect.whole_number("n_ctx_reported", n_ctx_reported)
    expect.mapping("refused_at_once", refused_at_once, ("llmkit", "llama-server"))
    measured = LAB.memo("ch7-refusals", refusals)
    expect.same("n_ctx_reported", n_ctx_reported, measured["llmkit"][0])
    for name in ("llmkit", "llama-server"):
        expect.same(f"refused_at_once[{name!r}]", expect.truth(f"refused_at_once[{name!r}]", refused_at_once[name]), measured[name][1])
    at_once = {name: tr("at once") if measured[name][1] else tr("once a slot was free") for name in measured}
    return tr("both servers reported n_ctx {n}; with both slots busy, llmkit refused {llmkit}, llama-server {llama}",
              n=measured["llmkit"][0], llmkit=at_once["llmkit"], llama=at_once["llama-server"])  # fmt: skip


# --- exercise 3: one step of pre_decode in build_batch --------------------------------------------------------------


def decodes_of(url: str, n_words: int) -> tuple[int, int]:
    """A prompt of about ``n_words`` words, one token asked: (its prompt tokens, the decodes the server ran for it)."""
    before = metric(url, "n_decode_total")
    content = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(n_words // 6))
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={"messages": [{"role": "user", "content": content}],
                                                                          "max_tokens": 1, "cache_prompt": False}).json()  # fmt: skip
    return answer["usage"]["prompt_tokens"], round(metric(url, "n_decode_total") - before)


def measured_decodes() -> list[tuple[str, int, int, int]]:
    """(server, prompt tokens, n_batch, decodes) for prompts of three lengths on both servers at -b 64."""
    out = []
    for name, kind in (("llama-server", "llama-server"), ("llmkit", "slots")):
        server = LAB.server(kind, *FLAGS, "-b", "64", "--metrics")
        for n_words in (30, 90, 150):
            n_prompt, n = decodes_of(server.url, n_words)
            out.append((name, n_prompt, 64, n))
    return out


def plan_steps(n_prompt: int, n_batch: int) -> int:
    """llmkit's build_batch, live: the steps that read an ``n_prompt``-token prompt alone at batch size ``n_batch``."""
    from llmkit.engine.scheduler import Scheduler, build_batch

    busy, steps = testing.running(testing.reading(0, n_prompt, n_ctx=n_prompt + 8)), 0
    while busy[0].job.prompt_left:
        Scheduler.commit(build_batch(busy, n_batch, 0))
        steps += 1
    return steps


@CHAPTER.exercise(3, answers=("n_decodes",), compares=(LLAMA, HIDDEN), writes="n_decodes(n_prompt, n_batch) (a function)")
def q3(n_decodes) -> str:
    fn = expect.function("n_decodes", n_decodes, 2)
    for n_prompt, n_batch in ((1, 64), (64, 64), (65, 64), (300, 100), (2048, 2048), (2049, 512), (7, 1)):
        yours = call(fn, n_prompt, n_batch, case=tr("a prompt of {n} tokens at -b {b}", n=n_prompt, b=n_batch))
        expected = plan_steps(n_prompt, n_batch)
        if yours != expected:
            raise Wrong(tr("a prompt of {n} tokens at -b {b}: yours says {yours} decodes, not what llmkit's build_batch plans",
                           n=n_prompt, b=n_batch, yours=expect.shown(yours)))  # fmt: skip
    for name, n_prompt, n_batch, measured in LAB.memo("ch7-decodes", measured_decodes):
        yours = call(fn, n_prompt, n_batch, case=tr("{server}, a prompt of {n} tokens at -b {b}", server=name, n=n_prompt, b=n_batch))
        if yours != measured:
            raise Wrong(tr("{server}, a prompt of {n} tokens at -b {b}: yours says {yours} decodes, not what its /metrics counted",
                           server=name, n=n_prompt, b=n_batch, yours=expect.shown(yours)))  # fmt: skip
    return tr("right for every size llmkit's build_batch planned and every prompt both servers read just now at -b 64")


# --- exercise 4: a Messages request with tools, through both trees ----------------------------------------------------

TOOL = {"name": "get_weather", "description": "The current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
ASK = {"model": "smollm2", "max_tokens": 64, "messages": [{"role": "user", "content": "What is the weather in Berlin?"}],
       "tools": [TOOL], "tool_choice": {"type": "any"}}  # fmt: skip


def first_blocks() -> dict[str, str]:
    out = {}
    for name, kind in (("llmkit", "slots"), ("llama-server", "llama-server")):
        reply = httpx.post(f"{LAB.server(kind, *FLAGS).url}/v1/messages", json=ASK, timeout=300).json()
        out[name] = reply["content"][0]["type"] if reply.get("content") else "none"
    return out


@CHAPTER.exercise(
    4, answers=("first_block",), compares=(LIVE, LLAMA), writes="a prediction per server: the answer's first block type (a dict)"
)
def q4(first_block) -> str:
    expect.mapping("first_block", first_block, ("llmkit", "llama-server"))
    measured = LAB.memo("ch7-blocks", first_blocks)
    for name in ("llmkit", "llama-server"):
        expect.text(f"first_block[{name!r}]", first_block[name])
        if first_block[name] != measured[name]:
            raise Wrong(
                tr(
                    "first_block[{name!r}] = {yours!r}: {name}'s answer starts with another kind of block",
                    name=name,
                    yours=first_block[name],
                )
            )
    return tr("asked about Berlin (a city the notebook never asked about): {blocks}", blocks=json.dumps(measured))


# --- exercise 5: get_available_slot in Python -------------------------------------------------------------------------


def reference_slot(slots: Sequence[Slot], params: RequestParams, tokens: list[int]) -> Slot | None:
    """llama-server's get_available_slot, line by line (similarity 0.1; no prompt cache): the slot it takes, or None."""
    if params.id_slot is not None:
        named = slots[params.id_slot]
        return None if named.job is not None else named
    best, sim_best = None, 0.0
    for slot in slots:
        if slot.job is not None or not slot.cache_tokens:
            continue
        sim = common_prefix(slot.cache_tokens, tokens) / len(tokens)
        if sim > sim_best and sim > 0.1:
            best, sim_best = slot, sim
    if best is not None:
        return best
    t_last = -1.0
    for slot in slots:
        if slot.job is None and (best is None or slot.t_last_used <= t_last):
            best, t_last = slot, slot.t_last_used
    return best


def idle(i: int, tokens: list[int], t_last_used: float) -> Slot:
    slot = Slot(i, 4096)
    slot.cache_tokens, slot.t_last_used = list(tokens), t_last_used
    return slot


def busy(i: int, tokens: list[int]) -> Slot:
    slot = testing.generating(i)
    slot.cache_tokens = list(tokens)
    return slot


P = list(range(500, 600))  # a prompt of 100 tokens
NAMED = {"": RequestParams(), "slot 1": RequestParams(id_slot=1), "slot 0": RequestParams(id_slot=0)}
# (what the case is, the slots, which slot the request names): none of them is in the notebook
SLOT_CASES: list[tuple[str, Callable[[], list[Slot]], str]] = [
    ("two empty slots, never used", lambda: [idle(0, [], 0.0), idle(1, [], 0.0)], ""),
    ("three empty slots, never used", lambda: [idle(0, [], 0.0), idle(1, [], 0.0), idle(2, [], 0.0)], ""),
    ("slot 0 shares 30 of 100 tokens", lambda: [idle(0, [*P[:30], 1, 2], 5.0), idle(1, [], 1.0)], ""),
    ("slot 1 shares exactly 10 of 100 tokens", lambda: [idle(0, [], 2.0), idle(1, P[:10], 1.0)], ""),
    ("slot 1 shares 11 of 100 tokens", lambda: [idle(0, [], 2.0), idle(1, P[:11], 1.0)], ""),
    ("two slots share 40 tokens each", lambda: [idle(0, [*P[:40], 7], 1.0), idle(1, [*P[:40], 8], 2.0)], ""),
    ("the slot sharing most is busy", lambda: [busy(0, P[:90]), idle(1, P[:20], 3.0), idle(2, [], 1.0)], ""),
    ("every slot busy", lambda: [busy(0, []), busy(1, P)], ""),
    ("the least recently used of three", lambda: [idle(0, [9], 3.0), idle(1, [8], 1.0), idle(2, [7], 2.0)], ""),
    ("slot 1 named, idle, sharing nothing", lambda: [idle(0, P, 1.0), idle(1, [], 2.0)], "slot 1"),
    ("slot 0 named, busy", lambda: [busy(0, P), idle(1, P, 2.0)], "slot 0"),
]


def check_slots(rule: Callable) -> None:
    for case, make_slots, named in SLOT_CASES:
        yours = call(rule, make_slots(), NAMED[named], list(P), case=case)
        expected = reference_slot(make_slots(), NAMED[named], list(P))
        if yours is not None and not isinstance(yours, Slot):
            raise Wrong(tr("{case}: expected a Slot of the list, or None; got {got}", case=case, got=expect.shown(yours)))
        if (yours.id if yours is not None else None) != (expected.id if expected is not None else None):
            got = tr("slot {i}", i=yours.id) if yours is not None else tr("None (wait)")
            raise Wrong(tr("{case}: yours takes {got}, not the slot get_available_slot takes", case=case, got=got))


@dataclass(frozen=True)
class SlotRule(LlamaServerPolicy):
    """llama-server's policy, but for the slot choice: ``rule`` (the learner's function)."""

    rule: Callable[[Sequence[Slot], RequestParams, list[int]], Slot | None] = reference_slot

    def choose_slot(self, slots: Sequence[Slot], request: Request, tokens: list[int]) -> Slot | None:
        return self.rule(slots, request.params, tokens)


def sequence_prompts() -> list[list[int]]:
    tokenize = LAB.model().tokenize
    museum, french = tokenize(LONG_A + " Which room has the maps?"), tokenize("Translate to French: good morning, everyone.")
    return [
        museum,
        french,
        tokenize(LONG_A + " Where is the cafe?"),
        french[:-2] + tokenize(" evening.", add_special=False),
        tokenize("Name three colours."),
        museum,
    ]


def engine_slots(rule: Callable, guard: Guard | None = None) -> list[int | None]:
    """The slot each request of the sequence got, one at a time, in a real engine with 2 slots and no prompt cache."""
    from llmkit.engine import Engine, EngineConfig

    config = EngineConfig(n_parallel=2, n_ctx=4096, n_threads=1, cache_ram_mib=0, policy=SlotRule(rule))
    with quiet_engine(), Engine(LAB.model(), config) as engine:
        params = RequestParams.of(max_tokens=1, temperature=0)
        return [slot_of(r) for r in one_by_one(lambda prompt: engine.submit(prompt, params), sequence_prompts(), guard)]


def llama_slots() -> list[int]:
    """The same sequence on llama-server (2 slots, no prompt cache): the slot of each request, from its answers."""
    server = LAB.server("llama-server", "-np", "2", "-c", "4096", "-t", "1", "--cache-ram", "0")
    return [answer["id_slot"] for answer in servers.completions(server.url, sequence_prompts(), n_predict=1, cache_prompt=True)]


@CHAPTER.exercise(5, answers=("get_available_slot",), compares=(SOURCE, HIDDEN, ENGINE, LLAMA),
                  writes="get_available_slot(slots, params, tokens): llama-server's slot choice (a function)")  # fmt: skip
def q5(get_available_slot) -> str:
    rule = expect.function("get_available_slot", get_available_slot, 3)
    check_slots(rule)
    guard = Guard(tr("in the engine"))
    yours = engine_slots(guard.wrap(rule), guard)
    theirs = LAB.memo("ch7-llama-slots", llama_slots)
    for i, (a, b) in enumerate(zip(yours, theirs, strict=True), 1):
        if a != b:
            raise Wrong(tr("request {i} of the sequence: in the engine your rule gave it slot {yours}, llama-server another", i=i, yours=a))
    return tr("the slot get_available_slot takes in {n} hidden cases, and in a real engine the same slots as llama-server for "
              "a sequence of {m} requests: {slots}", n=len(SLOT_CASES), m=len(theirs), slots=theirs)  # fmt: skip
