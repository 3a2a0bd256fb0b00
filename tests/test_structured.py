"""Structured output on the slot server: JSON Schema and GBNF constraints, over real HTTP.

One server for the module (4 slots of 1024 tokens, one CPU thread). The
validity suite sends every prompt of ``SUITE`` with its schema, greedy and
sampled, four requests at a time, and checks each answer with
``jsonschema`` (the unconstrained "before" rates are measured in the
structured-output chapter, not here). The other tests prove that each kind of bad input is a 400
with its reason, and that pathological schemas and grammars are either
refused or served in bounded time.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel, Field

from llmkit import grammar
from llmkit.course import launch
from llmkit.engine.request import RequestParams
from llmkit.grammar.sampler import Grammar, GrammarSampler
from llmkit.llama import Batch, Context
from llmkit.sampling import Sampler, SamplingParams
from llmkit.server.dialects.openai_chat import ChatCompletionRequest
from llmkit.server.generation import request_params
from llmkit.server.protocol import constraint_of

MAX_TOKENS = 256
SEEDS = (1, 2)  # sampled runs at temperature 0.8, besides the greedy one


@pytest.fixture(scope="module")
def server():
    with launch.serve("slots", "-t", "1", "-np", "4", "-c", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(server, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assert_400(response: httpx.Response, *fragments: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error["message"]


# --- the validity suite -------------------------------------------------------------

SHORT = {"type": "string", "maxLength": 40}

SUITE: list[tuple[str, str, dict]] = [
    (
        "flat object, enum and number",
        ('Analyze the sentiment of this review: "The food was cold and the waiter was rude." Return JSON with '
        '"sentiment" (positive, negative or neutral) and "confidence" (a number from 0 to 1).'),
        {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
         "confidence": {"type": "number"}}, "required": ["sentiment", "confidence"]},
    ),
    (
        "nested objects",
        'Give a fictional person as JSON: "name", and "address" with "street", "city" and "zip" (5 digits).',
        {"type": "object", "properties": {"name": SHORT, "address": {"type": "object", "properties": {
            "street": SHORT, "city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]}}, "required": ["name", "address"]},
    ),
    (
        "array with min and max items",
        'List 2 to 4 tags for a blog post about baking sourdough bread, as JSON: {"tags": [...]}.',
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
         "minItems": 2, "maxItems": 4}}, "required": ["tags"]},
    ),
    (
        "optional and required fields",
        'Describe the movie "Alien" as JSON with "title", and optionally "year" and "director".',
        {"type": "object", "properties": {"title": SHORT, "year": {"type": "integer"}, "director": SHORT},
         "required": ["title"]},
    ),
    (
        "string formats: date and time",
        ('The meeting is on March 3rd 2024 at half past two in the afternoon. Return JSON with "event", '
        '"date" (YYYY-MM-DD) and "time" (HH:MM:SS with a time zone).'),
        {"type": "object", "properties": {"event": SHORT, "date": {"type": "string", "format": "date"},
         "time": {"type": "string", "format": "time"}}, "required": ["event", "date", "time"]},
    ),
    (
        "string formats: uuid and date-time",
        'Create a log record as JSON with "id" (a UUID), "created" (an ISO 8601 date-time) and "level".',
        {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
         "created": {"type": "string", "format": "date-time"}, "level": {"enum": ["debug", "info", "error"]}},
         "required": ["id", "created", "level"]},
    ),
    (
        "integer ranges",
        ('Rate the hotel (1 to 5 stars), give the outside temperature in Celsius and the number of rooms, '
        'as JSON with "stars", "celsius" and "rooms".'),
        {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
         "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
         "rooms": {"type": "integer", "exclusiveMinimum": 0, "maximum": 2000}}, "required": ["stars", "celsius", "rooms"]},
    ),
    (
        "anyOf",
        ('What is the answer to "how many legs does a spider have"? Return JSON {"answer": ...}: a number, '
        'a short text, or null if unknown.'),
        {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, SHORT, {"type": "null"}]}},
         "required": ["answer"]},
    ),
    (
        "array of objects",
        'A shopping list of up to 3 items as JSON: {"items": [{"name": ..., "qty": ...}]}.',
        {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 100}},
            "required": ["name", "qty"]}}}, "required": ["items"]},
    ),
    (
        "top-level array",
        "Name three colors of the rainbow as a JSON array of strings.",
        {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 2, "maxItems": 5},
    ),
    (
        "boolean and const",
        'Is water wet? Answer as JSON with "answer" (true or false), "version" "1.0" and "topic".',
        {"type": "object", "properties": {"answer": {"type": "boolean"}, "version": {"const": "1.0"}, "topic": SHORT},
         "required": ["answer", "version", "topic"]},
    ),
    (
        "$ref and $defs",
        'Give a line segment as JSON: {"start": {"x": ..., "y": ...}, "end": {"x": ..., "y": ...}} with integers.',
        {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"]}}, "type": "object",
         "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"]},
    ),
    (
        "tuple (prefixItems)",
        'Give a city and its population as a JSON array of two elements: ["name", number].',
        {"type": "array", "prefixItems": [SHORT, {"type": "integer", "minimum": 0}], "minItems": 2, "maxItems": 2},
    ),
    (
        "nullable number and pattern",
        ('A product as JSON: "sku" (3 capital letters, a dash, 3 digits), "price" (a number), and "discount" '
        "(a number, or null)."),
        {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
         "price": {"type": "number"}, "discount": {"type": ["number", "null"]}}, "required": ["sku", "price", "discount"]},
    ),
    (
        "any JSON object (empty schema)",
        'Describe a cat as a JSON object.',
        {},
    ),
]  # fmt: skip


def validator(schema: dict) -> jsonschema.protocols.Validator:
    v = jsonschema.Draft202012Validator
    return v(schema or {"type": "object"}, format_checker=v.FORMAT_CHECKER)  # 2020-12 formats (RFC 3339 time)


def run_suite(server, max_tokens: int, seeds: tuple[int, ...] = SEEDS) -> list[dict]:
    jobs = [(name, prompt, schema, seed) for name, prompt, schema in SUITE for seed in (None, *seeds)]

    def one(job):
        name, prompt, schema, seed = job
        body = {"messages": ask(prompt), "max_tokens": max_tokens}
        body |= {"temperature": 0} if seed is None else {"temperature": 0.8, "seed": seed}
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        r = chat(server, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"name": name, "seed": seed, "schema": schema, "text": choice["message"]["content"], "finish": choice["finish_reason"]}

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, jobs))


def validity(results: list[dict]) -> tuple[int, int]:
    """(valid, of): whole answers that parse and validate against their schema."""
    valid = 0
    for r in results:
        try:
            value = json.loads(r["text"])
        except ValueError:
            continue
        if value is not None and validator(r["schema"]).is_valid(value):
            valid += 1
    return valid, len(results)


def test_suite_covers_the_shapes():
    assert len(SUITE) >= 12
    for _, _, schema in SUITE:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert grammar.unenforced_keywords(schema) == [], schema  # every keyword is one the grammar enforces


def test_constrained_outputs_always_validate(server):
    t0 = time.monotonic()
    results = run_suite(server, max_tokens=MAX_TOKENS)
    elapsed = time.monotonic() - t0
    complete = [r for r in results if r["finish"] == "stop"]
    cut = [r for r in results if r["finish"] == "length"]
    assert len(complete) + len(cut) == len(results)
    assert len(complete) >= 0.9 * len(results), [(r["name"], r["seed"], r["text"][-80:]) for r in cut]
    for r in complete:
        value = json.loads(r["text"])  # every complete answer parses ...
        errors = [e.message for e in validator(r["schema"]).iter_errors(value)]
        assert not errors, (r["name"], r["seed"], r["text"], errors)  # ... and validates
    for mode in ("greedy", "sampled"):
        part = [r for r in complete if (r["seed"] is None) == (mode == "greedy")]
        print(
            f"\nconstrained, {mode}: {len(part)}/{len(part)} valid; cut by max_tokens: "
            f"{sum((r['seed'] is None) == (mode == 'greedy') for r in cut)}"
        )
    print(f"constrained suite: {len(results)} requests in {elapsed:.0f} s; cut: {[(r['name'], r['seed']) for r in cut]}")


# --- the request forms ------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}
ASK_PERSON = ask("Describe a person as JSON with name and age.")


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0)
    kind: Literal["capital", "city", "village"]


class Cities(BaseModel):
    cities: list[City] = Field(min_length=1, max_length=2)


def test_openai_client_response_formats(client):
    kw = {"model": "any", "messages": ASK_PERSON, "max_tokens": 64, "temperature": 0}
    r = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        **kw, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    )
    validator(PERSON).validate(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(**kw, response_format={"type": "text"})
    assert r.choices[0].message.content  # plain text, unconstrained


def test_openai_client_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model="any",
        messages=ask("Name one or two European capitals with their country and population, as JSON."),
        max_tokens=200,
        temperature=0,
        response_format=Cities,
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, Cities) and 1 <= len(parsed.cities) <= 2
    assert all(c.population >= 0 and c.kind in ("capital", "city", "village") for c in parsed.cities)


def test_llama_server_fields_json_schema_and_grammar(server):
    r = chat(server, {"messages": ASK_PERSON, "max_tokens": 64, "temperature": 0, "json_schema": PERSON}).json()
    validator(PERSON).validate(json.loads(r["choices"][0]["message"]["content"]))
    yes_no = 'root ::= ("yes" | "no") "."'
    r = chat(server, {"messages": ask("Is the sky blue?"), "max_tokens": 8, "grammar": yes_no}).json()
    assert r["choices"][0]["message"]["content"] in ("yes.", "no.") and r["choices"][0]["finish_reason"] == "stop"
    for body in ({"grammar": yes_no}, {"json_schema": PERSON}):  # completions too
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Q: Is the sky blue?\nA:", "max_tokens": 64, "temperature": 0, **body},
            timeout=120,
        )
        text = r.json()["choices"][0]["text"]
        assert text in ("yes.", "no.") if "grammar" in body else validator(PERSON).is_valid(json.loads(text)), text
    r = httpx.post(f"{server.url}/completion", json={"prompt": "Q: Is the sky blue?\nA:", "n_predict": 8, "grammar": yes_no}, timeout=120)
    assert r.json()["generation_settings"]["grammar"] == yes_no  # the grammar's text, as llama-server reports it


def test_json_object_forms(server):
    """json_object: its own schema, else the top-level json_schema, else any object (llama-server's rules)."""
    kw = {"messages": ASK_PERSON, "max_tokens": 64, "temperature": 0}
    for body in (
        {"response_format": {"type": "json_object", "schema": PERSON}},
        {"response_format": {"type": "json_object"}, "json_schema": PERSON},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    ):
        text = chat(server, kw | body).json()["choices"][0]["message"]["content"]
        validator(PERSON).validate(json.loads(text))
    for body in (
        {"response_format": {"type": "json_object"}},
        {"json_schema": {}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
    ):
        assert isinstance(json.loads(chat(server, kw | body).json()["choices"][0]["message"]["content"]), dict)


def test_streaming_with_a_schema_matches_the_whole_answer(server):
    body = {"messages": ASK_PERSON, "max_tokens": 64, "temperature": 0, "json_schema": PERSON}
    whole = chat(server, body).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == whole and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    validator(PERSON).validate(json.loads(streamed))


def test_cut_by_max_tokens_says_length(server):
    r = chat(server, {"messages": ASK_PERSON, "max_tokens": 5, "temperature": 0, "json_schema": PERSON}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
    with pytest.raises(ValueError):
        json.loads(r["choices"][0]["message"]["content"])  # cut: not (yet) JSON, and the reason says so


def test_constrained_and_unconstrained_requests_share_a_batch(server):
    free = {"messages": ask("Write a long story about a dragon."), "max_tokens": 120, "temperature": 0}
    bound = {"messages": ask("Write a long story about a dragon, as JSON."), "max_tokens": 120, "temperature": 0,
             "json_schema": {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}}  # fmt: skip
    seen = set()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(chat, server, free), pool.submit(chat, server, bound)]
        while not all(f.done() for f in futures):
            state = httpx.get(f"{server.url}/slots", timeout=10).json()
            busy = {s["params"]["grammar"] != "" for s in state if s["is_processing"] and s.get("status") == "generating"}
            if busy == {True, False}:
                seen.add("both")
            time.sleep(0.05)
        assert all(f.result().status_code == 200 for f in futures)
    assert seen == {"both"}  # at some step, one slot was constrained and another was not


# --- bad input: a 400 with the reason ----------------------------------------------------


@pytest.mark.parametrize(
    "body, fragments",
    [
        ({"response_format": {"type": "xml"}}, ["'response_format.type'", "json_schema"]),
        ({"response_format": {"type": "json_schema"}}, ["'response_format.json_schema' is required"]),
        ({"json_schema": {"type": "foo"}}, ["'json_schema'", "cannot be converted", "Unrecognized schema"]),
        ({"json_schema": {"type": "string", "pattern": "[a-z]+"}}, ["Pattern must start with"]),
        ({"json_schema": {"$ref": "https://example.com/schema.json"}}, ["cannot be converted", "Fetching remote"]),
        ({"json_schema": {"properties": {"a": True}}}, ["a schema must be a JSON object"]),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, ["no integer"]),
        ({"json_schema": {"type": "array", "items": {}, "maxItems": "3"}}, ["'maxItems' must be"]),
        ({"response_format": {"type": "json_object", "schema": {"type": "string", "format": "date", "pattern": "^x{0,99999}$"}}},
         ["'response_format.schema'", "repeats too much"]),
        ({"grammar": 'root ::= "a'}, ["does not parse (GBNF)", "unexpected end of input"]),
        ({"grammar": "root ::= foo"}, ["undefined rule 'foo'"]),
        ({"grammar": 'answer ::= "a"'}, ["no 'root' rule"]),
        ({"grammar": 'root ::= "\\q"'}, ["unknown escape"]),
        ({"grammar": 'root ::= "\\x00"'}, ["allows no token"]),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, ["Cannot use both 'json_schema' and 'grammar'"]),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, ["Cannot use both 'grammar'"]),
        ({"json_schema": {}, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, ["Cannot use both"]),
        ({"json_schema": {}, "response_format": {"type": "json_object", "schema": {}}}, ["Cannot use both"]),
        ({"json_schema": "an object"}, ["'json_schema'", "dictionary"]),
        ({"json_schema": [{"type": "object"}]}, ["'json_schema'", "dictionary"]),
        ({"json_schema": True}, ["'json_schema'", "dictionary"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}}, ["'response_format.json_schema.schema'"]),
        ({"response_format": {"type": "json_object", "schema": 3}}, ["'response_format.schema'"]),
        ({"grammar": {"root": "a"}}, ["'grammar'"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"strict": True, "schema": {
            "type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}}}},
         ["strict is true", "multipleOf"]),
        ({"json_schema": {}, "ignore_eos": True}, ["'ignore_eos' cannot be used"]),
    ],
)  # fmt: skip
def test_bad_structured_requests_are_400(server, body, fragments):
    assert_400(chat(server, {"messages": ASK_PERSON, "max_tokens": 8} | body, timeout=60), *fragments)


def test_non_strict_schema_with_unenforced_keywords_is_served(server):
    """As llama-server: keywords the grammar cannot enforce are ignored unless strict is true."""
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}, "required": ["n"]}
    r = chat(
        server, {"messages": ask('Give an even number as JSON {"n": ...}.'), "max_tokens": 40, "temperature": 0, "json_schema": schema}
    )
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["n"], (int, float))


# --- pathological schemas and grammars: refused, or served in bounded time --------------


def timed(server, body: dict) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = chat(server, {"messages": ASK_PERSON, "max_tokens": 8, "temperature": 0} | body, timeout=120)
    return r, time.monotonic() - t0


@pytest.mark.parametrize(
    "gbnf, fragment",
    [
        ('root ::= root "a" | "a"', "left-recursive"),  # llama.cpp would refuse it too
        ('root ::= b "x"\nb ::= root "y" | "z"', "left-recursive"),
        # llama.cpp's own check misses these two and loops forever (measured: still running after 60 s)
        ('root ::= e root "a" | "a"\ne ::= "b"?', "left-recursive"),
        ('root ::= "x" a\na ::= e ("c" | "") a "y" | "z"\ne ::= "b"*', "left-recursive"),
        ('root ::= root | "a"', "llama.cpp refused the grammar: unsupported grammar, left recursion"),
    ],
)
def test_left_recursion_is_refused_at_once(server, gbnf, fragment):
    r, seconds = timed(server, {"grammar": gbnf})
    assert_400(r, fragment)
    assert seconds < 10


def test_deep_nesting_is_refused_beyond_the_limits(server):
    depth = grammar.MAX_GRAMMAR_NESTING
    r, _ = timed(server, {"grammar": "root ::= " + "(" * (depth + 1) + '"a"' + ")" * (depth + 1)})
    assert_400(r, f"groups nested more than {depth} deep")
    # 30 000 nested groups overflow llama.cpp's recursive parser (a segfault, measured): refused before it
    r, _ = timed(server, {"grammar": "root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000})
    assert_400(r, "nested more than")
    r, seconds = timed(server, {"grammar": "root ::= " + "(" * depth + '"a"' + ")" * depth, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "a" and seconds < 30

    def nested(levels: int) -> dict:
        schema: dict = {"type": "integer"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema

    assert_400(timed(server, {"json_schema": nested(40)})[0], "nested more than")
    r, seconds = timed(server, {"json_schema": nested(20), "max_tokens": 200})
    assert r.status_code == 200 and seconds < 120
    if r.json()["choices"][0]["finish_reason"] == "stop":
        validator(nested(20)).validate(json.loads(r.json()["choices"][0]["message"]["content"]))
    body = b'{"messages": [{"role": "user", "content": "x"}], "json_schema": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert raw.status_code == 400, raw.text  # a body too deep for the JSON parser


def test_huge_enums_are_served_in_bounded_time_or_refused(server):
    def enum(n: int) -> dict:
        return {"type": "object", "properties": {"word": {"enum": [f"w{i:05d}x" for i in range(n)]}}, "required": ["word"]}

    r, seconds = timed(server, {"json_schema": enum(1000), "max_tokens": 30, "messages": ask("Pick a word, as JSON.")})
    assert r.status_code == 200 and seconds < 60, seconds
    assert json.loads(r.json()["choices"][0]["message"]["content"])["word"] in enum(1000)["properties"]["word"]["enum"]
    assert_400(timed(server, {"json_schema": enum(5000)})[0], "characters long: the limit is")
    many = "root ::= " + " | ".join(f'"w{i}"' for i in range(grammar.MAX_GRAMMAR_CHARS // 6))
    assert_400(timed(server, {"grammar": many})[0], "characters long: the limit is")


def test_huge_repetitions_are_refused(server):
    assert_400(timed(server, {"grammar": 'root ::= "a"{5000}'})[0], "more than 2000 repetitions")
    assert_400(timed(server, {"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 3000}})[0], "'maxItems' is 3000")
    assert_400(timed(server, {"json_schema": {"type": "string", "maxLength": 10**9}})[0], "'maxLength'")
    r, seconds = timed(server, {"json_schema": {"type": "string", "minLength": 3, "maxLength": 2000}, "max_tokens": 12})
    assert r.status_code == 200 and seconds < 60


def test_many_rules_are_served_up_to_the_limit(server):
    def chain(n: int) -> str:  # r0 -> r1 -> ... -> rn, each leftmost: llama.cpp's checks recurse along it
        return "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(n)) + f'\nr{n} ::= "a"\nroot ::= r0'

    r, seconds = timed(server, {"grammar": chain(1500), "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "axxx" and seconds < 60
    assert_400(timed(server, {"grammar": chain(3000)})[0], f"more than {grammar.MAX_GRAMMAR_RULES} rules")


def test_a_grammar_with_no_way_out_mid_answer_fails_that_request_alone(server):
    """``"a" "\\x00"``: after "a" no token fits. The request fails; the server (and llama.cpp) live on."""
    r, _ = timed(server, {"grammar": 'root ::= "a" "\\x00"', "max_tokens": 4})
    assert r.status_code == 500 and "grammar allows no token" in r.json()["error"]["message"]
    r, _ = timed(server, {"grammar": 'root ::= "ok"', "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


# --- conversion, without the server ------------------------------------------------------


def test_conversion_is_cached_per_schema_text():
    grammar.convert._convert.cache_clear()
    first = grammar.grammar_from_schema(PERSON)
    assert grammar.grammar_from_schema(json.loads(json.dumps(PERSON))) is first  # same text, same grammar object
    assert grammar.convert._convert.cache_info().hits == 1
    reordered = {"type": "object", "properties": dict(reversed(PERSON["properties"].items())), "required": ["name", "age"]}
    assert grammar.grammar_from_schema(reordered) != first  # property order is the output's order: another key


def test_converter_corrections():
    # integer ranges are enforced (the Python port ignores minimum and maximum)
    g = grammar.grammar_from_schema({"type": "integer", "minimum": -5, "maximum": 120})
    assert "root ::= (" in g
    # strings cannot hold raw control characters; a backslash in a literal stays a backslash
    assert r"\x00-\x1F" in grammar.grammar_from_schema({"type": "string"})
    assert r'"\"a\\\\b\""' in grammar.grammar_from_schema({"enum": ["a\\b"]})
    # lengths and item counts as {m,n}, not one nested group per repetition
    assert "char{0,500}" in grammar.grammar_from_schema({"type": "string", "maxLength": 500})
    assert grammar.ANY_JSON_OBJECT == grammar.grammar_from_schema({}) == grammar.grammar_from_schema({"type": "object"})


@pytest.mark.parametrize(
    "lo, hi", [(1, 5), (-50, 60), (0, 2000), (-7, -3), (7, None), (-12, None), (None, 15), (None, -4), (10, 10), (99, 1001)]
)
def test_integer_ranges_match_exactly(model, lo, hi):
    """llama.cpp's own grammar engine accepts exactly the integers of the range (and no leading zeros)."""
    schema = {"type": "integer"} | ({} if lo is None else {"minimum": lo}) | ({} if hi is None else {"maximum": hi})
    gbnf = grammar.grammar_from_schema(schema)
    numbers = set(range(-130, 131)) | {b + d for b in (lo, hi, 999, 1000, 2000, 10**6) if b is not None for d in (-2, -1, 0, 1, 2)}
    for n in sorted(numbers | {-b for b in numbers}):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert accepts(model, gbnf, str(n)) == inside, (n, gbnf)
    assert not accepts(model, gbnf, "007") and not accepts(model, gbnf, "1.5")


def test_dates_are_days_of_the_calendar(model):
    """``format: date`` takes exactly the dates a validator takes: no 31 June, 29 February in leap years only.

    (llama.cpp's rule takes any day 01-31; a constrained answer once came out as "7806-06-31".)
    """
    dates, times = validator({"type": "string", "format": "date"}), validator({"type": "string", "format": "date-time"})
    years = ["0000", "0001", "0004", "0100", "0400", "1900", "1999", "2000", "2023", "2024", "2100", "2400", "7806", "9999"]
    days = ["00", "01", "09", "10", "19", "27", "28", "29", "30", "31", "32", "40"]
    gbnf = grammar.grammar_from_schema({"type": "string", "format": "date"})
    assert dates.is_valid("2024-02-29") and not dates.is_valid("2023-02-29")  # the validator checks the calendar
    for text in (f"{y}-{m:02}-{d}" for y in years for m in range(14) for d in days):
        assert accepts(model, gbnf, json.dumps(text)) == dates.is_valid(text), text
    gbnf = grammar.grammar_from_schema({"type": "string", "format": "date-time"})
    for text in ("2024-02-29T10:00:00Z", "2023-02-29T10:00:00Z", "2023-04-31T23:59:59+09:00", "2023-12-31T23:59:59+09:00"):
        assert accepts(model, gbnf, json.dumps(text)) == times.is_valid(text), text


def test_strings_hold_unicode_characters_written_as_json(model):
    """A string's characters are UTF-8, with '"' and '\\' escaped.

    llama.cpp's grammar took byte sequences UTF-8 forbids: such an answer decodes with one U+FFFD per
    byte, past a ``maxLength`` the grammar counted (seen at temperature 1: F0 82 AA 83, overlong). A
    pattern's ``.`` and ``[^...]`` took a raw '"', which ends the JSON string early.
    """
    single = {piece[0]: t for t, piece in enumerate(model.pieces) if len(piece) == 1}

    def takes(gbnf: str, data: bytes) -> bool:  # fed one byte per token, as the model can write it
        return accepts_tokens(model, gbnf, [single[byte] for byte in data])

    schemas = [{"type": "string", "maxLength": 5}, {"type": "string", "pattern": "^.{1,3}$"},
               {"type": "string", "pattern": "^[^@]{1,3}$"}]  # fmt: skip
    for schema in schemas:
        gbnf = grammar.grammar_from_schema(schema)
        for text in ("a", "あ", "\U0001f600", "\ud7ff", "\ue000", "\U0010ffff", 'a"b'):
            written = json.dumps(text, ensure_ascii=False).encode()
            assert takes(gbnf, written) == ("[^" not in schema.get("pattern", "") or '"' not in text), (schema, text)
        for data in (b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\xf0\x82\xaa\x83"', b'"a"b"'):
            assert not takes(gbnf, data), (schema, data)  # a surrogate, past U+10FFFF, overlong, a raw '"'
    # the mask agrees: after F0, 82 would make the character overlong; 9F continues it (U+1F600 and others)
    sampler = GrammarSampler(model, grammar.grammar_from_schema(schemas[0]))
    for byte in b'"\xf0':
        sampler.accept(single[byte])
    cur = sampler.masked(np.zeros(model.n_vocab, dtype=np.float32))
    assert cur.data[single[0x82]].logit == float("-inf") and cur.data[single[0x9F]].logit == 0
    sampler.close()


def accepts(model, gbnf: str, text: str) -> bool:
    """Does the grammar take ``text`` whole (one character per token), then allow the end?"""
    tokens = []
    for ch in text:
        (token,) = model.tokenize(ch, add_special=False)
        tokens.append(token)
    return accepts_tokens(model, gbnf, tokens)


def accepts_tokens(model, gbnf: str, tokens: list[int]) -> bool:
    """Does the grammar take these tokens, one after another, then allow the end?"""
    sampler = GrammarSampler(model, gbnf)
    try:
        for token in tokens:
            if not sampler.allows(token):
                return False
            sampler.accept(token)
        return sampler.allows(model.eog_tokens[0])
    finally:
        sampler.close()


# --- number ranges (llama.cpp enforces none; llmkit builds them into the grammar) ----------

NUMBER = re.compile(r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?")  # JSON without an exponent, as the grammar writes


def near(*bounds: float) -> set[str]:
    """Decimal texts around the bounds and 0: each side, on it, with trailing zeros, malformed ones."""
    texts = {str(i) for i in range(-12, 13)} | {"-0", "-0.0", "0.0", "00", "01.5", "1.", ".5", "1e1", "-"}
    for b in map(Decimal, map(repr, bounds)):
        for d in ("0", "0.0001", "0.001", "0.01", "0.1", "0.5", "1", "2.5"):
            texts |= {format(b - Decimal(d), "f"), format(b + Decimal(d), "f")}
        plain = format(b, "f")
        texts |= {plain + ("0" if "." in plain else ".0"), plain + ("00" if "." in plain else ".00")}
    return texts


@pytest.mark.parametrize(
    "bounds",
    [{"maximum": 10}, {"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
     {"minimum": 0.5, "exclusiveMaximum": 2.25}, {"minimum": -1.5, "maximum": -0.25}, {"minimum": -3.75},
     {"exclusiveMaximum": -2}, {"minimum": -2, "exclusiveMaximum": 0}, {"minimum": 0.125, "maximum": 0.125},
     {"minimum": 99.99, "maximum": 100.01}, {"exclusiveMinimum": -0.5, "exclusiveMaximum": 0.5},
     {"minimum": -1e20, "maximum": 1e20}, {"minimum": 5, "exclusiveMinimum": 5}, {"maximum": 3, "exclusiveMaximum": 3.5}],
)  # fmt: skip
def test_number_ranges_match_exactly(model, bounds):
    """llama.cpp's grammar engine takes exactly the plain decimals in the range ("-0" is written "0")."""
    gbnf = grammar.grammar_from_schema({"type": "number", **bounds})
    lows = [(Decimal(repr(v)), k.startswith("exclusive")) for k, v in bounds.items() if k.endswith("inimum")]
    highs = [(Decimal(repr(v)), k.startswith("exclusive")) for k, v in bounds.items() if k.endswith("aximum")]
    for text in sorted(near(*bounds.values())):
        inside = bool(NUMBER.fullmatch(text)) and not (text.startswith("-") and Decimal(text) == 0)
        if inside:
            n = Decimal(text)
            inside = all(n > b if ex else n >= b for b, ex in lows) and all(n < b if ex else n <= b for b, ex in highs)
        assert accepts(model, gbnf, text) == inside, (text, gbnf)


def test_integer_bounds_both_kinds_count():
    """``minimum`` and ``exclusiveMinimum`` together: the tighter one holds (it was the first one only)."""
    g = grammar.grammar_from_schema({"type": "integer", "minimum": 0, "exclusiveMinimum": 5, "maximum": 9.5, "exclusiveMaximum": 20})
    assert g.startswith("root ::= ([6-9]) space")


def test_empty_ranges_and_bad_bounds_are_refused():
    with pytest.raises(grammar.GrammarError, match="no number"):
        grammar.grammar_from_schema({"type": "number", "minimum": 1, "exclusiveMaximum": 1})
    with pytest.raises(grammar.GrammarError, match="no number"):
        grammar.grammar_from_schema({"type": "number", "minimum": 1e17})  # beyond 16 digits before the point
    with pytest.raises(grammar.GrammarError, match="'maximum' must be a number"):
        grammar.grammar_from_schema({"type": "number", "maximum": "10"})
    assert grammar.unenforced_keywords({"type": "number", "minimum": 0, "exclusiveMaximum": 1}) == []
    assert grammar.unenforced_keywords({"type": "string", "minimum": 0}) == ["$.minimum (only on integers and numbers)"]


RANGED = {
    "type": "object",
    "properties": {
        "score": {"type": "number", "maximum": 10},  # issue 14's example: it got 30
        "probability": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "celsius": {"type": "number", "minimum": -10.5, "exclusiveMaximum": 40},
        "discount": {"type": "number", "minimum": 0.05, "maximum": 0.5},
        "guests": {"type": "integer", "exclusiveMinimum": 0, "maximum": 12},
    },
    "required": ["score", "probability", "celsius", "discount", "guests"],
}
ASK_RANGED = ask(
    'Review a hotel as JSON: "score" out of 100, the "probability" that you return in percent, '
    'the "celsius" temperature of the pool in Fahrenheit, the "discount" in percent and the number of "guests".'
)


def test_number_ranges_hold_in_answers(server):
    """The real model, greedy and sampled hot (a prompt that asks for out-of-range values): every answer in range."""
    runs = [{"temperature": 0}] + [{"temperature": t, "seed": seed} for t in (0.8, 1.5) for seed in (1, 2, 3)]
    strict = {"type": "json_schema", "json_schema": {"name": "review", "strict": True, "schema": RANGED}}

    def one(run: dict) -> dict:
        r = chat(server, {"messages": ASK_RANGED, "max_tokens": 160, "response_format": strict, **run})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(one, runs))
    complete = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert len(complete) >= len(runs) - 1, choices
    for text in complete:
        value = json.loads(text)
        errors = [e.message for e in validator(RANGED).iter_errors(value)]
        assert not errors, (text, errors)
    print(f"\nnumber ranges: {len(complete)}/{len(runs)} complete answers, all in range; e.g. {complete[-1]}")


# --- one path: constraint -> compiled grammar -> the slot's sampler -----------------------


def test_a_sampled_constrained_pick_follows_the_logits_step_after_step(model):
    """top_k 1 at temperature 0.8 picks the most likely token the grammar allows, at every step.

    The chain sorts the candidates' buffer in place; refilled without its ids, the next step's
    logits landed on other tokens, and sampled constrained answers were noise (greedy was not hit).
    """
    ctx, batch = Context(model, n_ctx=256), Batch(64)
    prompt = model.tokenize_chat(ask("Describe a cat in one sentence."))
    for pos, token in enumerate(prompt):
        last = batch.add(token, pos, 0, pos == len(prompt) - 1)
    ctx.decode(batch)
    best = int(np.argmax(np.ctypeslib.as_array(ctx.logits(last))))
    free = Sampler(model, SamplingParams(temperature=0.8, top_k=1, seed=1, grammar=r"root ::= [^\x00]*"))
    try:
        assert [free.sample(ctx, last) for _ in range(3)] == [best] * 3  # the same logits, read three times
    finally:
        free.close()
        batch.close()
        ctx.close()


def test_compile_converts_checks_and_caches(model):
    g = grammar.compile(grammar.Schema(PERSON), model)
    assert isinstance(g, Grammar) and g.text == grammar.grammar_from_schema(PERSON)
    assert grammar.compile(grammar.Schema(json.loads(json.dumps(PERSON))), model) is g  # cached per schema text
    assert grammar.compile(grammar.Gbnf(g.text), model) is g  # ... and per grammar text: one parse
    with pytest.raises(grammar.GrammarError, match=r"^'response_format\.schema': the schema cannot be converted"):
        grammar.compile(grammar.Schema({"type": "foo"}, field="response_format.schema"), model)
    with pytest.raises(
        grammar.GrammarError, match=r"^'json_schema': strict is true but the grammar cannot enforce: [$]\.properties\.n\.multipleOf"
    ):
        grammar.compile(grammar.Schema({"properties": {"n": {"type": "number", "multipleOf": 2}}}, strict=True), model)
    with pytest.raises(grammar.GrammarError, match=r"^the grammar does not parse"):
        grammar.compile(grammar.Gbnf('root ::= "a'), model)
    sampler = Sampler(model, SamplingParams(grammar=g))  # the slot's call: clones the parse, its own state
    try:
        assert sampler.grammar is not None and sampler.grammar is not g.sampler
    finally:
        sampler.close()


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"grammar": ""}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"grammar": "root ::= x"}, grammar.Gbnf("root ::= x")),
        ({"json_schema": {}}, grammar.Schema({}, False, "json_schema")),
        ({"response_format": {"type": "json_object"}}, grammar.Schema({}, False, "response_format")),
        ({"response_format": {"type": "json_object"}, "json_schema": PERSON}, grammar.Schema(PERSON, False, "json_schema")),
        ({"response_format": {"type": "json_object", "schema": PERSON}}, grammar.Schema(PERSON, False, "response_format.schema")),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}},
         grammar.Schema(PERSON, True, "response_format.json_schema.schema")),
        ({"grammar": "root ::= x", "json_schema": {}}, "Cannot use both 'json_schema' and 'grammar'"),
    ],
)  # fmt: skip
def test_constraint_resolution(body, expected):
    """Which constraint a request carries: resolved without a model, without HTTP."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | body)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            constraint_of(request)
    else:
        assert constraint_of(request) == expected


@pytest.mark.parametrize(
    "body, server_ignores_eos",
    [({"json_schema": {}, "ignore_eos": True}, False), ({"json_schema": {}}, True), ({"grammar": "root ::= x"}, True)],
)
def test_ignore_eos_with_a_constraint_is_refused(body, server_ignores_eos):
    """The request's ignore_eos, or when it says nothing the server's (``--ignore-eos``), with a constraint: a ValueError
    (a 400) before anything is compiled, since a complete output leaves only the end token."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | body)
    with pytest.raises(ValueError, match="'ignore_eos' cannot be used with a grammar"):
        request_params(request, RequestParams.of(ignore_eos=server_ignores_eos), model=None)  # type: ignore[arg-type]


def test_a_grammar_is_kept_by_its_model_and_freed_with_it(model_path):
    from llmkit.llama import Model

    model = Model(model_path)
    first = grammar.compile(grammar.Gbnf('root ::= "yes" | "no"'), model)
    assert grammar.compile(grammar.Gbnf('root ::= "yes" | "no"'), model) is first  # sent again: not parsed again
    assert len(model.grammars) == 1
    model.grammars.limit = 2
    for word in ("a", "b"):
        grammar.compile(grammar.Gbnf(f'root ::= "{word}"'), model)
    assert len(model.grammars) == 2 and model.grammars.get('root ::= "yes" | "no"') is None  # the oldest let go
    model.close()
    assert len(model.grammars) == 0  # nothing of a closed model stays alive in a process-wide cache
