"""Hostile bodies on every route of the slot server, model-free: each gets a 4xx whose message says what is wrong
(never a 500, a hang or a dropped connection), and the route answers a normal request right after.

The routes come from the app itself (its OpenAPI description: path, method, body model), so a route added
later is tested without a word here; ``BASE`` gives each body model one valid body, and a body model without
one fails ``test_every_body_model_has_a_valid_body``. Two tables drive the rest:

- ``WHOLE_BODIES``: what is wrong with the body as a whole (not JSON, not an object, nested too deep, not UTF-8,
  the wrong content type, empty, over the size limit), sent to every route that reads a body;
- field by field: every field of every body model gets each value of ``VALUES`` its JSON Schema refuses (a wrong
  type, a value out of range), and the values no schema can refuse but the server must (an integer beyond 64 bits,
  NaN and Infinity, a lone surrogate): the 400 names the field.

What only the real model can refuse (grammars, schemas, tools, token ids out of the vocabulary, prompts over the
context) and ten times the load with disconnects: tests/test_server_overload.py.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import httpx
import jsonschema
import numpy as np
import pytest
from test_server_app import FakeEngine

from llmkit.course import launch
from llmkit.server import Settings, create_app

MAX_BODY = 64 * 1024
SPEC = create_app(FakeEngine).openapi()  # the route table; the loader is never called
SCHEMAS = SPEC["components"]["schemas"]
ROUTES = [(path, method.upper(), op) for path, ops in SPEC["paths"].items() for method, op in ops.items()]
WITH_BODY = [(path, op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]) for path, m, op in ROUTES
             if "requestBody" in op]  # fmt: skip
WITHOUT_BODY = [(path, op) for path, m, op in ROUTES if "requestBody" not in op]
MODELS = sorted({model for _, model in WITH_BODY})

HI = [{"role": "user", "content": "hi"}]
BASE = {  # a valid body of each body model
    "TokenizeRequest": {"content": "hi"},
    "DetokenizeRequest": {"tokens": [1]},
    "ChatCompletionRequest": {"messages": HI, "max_tokens": 1},
    "EmbeddingRequest": {"input": "hi"},
    "NativeEmbeddingRequest": {"content": "hi"},
    "CompletionRequest": {"prompt": "hi", "max_tokens": 1},
    "NativeCompletionRequest": {"prompt": "hi", "n_predict": 1},
    "ResponsesRequest": {"input": "hi", "max_output_tokens": 1},
    "InputRequest": {"input": "hi"},
    "MessagesRequest": {"messages": HI, "max_tokens": 1},
    "CountTokensRequest": {"messages": HI},
}

# one value of each JSON type, an empty and a nested one, and values out of any sane range: those the field's
# schema refuses are sent
VALUES = ["x", 7, -1, 0.5, True, [], ["x"], {"x": [[[]]]}, 10**30, -(2**31) - 1, 1e300]
# values a JSON Schema cannot refuse, sent to every field of that type: raw JSON text, by what the field accepts
BEYOND = {7: ["18446744073709551616", "-9223372036854775809"], 0.5: ["NaN", "Infinity", "-Infinity"], "x": ['"\\ud800"', '"a\\udfffb"']}

OBJECT = json.dumps(BASE["ChatCompletionRequest"]).encode()
MULTIPART = b'--b\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--b--\r\n'
DEEP = b'{"x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
WHOLE_BODIES = {  # name: (body, content type, words the message must hold, status)
    "not JSON": (b"hello", "application/json", "Invalid JSON", 400),
    "truncated JSON": (b'{"messages": [', "application/json", "Invalid JSON", 400),
    "empty": (b"", "application/json", "body", 400),
    "an array": (b"[1, 2]", "application/json", "must be a JSON object", 400),
    "a string": (b'"hi"', "application/json", "must be a JSON object", 400),
    "a number": (b"12", "application/json", "must be a JSON object", 400),
    "null": (b"null", "application/json", "must be a JSON object", 400),
    "nested 30,000 deep": (DEEP, "application/json", "recursion", 400),
    "not UTF-8": (b'{"content": "\xff\xfe", "messages": "\xc3"}', "application/json", "utf-8", 400),
    "a 5,000-digit number": (b'{"n_predict": ' + b"9" * 5000 + b"}", "application/json", "digits", 400),
    "text/plain": (OBJECT, "text/plain", "Content-Type: application/json", 400),
    "a form": (b"messages=hi", "application/x-www-form-urlencoded", "Content-Type: application/json", 400),
    "multipart": (MULTIPART, "multipart/form-data; boundary=b", "Content-Type: application/json", 400),
    "no content type": (OBJECT, None, "Content-Type: application/json", 400),
    "over the size limit": (b'{"x": "' + b"a" * MAX_BODY + b'"}', "application/json", f"larger than {MAX_BODY} bytes", 413),
}


class FakeEmbedder:
    """The embedding routes' model-free stand-in (tests/test_server.py embeds with the real model)."""

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[1] * len(text.split()) for text in texts]

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        return np.full((len(prompts), 4), 0.5, dtype=np.float32)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One keep-alive connection to the app over a scripted engine: a request that drops it fails the next one."""
    app = create_app(FakeEngine(), Settings(alias="fake", max_body_size=MAX_BODY, metrics=True))
    app.state.embedder = FakeEmbedder()  # the embedding routes read the app's (embeddings.EmbedderDep)
    with launch.serve_app(app) as url, httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1)) as c:
        yield c


def send(client: httpx.Client, method: str, path: str, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
    return client.request(method, path, content=body, headers={"content-type": content_type} if content_type else {})


def message(r: httpx.Response) -> str:
    """The error's message, in either dialect's shape (llama-server's ``error.message``, Anthropic's the same)."""
    assert r.headers["content-type"] == "application/json", r.text
    return r.json()["error"]["message"]


def refused(r: httpx.Response, *words: str, status: int = 400) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    text = message(r)
    for word in words:
        assert word.lower() in text.lower(), (word, text)


def still_serves(client: httpx.Client, path: str, model: str) -> None:
    """The same connection, right after: the route answers a valid body, and /health answers."""
    r = send(client, "POST", path, json.dumps(BASE[model]).encode())
    assert r.status_code == 200, r.text[:300]
    assert client.get("/health").json() == {"status": "ok"}


def hostile_fields(model: str) -> Iterator[tuple[str, bytes]]:
    """(field, body) with one field made hostile: each value its schema refuses, and the values no schema refuses."""
    validator = jsonschema.Draft202012Validator({**SCHEMAS[model], "components": {"schemas": SCHEMAS}})
    base = BASE[model]
    for field in SCHEMAS[model]["properties"]:

        def takes(value: object, field: str = field) -> bool:
            return validator.is_valid({**base, field: value})

        for value in [v for v in VALUES if not takes(v)]:
            yield field, json.dumps({**base, field: value}).encode()
        for kind, raw in BEYOND.items():
            if takes(kind) and not (kind == 7 and takes(0.5)):  # the field's type (an integer, not a number): what no schema refuses
                for text in raw:
                    yield field, json.dumps({**base, field: "HOLE"}).replace('"HOLE"', text).encode()


def test_the_routes_are_read_from_the_app():
    paths = {path for path, _, _ in ROUTES}
    assert {"/v1/chat/completions", "/completion", "/v1/messages", "/v1/responses", "/tokenize", "/v1/embeddings"} <= paths
    assert len(WITH_BODY) >= 15 and len(WITHOUT_BODY) >= 8


def test_every_body_model_has_a_valid_body():
    for path, model in WITH_BODY:
        assert model in BASE, f"{path}: add a valid {model} to BASE"
        validator = jsonschema.Draft202012Validator({**SCHEMAS[model], "components": {"schemas": SCHEMAS}})
        assert validator.is_valid(BASE[model]), (model, [e.message for e in validator.iter_errors(BASE[model])])


@pytest.mark.parametrize(("path", "model"), WITH_BODY, ids=[p for p, _ in WITH_BODY])
def test_a_hostile_body_is_a_4xx_that_says_what_is_wrong(client, path, model):
    for name, (body, content_type, words, status) in WHOLE_BODIES.items():
        r = send(client, "POST", path, body, content_type)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        assert words.lower() in message(r).lower(), (name, message(r))
    still_serves(client, path, model)


@pytest.mark.parametrize("model", MODELS)
def test_a_hostile_field_is_a_400_that_names_it(client, model):
    """Each body model's hostile fields, sent to its routes in turn (a body model is validated before its route runs:
    every route of it gets a share, and the table is sent once, not once per route)."""
    paths = [path for path, m in WITH_BODY if m == model]
    n = 0
    for (field, body), path in zip(hostile_fields(model), itertools.cycle(paths)):
        r = send(client, "POST", path, body)
        assert r.status_code == 400, (path, field, body[:200], r.text[:300])
        assert f"'{field}" in message(r), (path, field, body[:200], message(r))
        n += 1
    assert n >= 3 * len(SCHEMAS[model]["properties"])  # every field got several
    for path in paths:
        still_serves(client, path, model)


@pytest.mark.parametrize(("path", "op"), WITHOUT_BODY, ids=[p for p, _ in WITHOUT_BODY])
def test_a_route_without_a_body_refuses_the_wrong_method_and_hostile_paths(client, path, op):
    refused(send(client, "POST", path.replace("{", "").replace("}", ""), b"junk"), "Method Not Allowed", status=405)
    for name in [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]:
        for hostile in ("x" * 8000, "%ff%fe%00", "..%2F..%2Fetc%2Fpasswd", "%F0%9F%92%A9" * 100):
            r = client.get(path.replace(f"{{{name}}}", hostile))
            assert 400 <= r.status_code < 500, (hostile, r.text[:200])
            assert message(r)
    assert client.get("/health").json() == {"status": "ok"}


def test_a_route_with_a_body_refuses_the_wrong_method(client):
    for path, _ in WITH_BODY:
        refused(client.get(path), "Method Not Allowed", status=405)
