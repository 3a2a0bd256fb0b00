"""Tool calling without a model (``llmkit.server.tools``): the prompt that describes the tools, the grammar's
text, and the parser that reads calls back from text, whole or a character at a time."""

from __future__ import annotations

import json
import random

import pytest

from llmkit.server.tools import CLOSE, OPEN, CallParser, Delta, TextParser, Tool, ToolCalling, relocate, render_generic, renders_tools

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ADD = Tool("add", "Add two integers", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
PARIS = '{"city": "Paris"}'
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"  # no tools in it


def call_text(name: str, arguments: str, space: str = " ") -> str:
    return f'{OPEN}\n{{"name":{space}"{name}",{space}"arguments":{space}{arguments}}}\n{CLOSE}'


def read(text: str, pieces: list[str] | None = None) -> tuple[CallParser, list[Delta]]:
    parser = CallParser()
    deltas = [d for piece in (pieces or [text]) for d in parser.push(piece)]
    return parser, deltas + parser.finish()


def split_randomly(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# --- reading calls -------------------------------------------------------------------


def test_content_then_two_calls_read_the_same_whole_and_in_any_pieces():
    arguments = ['{"city": "Pa\\"ris}"}', '{"a": 1, "b": {"deep": [1, {"x": "}"}]}}']
    text = "Let me check." + call_text("get_weather", arguments[0]) + "\n" + call_text("add", arguments[1], space="")
    whole, _ = read(text)
    assert whole.content == "Let me check."
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", arguments[0]), ("add", arguments[1])]
    assert [c.parsed_arguments() for c in whole.calls] == [json.loads(a) for a in arguments]
    for seed in range(20):
        parser, deltas = read(text, split_randomly(text, seed))
        assert (parser.content, [(c.name, c.arguments) for c in parser.calls]) == (
            whole.content,
            [(c.name, c.arguments) for c in whole.calls],
        )
        # the deltas say the same: content, then per call its name once and its arguments in pieces
        assert "".join(d.content for d in deltas) == whole.content
        starts = [d for d in deltas if d.name]
        assert [(d.index, d.name) for d in starts] == [(0, "get_weather"), (1, "add")]
        assert [d.id for d in starts] == [c.id for c in parser.calls] and len({c.id for c in parser.calls}) == 2
        for i, call in enumerate(parser.calls):
            assert "".join(d.arguments for d in deltas if d.index == i) == call.arguments


def test_text_that_only_looks_like_a_call_is_content():
    for text in ("a < b and <tool>", "ends with <tool_ca", "<tool_call"):
        parser, deltas = read(text, list(text))
        assert parser.content == text and parser.calls == [] and "".join(d.content for d in deltas) == text


def test_a_call_cut_short_keeps_what_was_written():
    parser, _ = read(OPEN + '\n{"name": "add", "arguments": {"a": 1, "b"')
    (call,) = parser.calls
    assert call.name == "add" and call.arguments == '{"a": 1, "b"' and call.parsed_arguments() == {}
    parser, _ = read(OPEN + '\n{"name": "ad')  # not even the name: no call yet
    assert parser.calls == [] and parser.content == ""


def test_without_tools_every_piece_is_content_at_once():
    parser = TextParser()
    assert parser.push("<tool_") == [Delta(content="<tool_")] and parser.finish() == [] and parser.content == "<tool_"


# --- the prompt --------------------------------------------------------------------


def test_tools_calls_and_results_are_written_as_text_for_a_template_without_tools():
    calling = ToolCalling([WEATHER, ADD])  # on a template without tools
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": PARIS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]  # fmt: skip
    messages, tools = calling.render(history)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>" in system and json.dumps(WEATHER.to_openai()) in system
    assert messages[2]["content"] == call_text("get_weather", PARIS)
    assert messages[3] == {"role": "tool", "content": "<tool_response>\nSunny\n</tool_response>"}
    assert history[2]["content"] == "" and "tool_calls" in history[2]  # the caller's messages are left as they were
    # no system message: one is added first; "none" describes no tools, but still writes the history
    assert render_generic([{"role": "user", "content": "Hi"}], [WEATHER.to_openai()])[0]["role"] == "system"
    quiet, _ = ToolCalling([WEATHER], "none").render(history[1:])
    assert "<tools>" not in json.dumps(quiet) and quiet[1]["content"] == messages[2]["content"]


def test_a_template_that_renders_tools_gets_them_as_they_are():
    assert renders_tools("{% for t in tools %}{{ t }}{% endfor %}<tool_call>") and not renders_tools(CHATML)
    history = [{"role": "user", "content": "Hi"}]
    assert ToolCalling([WEATHER], native=True).render(history) == (history, [WEATHER.to_openai()])
    assert ToolCalling([WEATHER], "none", native=True).render(history) == (history, None)


# --- the grammar -------------------------------------------------------------------


def test_required_starts_with_the_tag_and_auto_waits_for_it():
    required, trigger = ToolCalling([WEATHER], "required", parallel=True).grammar()  # type: ignore[misc]
    assert trigger is None and required.startswith(f'root ::= "{OPEN}" "\\n" call "\\n{CLOSE}" ("\\n{OPEN}" "\\n" call')
    auto, trigger = ToolCalling([WEATHER, ADD], "auto", parallel=False).grammar()  # type: ignore[misc]
    assert trigger == OPEN and auto.startswith('root ::= "\\n" call "\\n</tool_call>"\n') and "call ::= call-0 | call-1" in auto
    named, _ = ToolCalling([WEATHER, ADD], "required", "add").grammar()  # type: ignore[misc]
    assert '"\\"add\\""' in named and "get_weather" not in named
    assert ToolCalling([WEATHER], "none").grammar() is None
    no_parameters, _ = ToolCalling([Tool("now")], "required").grammar()  # type: ignore[misc]
    assert 'now-arguments ::= "{" space  "}" space' in no_parameters  # its arguments are {}, not any object


def test_each_tools_definitions_keep_their_own_names():
    schema = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "$defs": {"Address": {"type": "string"}}}
    moved = relocate(schema, "#/anyOf/1/properties/arguments", "mail")
    assert moved["properties"]["to"]["$ref"] == "#/anyOf/1/properties/arguments/$defs/mail-Address"
    assert list(moved["$defs"]) == ["mail-Address"] and schema["$defs"] == {"Address": {"type": "string"}}


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Tool("bad name"), "tool name"),
        (lambda: Tool("x", parameters={"type": "string"}), "type 'object'"),
        (lambda: ToolCalling([WEATHER, WEATHER]), "unique"),
        (lambda: ToolCalling([], "required"), "at least one tool"),
        (lambda: ToolCalling([WEATHER], "required", "add"), "not among the tools"),
    ],
)
def test_bad_tools_say_what_is_wrong(make, words):
    with pytest.raises(ValueError, match=words):
        make()
