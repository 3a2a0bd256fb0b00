"""Chapter 6 (structured output): a GBNF for dates, an integer range, an enum parameter, parallel calls, the lazy trigger."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from llmkit.course import tr
from llmkit.course.exercises import expect, servers
from llmkit.course.exercises.core import ENGINE, HIDDEN, LIVE, LLAMA, SERVER, Chapter, Wrong
from llmkit.course.exercises.lab import LAB, parallel

CHAPTER = Chapter(6)


# --- exercise 1: a GBNF for ISO dates -------------------------------------------------------------------------------


def accepts(grammar: object, text: str) -> bool:
    """Does ``grammar`` (a parsed ``llmkit.grammar.Grammar``) accept exactly ``text``, token by token, then the end?"""
    model = LAB.model()
    sampler = grammar.sampler.clone()  # type: ignore[attr-defined]
    try:
        for token in model.tokenize(text, add_special=False, parse_special=False):
            if not sampler.allows(token):
                return False
            sampler.accept(token)
        return any(sampler.allows(eog) for eog in model.eog_tokens)
    finally:
        sampler.close()


VALID_DATES = ["1989-11-09", "1969-07-20", "2000-02-29", "2024-12-31", "1900-01-01", "2010-10-10", "1999-09-30"]
INVALID_DATES = ["1989-13-01", "1989-00-10", "1989-11-32", "1989-11-00", "1989-1-09", "1989-11-9", "89-11-09", "1989/11/09",
                 "1989-11-09T10:00", "1989-11-09 ", "19891109", ""]  # fmt: skip
DATE = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])")
DATE_QUESTIONS = ["When did the Titanic sink?", "When was the Eiffel Tower finished?", "What is the date of New Year's Day 2000?"]


def unseen_dates(n: int = 8) -> list[str]:
    """``n`` valid dates drawn now (years 1000-2999, any month, any day it has): a grammar that lists dates misses them."""
    import calendar
    import random

    draw = random.Random()
    dates = []
    for _ in range(n):
        year, month = draw.randrange(1000, 3000), draw.randrange(1, 13)
        dates.append(f"{year:04d}-{month:02d}-{draw.randrange(1, calendar.monthrange(year, month)[1] + 1):02d}")
    return dates


def ask_with(url: str, grammar: str, question: str, seed: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0.8, "seed": seed, "grammar": grammar}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if answer.status_code != 200:
        raise Wrong(tr("the server refused your grammar: {status} {error}", status=answer.status_code, error=answer.text[:300]))
    return answer.json()["choices"][0]


@CHAPTER.exercise(1, answers=("ISO_DATE", "finish_reason_predicted"), compares=(HIDDEN, SERVER, LLAMA),
                  writes="a GBNF grammar (a string) and a prediction (a finish_reason)")  # fmt: skip
def q1(ISO_DATE, finish_reason_predicted) -> str:
    from llmkit.grammar import Gbnf, GrammarError, compile

    text = expect.text("ISO_DATE", ISO_DATE)
    predicted = expect.text("finish_reason_predicted", finish_reason_predicted)
    try:
        grammar = compile(Gbnf(text), LAB.model())
    except GrammarError as exc:
        raise Wrong(tr("llmkit refuses the grammar: {error}", error=exc)) from None
    valid = [*VALID_DATES, *unseen_dates()]
    for date in valid:
        if not accepts(grammar, date):
            raise Wrong(tr("your grammar refuses the date {date}", date=date))
    for wrong in INVALID_DATES:
        if accepts(grammar, wrong):
            raise Wrong(tr("your grammar accepts {text!r}, which is not a date written YYYY-MM-DD", text=wrong))
    asked = [(server.url, text, q, seed) for server in servers.both().values() for q in DATE_QUESTIONS for seed in (1, 2)]
    for (url, _, question, _), choice in zip(asked, parallel(ask_with, asked), strict=True):
        server = "llama-server" if url == servers.llama().url else tr("the slot server")
        if not DATE.fullmatch(choice["message"]["content"]) or choice["finish_reason"] != "stop":
            raise Wrong(tr("{server}, asked {question!r} with your grammar, answered {answer!r} ({reason})", server=server,
                           question=question, answer=choice["message"]["content"], reason=choice["finish_reason"]))  # fmt: skip
        expect.same("finish_reason_predicted", predicted, choice["finish_reason"], ordered=False)
    return tr("{valid} dates accepted, {invalid} look-alikes refused, and {n} answers of both servers at temperature 0.8, every "
              "one a date that ended the answer", valid=len(valid), invalid=len(INVALID_DATES), n=len(asked))  # fmt: skip


# --- exercise 2: a range the grammar can enforce ----------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number"}},
    "required": ["sentiment", "confidence"],
    "additionalProperties": False,
}  # the chapter's own
PERCENT_QUESTION = ("Analyze the sentiment of this review and return it as JSON with keys sentiment (positive/negative/neutral) "
                    "and confidence (an integer percentage, 0-100).\n\nReview: ")  # fmt: skip
HIDDEN_REVIEWS = ["The hinge squeaks but the keyboard is a joy.", "Arrived broken, and support never answered.", "It is a chair."]


def ask_percent(url: str, schema: dict, review: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": PERCENT_QUESTION + review}], "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "sentiment", "strict": True, "schema": schema}}})  # fmt: skip


@CHAPTER.exercise(2, answers=("PERCENT", "strict_accepts"), compares=(ENGINE, LLAMA, LIVE),
                  writes="a JSON Schema (a dict) and a prediction (True or False)")  # fmt: skip
def q2(PERCENT, strict_accepts) -> str:
    import jsonschema

    schema: dict[str, Any] = expect.mapping("PERCENT", PERCENT)
    expect.truth("strict_accepts", strict_accepts)
    confidence = schema.get("properties", {}).get("confidence", {})
    if confidence.get("type") != "integer" or confidence.get("minimum") != 0 or confidence.get("maximum") != 100:
        raise Wrong(tr("PERCENT's confidence is not an integer from 0 to 100: {got}", got=json.dumps(confidence)))
    if {k: v for k, v in schema.get("properties", {}).items() if k != "confidence"} != {"sentiment": SCHEMA["properties"]["sentiment"]}:
        raise Wrong(tr("PERCENT should keep the chapter's schema but for confidence (the sentiment as it was)"))
    answers = {name: parallel(ask_percent, [(server.url, schema, r) for r in HIDDEN_REVIEWS]) for name, server in servers.both().items()}
    accepted = all(r.status_code == 200 for r in answers["slots"])
    expect.same("strict_accepts", strict_accepts, accepted)
    validator = jsonschema.Draft202012Validator(schema)
    for name, responses in answers.items():
        for review, r in zip(HIDDEN_REVIEWS, responses, strict=True):
            if r.status_code != 200:
                continue  # the slot server refused it: that was the prediction's business
            value = json.loads(r.json()["choices"][0]["message"]["content"])
            if not validator.is_valid(value):
                raise Wrong(
                    tr("{server}'s answer to {review!r} with your schema is outside it: {value}", server=name, review=review, value=value)
                )
    return tr("the slot server accepted the schema with strict: true, and both servers answered {n} new reviews with an integer "
              "confidence from 0 to 100", n=len(HIDDEN_REVIEWS))  # fmt: skip


# --- exercise 3: a tool with an enum parameter ------------------------------------------------------------------------

WEATHER: dict[str, Any] = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}  # fmt: skip


def forced_calls(tool: dict) -> list[dict]:
    def ask(url: str, seed: int) -> dict:
        body = {"messages": [{"role": "user", "content": "What's the weather in Boston, in Celsius?"}], "max_tokens": 80,
                "tools": [{"type": "function", "function": tool}], "tool_choice": "required", "temperature": 0.8, "seed": seed}  # fmt: skip
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]

    return parallel(ask, [(servers.slots().url, seed) for seed in range(4)])


@CHAPTER.exercise(3, answers=("WEATHER_UNIT", "unit_rule"), compares=(ENGINE, LIVE),
                  writes="a tool definition (a dict) and the grammar rule its unit becomes (a string)")  # fmt: skip
def q3(WEATHER_UNIT, unit_rule) -> str:
    import jsonschema

    from llmkit.server.tools import Tool, ToolCalling

    tool: dict[str, Any] = expect.mapping("WEATHER_UNIT", WEATHER_UNIT)
    expect.mapping("WEATHER_UNIT['parameters']", tool.get("parameters"))
    rule_text = expect.text("unit_rule", unit_rule)
    parameters = tool["parameters"]
    if set(parameters.get("required", [])) != {"city", "unit"}:
        raise Wrong(tr("WEATHER_UNIT should require city and unit, not {got}", got=parameters.get("required")))
    if parameters.get("properties", {}).get("city") != WEATHER["parameters"]["properties"]["city"]:
        raise Wrong(tr("WEATHER_UNIT's city should be the chapter's, unchanged"))
    unit = parameters.get("properties", {}).get("unit", {})
    if sorted(unit.get("enum", [])) != ["celsius", "fahrenheit"]:
        raise Wrong(tr("WEATHER_UNIT's unit should be one of two strings, celsius or fahrenheit: {got}", got=json.dumps(unit)))
    gbnf, _ = ToolCalling([Tool(**tool)], mode="required").grammar() or ("", None)
    rule = next((line for line in gbnf.splitlines() if line.startswith("get-weather-arguments-unit ::=")), "")
    if " ".join(rule_text.split()) not in (" ".join(rule.split()), " ".join(rule.split("::=", 1)[-1].split())):
        raise Wrong(tr("unit_rule is not the rule ToolCalling(...).grammar() writes for your unit: print the grammar and copy it"))
    calls = forced_calls(tool)
    validator = jsonschema.Draft202012Validator(parameters)
    arguments = [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) for c in calls if c["message"].get("tool_calls")]
    if len(arguments) < len(calls) or not all(validator.is_valid(a) for a in arguments):
        raise Wrong(tr("of four calls forced with your tool, {n} had valid arguments", n=sum(validator.is_valid(a) for a in arguments)))
    return tr("the unit's rule is {rule!r}; of four calls at temperature 0.8 for a question the notebook never asked, {n} valid",
              rule=rule.split("::=", 1)[-1].strip(), n=sum(validator.is_valid(a) for a in arguments))  # fmt: skip


# --- exercise 4: parallel calls, when asked ---------------------------------------------------------------------------


def calls_by_default() -> int:
    body = {"messages": [{"role": "user", "content": "What's the weather in Paris and in Tokyo?"}], "max_tokens": 120, "temperature": 0,
            "tools": [{"type": "function", "function": WEATHER}], "tool_choice": "required"}  # fmt: skip
    answer = httpx.post(f"{servers.slots().url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]
    return len(answer["message"].get("tool_calls") or [])


@CHAPTER.exercise(4, answers=("n_calls",), compares=(LIVE,), writes="a prediction: how many calls the answer holds by default")
def q4(n_calls) -> str:
    expect.whole_number("n_calls", n_calls)
    measured = LAB.memo("ch6-calls", calls_by_default)
    expect.same("n_calls", n_calls, measured)
    return tr("asked for two cities, the slot server's answer held {n} call by default", n=measured)


# --- exercise 5: reading the lazy trigger -----------------------------------------------------------------------------


def about_the_tag() -> bool:
    """Does a call start inside a sentence, for a question that writes the trigger word? (4 seeds, temperature 0.8)"""

    def ask(url: str, seed: int) -> dict:
        body = {"messages": [{"role": "user", "content": "What is the <tool_call> tag for?"}], "max_tokens": 48, "temperature": 0.8,
                "seed": seed, "tools": [{"type": "function", "function": WEATHER}]}  # fmt: skip
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"][0]

    answers = parallel(ask, [(servers.slots().url, seed) for seed in range(4)])
    return any(c["message"]["content"] and c["message"].get("tool_calls") for c in answers)


@CHAPTER.exercise(5, answers=("call_mid_sentence",), compares=(LIVE,), writes="a prediction (True or False)")
def q5(call_mid_sentence) -> str:
    expect.truth("call_mid_sentence", call_mid_sentence)
    measured = LAB.memo("ch6-trigger", about_the_tag)
    expect.same("call_mid_sentence", call_mid_sentence, measured)
    return tr("four answers at temperature 0.8, just now, as you said")
