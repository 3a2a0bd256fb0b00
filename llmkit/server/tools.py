"""Tool calls: the tools described to the model, a grammar that forces the call, a parser that reads it back.

(~ llama.cpp's common/chat.cpp, which llama-server runs from ``oaicompat_chat_params_parse``.)
llama.cpp works from the tool syntax of each model's chat template; SmolLM2's template has
none, so llama-server ignores ``tools`` on it, even with ``tool_choice: "required"``. llmkit
gives every model one format, Hermes 2 Pro's (the one Qwen 2.5, Hermes and SmolLM3 were
trained on, and that llama.cpp parses as ``COMMON_CHAT_FORMAT_HERMES_2_PRO``):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One ``ToolCalling`` per request does the three jobs:

- ``render``: the tools described in the system message, and earlier calls and results
  written as the model would have written and read them. A chat template that renders
  tools itself in this format (it names ``tools`` and writes ``<tool_call>``) gets them
  as they are, through its own ``tools`` variable;
- ``sampling``: the grammar. ``"required"`` and a named tool: from the first token, so the
  answer is a call. ``"auto"``: lazy, as llama.cpp's; the text runs free until the model
  writes ``<tool_call>`` (the trigger), then the call's grammar applies. Either way a call's
  arguments follow its tool's JSON Schema. ``"none"``: no tools in the prompt, no grammar;
- ``parser``: a ``CallParser`` that turns the text, as it streams, into content and calls,
  as deltas (llama.cpp: ``common_chat_msg_diff``) that each API writes in its own shape
  (a ``TextParser``, all content, when no call can come).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal

from llmkit.grammar import grammar_from_schema
from llmkit.text import StopMatcher

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters: {}
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # JSON-safe: a name is written into the grammar and the JSON as it is

SYSTEM_PROMPT = """\
You are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. \
You may call one or more functions to assist with the user query. Don't make assumptions about what values to plug \
into functions. Here are the available tools:
<tools>
{tools}
</tools>
For each function call return a JSON object with the function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-dict>}}
</tool_call>"""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1 to 128 letters, digits, '_', '.', ':' or '-'")
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: the parameters' schema must be of type 'object'")

    def to_openai(self) -> dict:
        """The tool as OpenAI's chat API writes it (and chat templates read it)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


Mode = Literal["none", "auto", "required"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as the model wrote it (an object once complete)

    def parsed_arguments(self) -> dict:
        """The arguments as a JSON object; ``{}`` for arguments cut short (``max_tokens``)."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Delta:
    """What one piece of text added to the answer (llama.cpp: ``common_chat_msg_diff``): content,
    or a tool call's start (``index``, ``id`` and ``name``) or a run of its arguments (``index``)."""

    content: str = ""
    index: int = -1  # the tool call this delta belongs to; -1: content
    id: str = ""
    name: str = ""
    arguments: str = ""


def new_call_id() -> str:
    """A tool call's id; each API writes it with its own prefix (``call_``, ``toolu_``, ``fc_``)."""
    return secrets.token_hex(12)


@dataclass
class ToolCalling:
    """A request's tools and how it may use them (``tool_choice``, ``parallel_tool_calls``)."""

    tools: list[Tool]
    mode: Mode = "auto"
    name: str | None = None  # "required" with one named tool
    parallel: bool = False  # several calls in one answer
    native: bool = False  # the chat template renders tools in this format itself (``renders_tools``)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) < len(names):
            raise ValueError("tool names must be unique")
        if self.mode != "none" and not self.tools:
            raise ValueError(f"tool_choice {self.mode!r} needs at least one tool")
        if self.name is not None and self.name not in names:
            raise ValueError(f"tool_choice names the tool {self.name!r}, which is not among the tools")

    @property
    def active(self) -> bool:
        """Will the answer be read for tool calls?"""
        return self.mode != "none"

    # --- the prompt --------------------------------------------------------------------

    def render(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """The messages to give the chat template, and its ``tools`` variable (None: none).

        A template that renders tools in this format gets the tools, the calls and the results as
        they are; any other gets them as text (``render_generic``).
        """
        tools = [t.to_openai() for t in self.tools] if self.active else []
        if self.native:
            return messages, tools or None
        return render_generic(messages, tools), None

    # --- the grammar -------------------------------------------------------------------

    def grammar(self) -> tuple[str, str | None] | None:
        """GBNF for the call(s), and the trigger word that starts it (None: it applies from the first token).

        A call is ``{"name": ..., "arguments": ...}`` for one of the tools (the named one, if any),
        arguments per that tool's schema. Several calls in a row if ``parallel``; then the end.
        """
        if not self.active:
            return None
        tools = [t for t in self.tools if self.name in (None, t.name)]
        rules = grammar_from_schema(calls_schema(tools), root="call")
        one = f'"\\n" call "\\n{CLOSE}"'
        more = f' ("\\n{OPEN}" {one})*' if self.parallel else ""
        if self.mode == "auto":
            return f"root ::= {one}{more}\n{rules}", OPEN
        return f'root ::= "{OPEN}" {one}{more}\n{rules}', None

    def parser(self) -> CallParser | TextParser:
        return CallParser() if self.active else TextParser()


def renders_tools(template: str) -> bool:
    """Does a chat template describe tools and write calls in this format itself (Qwen 2.5, Hermes, SmolLM3)?"""
    return "tools" in template and OPEN in template


def calls_schema(tools: list[Tool]) -> dict:
    """The JSON Schema of a call of any of ``tools``: its name, then its arguments (in that order).

    Each tool's arguments schema sits in ``$defs`` (the converter follows a ``$ref`` through
    objects only, not through ``anyOf``'s list), its own references moved there with it.
    """
    defs = {f"{t.name}-arguments": relocate(t.parameters or NO_ARGUMENTS, f"#/$defs/{t.name}-arguments", t.name) for t in tools}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/{t.name}-arguments"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"$defs": defs}


def relocate(schema: dict, at: str, prefix: str) -> dict:
    """``schema`` moved to JSON pointer ``at`` of a bigger schema: its local ``$ref`` s point into it there,
    and its definitions (``$defs``, ``definitions``) are renamed ``<prefix>-<name>``, because the converter
    names a definition's rule after its last name, and two tools may each define an ``Address``."""

    def ref(target: str) -> str:
        if not target.startswith("#"):
            return target  # remote: the converter refuses it, with its reason
        if m := re.match(r"#/(\$defs|definitions)/([^/]+)", target):
            return f"{at}/{m[1]}/{prefix}-{m[2]}{target[m.end() :]}"
        return at + target[1:]

    def move(node: object) -> object:
        if isinstance(node, list):
            return [move(x) for x in node]
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else move(v) for k, v in node.items()}
        return node

    moved: dict = move(schema)  # type: ignore[assignment]  # a dict stays a dict
    for key in ("$defs", "definitions"):
        if isinstance(moved.get(key), dict):
            moved[key] = {f"{prefix}-{name}": sub for name, sub in moved[key].items()}
    return moved


def render_generic(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation as plain chat messages: the tools described at the top of the system message,
    each earlier call as the ``<tool_call>`` text the model would have written, each result as a
    ``tool`` message wrapped in ``<tool_response>`` (Hermes 2 Pro's prompt)."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = [c["function"] for c in m.pop("tool_calls", None) or []]
        m.pop("tool_call_id", None)
        written = [f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': _loads(c['arguments'])})}\n{CLOSE}" for c in calls]
        if written:
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *written]))
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    if tools:
        described = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _loads(arguments: str | dict) -> object:
    """Arguments as a JSON value (a client may send an object, or JSON text that is not JSON)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# --- reading the answer ----------------------------------------------------------------


class TextParser:
    """An answer with no tools to call: all of it is content."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[Delta]:
        self.content += text
        return [Delta(content=text)] if text else []

    def finish(self) -> list[Delta]:
        return []


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_END = re.compile(rf"\s*\}}\s*{re.escape(CLOSE)}")
_NEXT = re.compile(rf"\s*{re.escape(OPEN)}")


class CallParser:
    """The answer's text, piece by piece, read as content, then ``<tool_call>`` blocks (llama.cpp:
    ``common_chat_parse`` of the Hermes 2 Pro format, with ``is_partial``).

    Content is released as it comes, but for a tail that may still become ``<tool_call>``
    (``StopMatcher``). In a call, the name is released once whole, the arguments as they
    are written. The grammar guarantees the shape, so reading it needs no backtracking.
    """

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ToolCall] = []
        self._before = StopMatcher([OPEN])
        self._text = ""  # the text from the first <tool_call> on
        self._at = 0  # how far it is read
        self._state: Literal["header", "arguments", "end", "next"] = "header"
        self._depth, self._in_string, self._escaped = 0, False, False

    def push(self, text: str) -> list[Delta]:
        """Read more of the answer; what it adds."""
        if not self._before.stopped:
            deltas = self._content(self._before.push(text))
            if not self._before.stopped:
                return deltas
            text = self._before.after
            return deltas + self.push(text) if text else deltas
        self._text += text
        return self._read_calls()

    def finish(self) -> list[Delta]:
        """The answer has ended: text held back as a possible ``<tool_call>`` was content after all."""
        return [] if self._before.stopped else self._content(self._before.flush())

    def _content(self, text: str) -> list[Delta]:
        self.content += text
        return [Delta(content=text)] if text else []

    def _read_calls(self) -> list[Delta]:
        deltas: list[Delta] = []
        while self._at < len(self._text):
            if self._state == "arguments":
                deltas += self._read_arguments()
                if self._state == "arguments":
                    break
                continue
            m = {"header": _HEADER, "end": _END, "next": _NEXT}[self._state].match(self._text, self._at)
            if m is None:  # not all there yet
                break
            self._at = m.end()
            if self._state == "header":
                self.calls.append(ToolCall(new_call_id(), m.group(1)))
                deltas.append(Delta(index=len(self.calls) - 1, id=self.calls[-1].id, name=m.group(1)))
            self._state = {"header": "arguments", "end": "next", "next": "header"}[self._state]  # type: ignore[assignment]
        return deltas

    def _read_arguments(self) -> list[Delta]:
        """The arguments' JSON, up to the brace that closes it: strings and escapes followed, braces counted."""
        i = self._at
        while self._depth == 0 and i < len(self._text) and self._text[i].isspace():  # the space before the value
            i += 1
        start = i
        while i < len(self._text) and self._state == "arguments":
            c = self._text[i]
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "end"
            i += 1
        self._at = i
        piece = self._text[start:i]
        self.calls[-1].arguments += piece
        return [Delta(index=len(self.calls) - 1, arguments=piece)] if piece else []
