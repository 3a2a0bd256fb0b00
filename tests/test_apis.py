"""The three chat APIs and their tool calls on the real model, through the official clients, unchanged:
``openai`` (Chat Completions with tools, Responses whole and streamed), ``anthropic`` (messages,
stream, count_tokens, tools) and an agent framework (the OpenAI Agents SDK) completing a round trip.

One server for the module: 4 slots of 1024 tokens, greedy unless a test asks, one CPU thread.
What a test expects comes from the request (the tool's schema, the budget) or from the server's
own other answers (the whole answer vs its stream, count_tokens vs usage), never from text written here.
Where a whole answer and a stream are compared, the request is sent once before: both then find the
whole prompt in their slot and read only its last token again, so their numbers, and their greedy
text, are the same (a cold prompt is read in one big batch, whose sums can round another way).
"""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from test_server_app import FakeEngine, ends

from llmkit.course import launch
from llmkit.engine import End
from llmkit.server import Settings, create_app

from helpers import wait_until

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
# tools of other shapes: numbers with bounds, arrays, nested objects through $defs, no parameters at all
TOOLS = [
    WEATHER,
    {
        "name": "book_table",
        "description": "Book a table at a restaurant",
        "parameters": {
            "type": "object",
            "properties": {
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}, "maxItems": 3},
            },
            "required": ["people", "time", "guests"],
            "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}},
        },
    },
    {
        "name": "convert",
        "description": "Convert an amount of money",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6}, "to": {"enum": ["EUR", "USD", "JPY"]}},
            "required": ["amount", "to"],
        },
    },
    {"name": "now", "description": "The time now"},
]
# A tool without parameters takes {} (tools.NO_ARGUMENTS); Messages needs an input_schema, so it says the same. (A bare
# {"type": "object"} would allow any object: at temperature 0.8 SmolLM2 can write one until max_tokens.)
SCHEMAS = {t["name"]: t.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False}) for t in TOOLS}
ASK = "What's the weather in Paris? Use the tools."


@pytest.fixture(scope="module")
def server():
    with launch.serve("slots", "-np", "4", "-c", "4096", "-t", "1", "--temp", "0", "--seed", "1", "--alias", "smollm2") as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat_tools(tools: list[dict]) -> list[dict]:
    return [{"type": "function", "function": t} for t in tools]


def valid_call(name: str, arguments: dict) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(arguments, SCHEMAS[name])


# --- chat completions ----------------------------------------------------------------


def test_chat_tool_choice_required_named_none_and_auto(oai):
    ask = [{"role": "user", "content": ASK}]
    r = oai.chat.completions.create(model="m", messages=ask, tools=chat_tools(TOOLS), tool_choice="required", max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        valid_call(call.function.name, json.loads(call.function.arguments))
    named = {"type": "function", "function": {"name": "convert"}}
    r = oai.chat.completions.create(
        model="m", messages=ask, tools=chat_tools(TOOLS), tool_choice=named, parallel_tool_calls=False, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "convert" and r.choices[0].finish_reason == "tool_calls"
    valid_call("convert", json.loads(call.function.arguments))
    r = oai.chat.completions.create(model="m", messages=ask, tools=chat_tools(TOOLS), tool_choice="none", max_tokens=24)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # auto: text or a call, the model's choice; a call is whole and valid, and then the reason says so
    r = oai.chat.completions.create(model="m", messages=ask, tools=chat_tools(TOOLS), max_tokens=200)
    calls = r.choices[0].message.tool_calls or []
    assert (r.choices[0].finish_reason == "tool_calls") == bool(calls) or r.choices[0].finish_reason == "length"
    for call in calls:
        valid_call(call.function.name, json.loads(call.function.arguments))


def test_a_streamed_call_is_the_whole_call_in_pieces(oai):
    kwargs = {"model": "m", "messages": [{"role": "user", "content": ASK}], "tools": chat_tools([WEATHER]), "tool_choice": "required"}
    oai.chat.completions.create(**kwargs, max_tokens=120)
    whole = oai.chat.completions.create(**kwargs, max_tokens=120)
    chunks = list(oai.chat.completions.create(**kwargs, max_tokens=120, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    starts = [p for p in pieces if p.id]
    assert len(starts) == len(whole.choices[0].message.tool_calls) and all(p.function.name == "get_weather" for p in starts)
    for i, call in enumerate(whole.choices[0].message.tool_calls):
        assert "".join(p.function.arguments or "" for p in pieces if p.index == i) == call.function.arguments
    assert len([p for p in pieces if not p.id]) > 1  # the arguments came in several pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_every_forced_call_validates_over_tools_and_seeds(server, oai, claude):
    """``required``, ``any`` and a named tool at temperature 0.8: every call parses and validates
    against its tool's schema, through each API (48 calls, 4 at a time)."""

    def chat(seed: int, name: str | None) -> list[tuple[str, dict]]:
        choice = {"type": "function", "function": {"name": name}} if name else "required"
        r = oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": ASK}], tools=chat_tools(TOOLS), tool_choice=choice,
            temperature=0.8, seed=seed, max_tokens=300,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls", r
        return [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]

    def responses(seed: int, name: str | None) -> list[tuple[str, dict]]:
        tools = [{"type": "function", **t} for t in TOOLS]
        choice = {"type": "function", "name": name} if name else "required"
        r = oai.responses.create(
            model="m", input=ASK, tools=tools, tool_choice=choice, temperature=0.8, max_output_tokens=300, extra_body={"seed": seed}
        )
        assert r.status == "completed", r
        return [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]

    def messages(seed: int, name: str | None) -> list[tuple[str, dict]]:
        tools = [{"name": t["name"], "description": t["description"], "input_schema": SCHEMAS[t["name"]]} for t in TOOLS]
        choice = {"type": "tool", "name": name} if name else {"type": "any"}
        extra = {"temperature": 0.8}  # this SDK has no temperature argument; the API still takes it (but no seed: the server's)
        r = claude.messages.create(
            model="m", max_tokens=300, messages=[{"role": "user", "content": ASK}], tools=tools, tool_choice=choice, extra_body=extra
        )
        assert r.stop_reason == "tool_use", r
        return [(b.name, b.input) for b in r.content if b.type == "tool_use"]

    jobs = [(api, seed, name) for api in (chat, responses, messages) for seed in range(4) for name in (None, *SCHEMAS)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: (job, job[0](job[1], job[2])), jobs))
    assert len(results) == 60
    for (_, _, name), calls in results:
        assert calls, name
        for called, arguments in calls:
            assert name in (None, called)
            valid_call(called, arguments)


def test_a_tool_result_comes_back_into_the_conversation(server, oai):
    first = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": ASK}],
        tools=chat_tools([WEATHER]),
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = first.choices[0].message.tool_calls
    history = [
        {"role": "user", "content": ASK},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"},
    ]
    prompt = httpx.post(f"{server.url}/apply-template", json={"messages": history, "tools": chat_tools([WEATHER])}).json()["prompt"]
    assert f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': json.loads(call.function.arguments)})}\n</tool_call>" in prompt
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in prompt and "<tools>" in prompt
    second = oai.chat.completions.create(model="m", messages=history, tools=chat_tools([WEATHER]), max_tokens=40)
    assert second.choices[0].message.content


# --- responses -----------------------------------------------------------------------


def test_responses_whole_and_streamed(oai):
    kwargs = {"model": "m", "instructions": "Answer in one sentence.", "input": [{"role": "user", "content": "What is a cat?"}]}
    oai.responses.create(**kwargs, max_output_tokens=24)
    whole = oai.responses.create(**kwargs, max_output_tokens=24)
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_") and whole.output_text
    assert whole.usage.input_tokens == oai.post("/responses/input_tokens", body=kwargs, cast_to=httpx.Response).json()["input_tokens"]
    with oai.responses.stream(**kwargs, max_output_tokens=24) as stream:
        events = list(stream)
    final = events[-1].response  # .get_final_response() wants response.completed; a cut answer ends response.incomplete
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.status == whole.status
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{final.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    cut = oai.responses.create(**kwargs, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 3


def test_responses_structured_output_and_a_function_call_round_trip(oai):
    schema = {"type": "object", "properties": {"animal": {"type": "string"}, "legs": {"type": "integer"}}, "required": ["animal", "legs"]}
    fmt = {"format": {"type": "json_schema", "name": "animal", "schema": schema, "strict": True}}
    r = oai.responses.create(model="m", input="Describe a cat as JSON.", text=fmt, max_output_tokens=80)
    jsonschema.validate(json.loads(r.output_text), schema)
    tools = [{"type": "function", **WEATHER}]
    r = oai.responses.create(model="m", input=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False)
    (call,) = [o for o in r.output if o.type == "function_call"]
    valid_call(call.name, json.loads(call.arguments))
    back = [
        {"role": "user", "content": ASK},
        call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    answer = oai.responses.create(model="m", input=back, tools=tools, max_output_tokens=30)
    assert answer.output_text and answer.status in ("completed", "incomplete")


# --- messages ------------------------------------------------------------------------


def test_messages_whole_streamed_and_counted(claude):
    kwargs = {"model": "m", "max_tokens": 24, "system": "Answer briefly.", "messages": [{"role": "user", "content": "What is a cat?"}]}
    claude.messages.create(**kwargs)
    whole = claude.messages.create(**kwargs)
    assert whole.id.startswith("msg_") and whole.content[0].type == "text" and whole.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model="m", system=kwargs["system"], messages=kwargs["messages"])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    raw = httpx.post(f"{claude.base_url}/v1/messages", json={**kwargs, "stream": True}, timeout=60).text
    names = [block.split("\n")[0].removeprefix("event: ") for block in raw.strip().split("\n\n")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    word = whole.content[0].text.split()[1]
    stopped = claude.messages.create(**kwargs, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == whole.content[0].text[: whole.content[0].text.index(word)]


def test_messages_structured_output(claude):
    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string", "maxLength": 30}, "legs": {"type": "integer"}},
        "required": ["animal", "legs"],
    }
    r = claude.messages.create(
        model="m",
        max_tokens=80,
        messages=[{"role": "user", "content": "Describe a cat."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_messages_tools_any_named_none_and_a_result(claude):
    tools = [{"name": t["name"], "description": t["description"], "input_schema": SCHEMAS[t["name"]]} for t in TOOLS]
    ask = [{"role": "user", "content": ASK}]
    r = claude.messages.create(
        model="m", max_tokens=200, messages=ask, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    (use,) = r.content
    assert r.stop_reason == "tool_use" and use.type == "tool_use" and use.id.startswith("toolu_")
    valid_call(use.name, use.input)
    with claude.messages.stream(
        model="m", max_tokens=200, messages=ask, tools=tools, tool_choice={"type": "tool", "name": "book_table"}
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and {b.name for b in final.content} == {"book_table"}
    for block in final.content:
        valid_call(block.name, block.input)
    r = claude.messages.create(model="m", max_tokens=16, messages=ask, tools=tools, tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"]
    back = [*ask, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]  # fmt: skip
    answer = claude.messages.create(model="m", max_tokens=30, messages=back, tools=tools)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="m", max_tokens=16, messages=ask, tools=tools, tool_choice={"type": "tool", "name": "nope"})
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": bad.value.body["error"]["message"]}}
    assert "not among the tools" in bad.value.body["error"]["message"]


# --- an agent framework ----------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_calls_its_tool_and_answers(server, api):
    """The OpenAI Agents SDK, as a user writes it: its function tool is called with valid arguments,
    the result goes back, the agent ends with text. The first turn must call (``tool_choice``
    required); the SDK then resets it to auto (``reset_tool_choice``) and the model answers."""
    import agents

    agents.set_tracing_disabled(True)  # its traces go to OpenAI's servers
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 24 degrees"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model_class(model="smollm2", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=0),
    )
    result = agents.Runner.run_sync(agent, "What's the weather in Paris?", max_turns=4)
    assert calls and all(isinstance(city, str) for city in calls)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs and outputs[0].output.startswith("Sunny in")
    assert isinstance(result.final_output, str) and result.final_output


# --- a client that leaves ------------------------------------------------------------


def test_a_whole_answer_whose_client_leaves_frees_its_slot(server):
    """On the real engine: the slot stops generating when the client closes, long before ``max_tokens``."""
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 900, "ignore_eos": True, "id_slot": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    wait_until(lambda: not httpx.get(f"{server.url}/slots").json()[3]["is_processing"], timeout=5, interval=0.05)
    # what its slot holds: the prompt and what it generated before it was freed, far from 900 generated tokens
    assert httpx.get(f"{server.url}/slots").json()[3]["n_cached"] < 450


# --- a chat template that renders tools itself -------------------------------------------

# Qwen 2.5's way, cut short: the template describes the tools and writes earlier calls itself
TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Return each call as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages if not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}<|im_start|>assistant
"""


def test_a_template_that_renders_tools_renders_them_and_the_call_is_the_same(model_path):
    """With such a template (a Qwen 2.5 GGUF brings one), llmkit gives it the tools and the history as they
    are, and parallel calls are on by default; the grammar and the parser stay the same."""
    from llmkit import grammar
    from llmkit.engine import End, Engine, EngineConfig, RequestParams
    from llmkit.llama import Model
    from llmkit.server.protocol import ChatRequest
    from llmkit.server.tools import TextParser

    with Model(model_path, chat_template=TOOL_TEMPLATE) as tooled:
        history = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": ASK},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Rain"},
        ]  # fmt: skip
        body = ChatRequest.model_validate({"messages": history, "tools": chat_tools([WEATHER]), "tool_choice": "required"})
        calling = body.tool_calling(tooled.chat_template)
        assert calling.native and calling.parallel
        messages, tools = calling.render([m.to_template() for m in body.messages])
        prompt = tooled.apply_chat_template(messages, tools)
        assert prompt.startswith("<|im_start|>system\nBe brief.") and f"<tools>{json.dumps(chat_tools([WEATHER])[0])}" in prompt
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        assert call in prompt and "<tool_response>" not in prompt
        text, _ = calling.grammar()  # type: ignore[misc]  # required: no trigger
        with Engine(tooled, EngineConfig(n_parallel=1, n_ctx=2048, n_threads=1)) as engine:
            forced = grammar.compile(grammar.Gbnf(text), tooled)
            request = engine.submit(tooled.tokenize_chat(messages, tools), RequestParams.of(max_tokens=120, temperature=0, grammar=forced))
            reader = calling.parser()
            for piece in request:
                reader.push(piece.text)
            reader.finish()
        assert not isinstance(reader, TextParser) and reader.calls
        assert request.outcome is not None and request.outcome.end in (End.EOS, End.WORD)
        for call in reader.calls:
            valid_call(call.name, json.loads(call.arguments))


def test_the_official_sdks_send_priority_and_the_tenant_as_their_extras():
    """OpenAI's and Anthropic's clients have no priority argument: extra_body carries it, extra_headers the tenant
    (over a scripted engine, tests/test_server_app.py's: what reached it is what the routes asked of it)."""
    seen = []
    engine = FakeEngine(lambda r: (seen.append(r.params), ends(r, End.EOS)))
    extras = {"extra_body": {"priority": 5}, "extra_headers": {"X-Tenant": "team-b"}}
    hi = [{"role": "user", "content": "Hi"}]
    with launch.serve_app(create_app(engine, Settings(alias="fake"))) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        oai.chat.completions.create(model="fake", messages=hi, **extras)  # type: ignore[arg-type]
        oai.completions.create(model="fake", prompt="Hi", **extras)
        oai.responses.create(model="fake", input="Hi", **extras)
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        claude.messages.create(model="fake", max_tokens=8, messages=hi, **extras)  # type: ignore[arg-type]
    assert [(p.priority, p.tenant) for p in seen] == [(5, "team-b")] * 4
