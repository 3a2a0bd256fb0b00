"""Chapter 2 (API design): error messages, a stop string, the openai client's exception, counting tokens, a cut answer."""

from __future__ import annotations

from typing import Any

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import LIVE, LLAMA, SERVER, Chapter, Wrong, call
from llmkit.course.exercises.lab import LAB
from llmkit.sequential.translator import PROMPT

CHAPTER = Chapter(2)
TEXT = "Good morning, everyone! The library opens at nine."
MESSAGES = [{"role": "user", "content": PROMPT.format(lang="French", text=TEXT)}]
CHAT_BODY = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 48, "temperature": 0}
JSON = {"Content-Type": "application/json"}


# --- exercise 1: one function for both error shapes ----------------------------------------------------------------


def error_answers() -> list[tuple[str, httpx.Response]]:
    """Error answers the notebook never showed, from the three servers: (what was asked, the answer)."""
    seq, slots, llama = servers.sequential(), servers.slots(), servers.llama()
    too_long = {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}
    asked: list[tuple[str, str, str, dict[str, Any]]] = [
        (tr("the sequential server, a body without text"), seq.url, "/translate", {"json": {"target_lang": "French"}}),
        (tr("the sequential server, an unknown path"), seq.url, "/nowhere", {"json": {}}),
        (tr("the sequential server, half a JSON body"), seq.url, "/translate", {"content": b'{"text": ', "headers": JSON}),
        (
            tr("the slot server, max_tokens as a string"),
            slots.url,
            "/v1/chat/completions",
            {"json": {"messages": MESSAGES, "max_tokens": "x"}},
        ),
        (tr("the slot server, an unknown path"), slots.url, "/nowhere", {"json": {}}),
        (tr("the slot server, a prompt over the context"), slots.url, "/v1/chat/completions", {"json": too_long}),
        (tr("llama-server, a body without messages"), llama.url, "/v1/chat/completions", {"json": {"model": "x"}}),
        (tr("llama-server, half a JSON body"), llama.url, "/v1/chat/completions", {"content": b'{"x":', "headers": JSON}),
        (tr("llama-server, a prompt over the context"), llama.url, "/v1/chat/completions", {"json": too_long}),
    ]
    return [(what, httpx.post(url + path, timeout=120, **kw)) for what, url, path, kw in asked]


def message_in(response: httpx.Response) -> str:
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


@CHAPTER.exercise(1, answers=("error_message",), compares=(SERVER, LLAMA), writes="error_message(response) (a function)")
def q1(error_message) -> str:
    fn = expect.function("error_message", error_message, 1)
    cases = LAB.memo("ch2-error-answers", error_answers)
    for what, response in cases:
        case = tr("{what} ({status})", what=what, status=response.status_code)
        yours = call(fn, response, case=case)
        if not isinstance(yours, str):
            raise Wrong(tr("{case}: expected the error's message, a string; got {got}", case=case, got=expect.shown(yours)))
        if yours != message_in(response):
            raise Wrong(tr("{case}: the string yours returned is not the message of the error", case=case))
    return tr("the message of all {n} error answers, from the sequential server, the slot server and llama-server", n=len(cases))


# --- exercise 2: a stop string --------------------------------------------------------------------------------------


def stopped_answers() -> dict[str, tuple[str, dict]]:
    """Each server: (the whole answer, the answer with stop ["!"])."""
    out = {}
    for name, server in servers.both().items():
        whole = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT_BODY, timeout=120).json()["choices"][0]["message"]["content"]
        stopped = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT_BODY, "stop": ["!"]}, timeout=120).json()["choices"][0]
        out[name] = (whole, stopped)
    return out


@CHAPTER.exercise(
    2,
    answers=("bang_in_text", "finish_reason"),
    compares=(LIVE,),
    writes="two predictions: is the stop string in the text; the finish_reason",
)
def q2(bang_in_text, finish_reason) -> str:
    expect.truth("bang_in_text", bang_in_text)
    expect.text("finish_reason", finish_reason)
    measured = LAB.memo("ch2-stopped", stopped_answers)
    for name, (whole, stopped) in measured.items():
        if "!" not in whole:
            raise RuntimeError(f"{name}'s whole answer has no '!': the experiment needs one ({whole!r})")
        expect.same("bang_in_text", bang_in_text, "!" in stopped["message"]["content"])
        if finish_reason != stopped["finish_reason"]:
            raise Wrong(tr("finish_reason = {yours!r}: {server} said something else", yours=finish_reason, server=name))
    return tr("both servers cut the answer where the stop string starts, and said so in finish_reason")


# --- exercise 3: the openai client and a prompt that is too long ----------------------------------------------------


def too_long_raised() -> list[tuple[str, BaseException | None, int]]:
    """(server, what the openai client raised, that server's n_ctx) for a prompt over the context."""
    import openai

    configs = [
        ("slots", ("slots", *servers.SLOT_FLAGS), 2048),
        ("llama-server", ("llama-server", "-t", "1", "-np", "1", "-c", "1024"), 1024),
    ]
    out: list[tuple[str, BaseException | None, int]] = []
    for name, (kind, *flags), n_ctx in configs:
        server = LAB.server(kind, *flags)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)
        try:
            client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4)
            out.append((name, None, n_ctx))
        except openai.APIError as exc:
            out.append((name, exc, n_ctx))
    return out


@CHAPTER.exercise(3, answers=("exception_class", "n_ctx_of"), compares=(LIVE, LLAMA),
                  writes="the exception class predicted; n_ctx_of(exc) (a function)")  # fmt: skip
def q3(exception_class, n_ctx_of) -> str:
    expect.klass("exception_class", exception_class)
    fn = expect.function("n_ctx_of", n_ctx_of, 1)
    for name, raised, n_ctx in LAB.memo("ch2-too-long", too_long_raised):
        if raised is None:
            raise RuntimeError(f"the openai client raised nothing against {name}")
        if type(raised) is not exception_class:
            if isinstance(raised, exception_class):
                raise Wrong(tr("exception_class: the client raised a subclass of {cls}: which one?", cls=exception_class.__name__))
            raise Wrong(tr("exception_class: the client raised something that is not a {cls}", cls=exception_class.__name__))
        yours = call(fn, raised, case=tr("the exception from {server}", server=name))
        if yours != n_ctx:
            raise Wrong(tr("n_ctx_of(the exception from {server}) returned {got}: not the context size that server reported",
                           server=name, got=expect.shown(yours)))  # fmt: skip
    return tr("the client raised {cls} on both servers, and n_ctx_of found each one's context size", cls=exception_class.__name__)


# --- exercise 4: count before you send ------------------------------------------------------------------------------

RIVERS = [{"role": "user", "content": "Name three rivers in Europe."}]
COUNTED = [  # (case, system prompt, messages)
    ("the chapter's question", None, MESSAGES),
    ("the chapter's question, again", None, MESSAGES),
    ("another question, with a system prompt", "Answer briefly.", RIVERS),
    ("that question once more", "Answer briefly.", RIVERS),
]


def messages_and_counts() -> list[tuple[str, dict, int]]:
    """(case, a Messages answer, what count_tokens says for the same request), on both servers, in order."""
    out = []
    for name, server in servers.both().items():
        for what, system, messages in COUNTED:
            asked = {"model": "smollm2", "messages": messages, **({"system": system} if system else {})}
            answer = httpx.post(f"{server.url}/v1/messages", json={**asked, "max_tokens": 4, "temperature": 0}, timeout=120)
            count = httpx.post(f"{server.url}/v1/messages/count_tokens", json=asked, timeout=60)
            if answer.status_code != 200 or count.status_code != 200:
                raise RuntimeError(f"{name} answered {answer.status_code} and {count.status_code}: {answer.text[:200]} {count.text[:200]}")
            out.append((f"{name}: {what}", answer.json(), count.json()["input_tokens"]))
    return out


@CHAPTER.exercise(
    4,
    answers=("prompt_size",),
    compares=(LIVE, LLAMA),
    writes="prompt_size(answer): what count_tokens says, from a Messages answer (a function)",
)
def q4(prompt_size) -> str:
    fn = expect.function("prompt_size", prompt_size, 1)
    for case, answer, counted in LAB.memo("ch2-counted", messages_and_counts):
        yours = call(fn, answer, case=case)
        if not expect.is_int(yours):
            raise Wrong(tr("{case}: expected a number of tokens; got {got}", case=case, got=expect.shown(yours)))
        if yours != counted:
            side = tr("too high") if yours > counted else tr("too low")
            raise Wrong(
                tr("{case}: yours says {n} tokens, {side}: not what count_tokens says for the same request", case=case, n=yours, side=side)
            )
    return tr("what count_tokens says, from every Messages answer of both servers, cached or not")


# --- exercise 5: was it cut? ---------------------------------------------------------------------------------------

APIS = {
    "chat": ("/v1/chat/completions", lambda budget, stop: {"messages": MESSAGES, "max_tokens": budget, **({"stop": stop} if stop else {})}),
    "responses": ("/v1/responses", lambda budget, stop: {"input": MESSAGES[0]["content"], "max_output_tokens": budget}),
    "messages": (
        "/v1/messages",
        lambda budget, stop: {"messages": MESSAGES, "max_tokens": budget, **({"stop_sequences": stop} if stop else {})},
    ),
}
VARIANTS = {"cut at 5": (5, None), "whole": (200, None), "a stop string": (200, [","])}


def answers_and_truth() -> list[tuple[str, str, dict, int, bool]]:
    """(case, api, answer, budget, cut?) on both servers; cut: the same request through chat said "length"."""
    out = []
    for name, server in servers.both().items():
        for variant, (budget, stop) in VARIANTS.items():
            chat_twin = None
            for api, (path, make) in APIS.items():
                if stop and api == "responses":
                    continue  # Responses has no stop strings
                answer = httpx.post(
                    server.url + path, json={"model": "smollm2", "temperature": 0, **make(budget, stop)}, timeout=120
                ).json()
                chat_twin = answer if api == "chat" else chat_twin
                assert chat_twin is not None
                cut = chat_twin["choices"][0]["finish_reason"] == "length"
                out.append((f"{name}, {api}, {variant}", api, answer, budget, cut))
    return out


@CHAPTER.exercise(5, answers=("was_cut",), compares=(LIVE, LLAMA), writes="was_cut(api, answer, budget) (a function)")
def q5(was_cut) -> str:
    fn = expect.function("was_cut", was_cut, 3)
    cases = LAB.memo("ch2-cut", answers_and_truth)
    for case, api, answer, budget, cut in cases:
        yours = call(fn, api, answer, budget, case=case)
        if not isinstance(yours, bool):
            raise Wrong(tr("{case}: expected True or False; got {got}", case=case, got=expect.shown(yours)))
        if yours != cut:
            raise Wrong(tr("{case}: yours says {yours}, but the budget {did} end this answer", case=case, yours=yours,
                           did=tr("did not") if yours else tr("did")))  # fmt: skip
    return tr("right on all {n} answers: three APIs, two servers, cut, whole and stopped by a stop string", n=len(cases))
