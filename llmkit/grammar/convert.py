"""JSON Schema -> GBNF: llama-cpp-python's converter, corrected where it lags llama.cpp's C++ one.

(~ llama.cpp's common/json-schema-to-grammar.cpp.) The converter is
``SchemaConverter`` (``llama_cpp.llama_grammar``, a Python port of llama.cpp's)
with these corrections, taken from the C++ original unless said otherwise:

- ``minimum``/``maximum``/``exclusive*`` on integers (``ranges``), and on
  numbers (llmkit's own: llama.cpp does not bound numbers);
- JSON-valid string characters (no raw control characters), also (llmkit's own) from a
  pattern's ``.`` and ``[^...]``, which wrote a raw '"' or '\\';
- dates that exist (llmkit's own: llama.cpp takes 2023-02-31);
- backslashes escaped in literals;
- ``minLength``/``maxLength``/``minItems``/``maxItems`` written as GBNF
  ``{m,n}`` instead of one nested group per repetition.

``grammar_from_schema`` is cached per schema text; ``unenforced_keywords``
lists what the grammar cannot enforce (``strict: true`` refuses those).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from llama_cpp import llama_grammar

from llmkit.grammar.limits import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_NESTING,
    MAX_REPETITIONS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    GrammarError,
)
from llmkit.grammar.ranges import BOUND_KEYS, int_bounds, int_range, number_bounds, number_range

# llama.cpp's "char" (common/json-schema-to-grammar.cpp): JSON forbids raw control characters in
# strings, which the Python port's [^"\\] lets through (json.loads refuses such output).
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# llmkit's own: a pattern's "." and [^...] inside a JSON string. The port writes [^\x0A\x0D] and the
# class as it is, so a raw '"' could end the string early and a raw '\\' or control character break
# the JSON: the dot takes those escaped ('\\"', not '\\n' or '\\r'), a negated class excludes them.
_JSON_DOT = r'[^"\\\x7F\x00-\x1F] | "\\" ["\\/bft]'
_JSON_UNSAFE = r'"\\\x00-\x1F\x7F'
_ESCAPE_OR_CLASS = re.compile(r"\\.|\[(\^?)((?:\\.|[^\]\\])*)\]", re.DOTALL)  # as the port reads a class
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}

# llama.cpp's "date" (also inside "date-time") takes day 01-31 in every month, so 2023-02-31 is an
# answer that a JSON Schema validator refuses. llmkit's own: the days each month has, 29 February in
# leap years only (every 4th year, but of the centuries only every 4th), no year 0000.
_LEAP = '("0" [48] | [2468] [048] | [13579] [26])'  # the two-digit multiples of 4, but 00
_YEAR = '([1-9] [0-9]{3} | "0" [1-9] [0-9]{2} | "00" [1-9] [0-9] | "000" [1-9])'
_MONTH_DAY = (
    '("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
    ' | "02-" ("0" [1-9] | "1" [0-9] | "2" [0-8])'
)
_DATE = f'{_YEAR} "-" ({_MONTH_DAY}) | ([0-9]{{2}} {_LEAP} | {_LEAP} "00") "-02-29"'

# What the converter turns into grammar (an output always satisfies these) ...
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "pattern", "minLength", "maxLength", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",  # on integers and numbers
}  # fmt: skip
# ... what only describes (no constraint on the output) ...
ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "readOnly", "writeOnly", "deprecated",
}  # fmt: skip
# ... and the formats it knows; other formats are ignored.
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}


def _repetition(item: str, min_n: int, max_n: int | None, separator: str = "") -> str:
    """``item`` repeated min..max times (None: no maximum), as GBNF ``{m,n}`` (build_repetition in C++)."""
    if max_n == 0:
        return ""
    if min_n == 0 and max_n == 1:
        return f"{item}?"
    if not separator:
        if max_n is None:
            return f"{item}+" if min_n == 1 else f"{item}*" if min_n == 0 else f"{item}{{{min_n},}}"
        return f"{item}{{{min_n},{max_n}}}"
    rest = _repetition(f"({separator} {item})", max(min_n - 1, 0), None if max_n is None else max_n - 1)
    return f"({item} {rest})?" if min_n == 0 else f"{item} {rest}"


def _count(schema: dict, key: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GrammarError(f"'{key}' must be a non-negative integer, got {json.dumps(value)}")
    if value > MAX_REPETITIONS:
        raise GrammarError(f"'{key}' is {value}: more than {MAX_REPETITIONS} repetitions are not supported")
    return value


class _Converter(llama_grammar.SchemaConverter):
    """llama-cpp-python's converter, corrected where it disagrees with llama.cpp's C++ one."""

    def _format_literal(self, literal: str) -> str:
        return '"' + "".join(_LITERAL_ESCAPES.get(c, c) for c in literal) + '"'

    def _add_rule(self, name: str, rule: str) -> str:
        return super()._add_rule(name, _JSON_DOT if rule == llama_grammar.DOT else rule)

    def _visit_pattern(self, pattern: str, name: str) -> str:
        def json_safe(m: re.Match) -> str:
            return f"[^{_JSON_UNSAFE}{m.group(2)}]" if m.group(1) else m.group(0)

        return super()._visit_pattern(_ESCAPE_OR_CLASS.sub(json_safe, pattern), name)

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char":
            rule = llama_grammar.BuiltinRule(_JSON_CHAR, [])
        elif name == "date":
            rule = llama_grammar.BuiltinRule(_DATE, [])
        return super()._add_primitive(name, rule)

    def visit(self, schema: Any, name: str) -> str:
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be a JSON object, got {json.dumps(schema)[:80]}")
        rule_name = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
        kind = schema.get("type")
        plain = not any(k in schema for k in ("$ref", "anyOf", "oneOf", "const", "enum"))
        if plain and kind == "integer" and any(k in schema for k in BOUND_KEYS):
            lo, hi = int_bounds(schema)
            if lo is not None or hi is not None:
                return self._add_rule(rule_name, f"({int_range(lo, hi)}) space")
        if plain and kind == "number" and any(k in schema for k in BOUND_KEYS):
            low, high = number_bounds(schema)
            if low is not None or high is not None:
                return self._add_rule(rule_name, f"({number_range(low, high)}) space")
        if (
            plain
            and kind == "string"
            and ("minLength" in schema or "maxLength" in schema)
            and not ("pattern" in schema or schema.get("format") in FORMATS)
        ):
            lo, hi = _count(schema, "minLength") or 0, _count(schema, "maxLength")
            if hi is not None and hi < lo:
                raise GrammarError(f"maxLength ({hi}) is below minLength ({lo})")
            char = self._add_primitive("char", llama_grammar.PRIMITIVE_RULES["char"])
            return self._add_rule(rule_name, f'"\\"" {_repetition(char, lo, hi)} "\\"" space')
        if plain and kind in (None, "array") and isinstance(schema.get("items"), dict) and "prefixItems" not in schema:
            lo, hi = _count(schema, "minItems") or 0, _count(schema, "maxItems")
            if hi is not None and hi < lo:
                raise GrammarError(f"maxItems ({hi}) is below minItems ({lo})")
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            items = _repetition(item, lo, hi, separator='"," space')
            return self._add_rule(rule_name, f'"[" space {items} "]" space')
        return super().visit(schema, name)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON document (iterative: a deep one must not blow Python's stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            todo.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_patterns(schema: Any) -> None:
    """The converter writes a regex ``x{m,n}`` out in full: refuse counts that would make it huge."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                for m in _QUANTIFIER.finditer(pattern):
                    lo, hi = int(m.group(1)), int(m.group(2) or 0)
                    if lo > MAX_REPETITIONS or hi - lo > MAX_GRAMMAR_NESTING:
                        raise GrammarError(
                            f"the pattern's {m.group(0)} repeats too much (at most {MAX_REPETITIONS} "
                            f"times, of which at most {MAX_GRAMMAR_NESTING} optional)"
                        )
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def schema_text(schema: Any) -> str:
    """The schema as compact JSON (its cache key; property order kept: it is the output's order)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"the schema must be a JSON object, got {type(schema).__name__}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    _check_patterns(schema)
    text = json.dumps(schema or {"type": "object"}, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the schema is {len(text)} characters long: the limit is {MAX_SCHEMA_CHARS}")
    return text


def grammar_from_schema(schema: dict, root: str = "root") -> str:
    """GBNF for a JSON Schema, its top rule named ``root`` (another name: rules for a bigger grammar to use).
    An empty schema means any JSON object."""
    return _convert(schema_text(schema), root)


@functools.lru_cache(maxsize=256)
def _convert(text: str, root: str) -> str:
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        schema = converter.resolve_refs(json.loads(text), "input")
        converter.visit(schema, "" if root == "root" else root)
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError("the schema is nested too deeply (or its $ref cycle has no end)") from None
    except Exception as exc:  # noqa: BLE001 -- the converter reports with asserts, KeyErrors, ...
        reason = str(exc) or type(exc).__name__
        raise GrammarError(f"the schema cannot be converted to a grammar: {reason[:300]}") from None
    gbnf = converter.format_grammar()
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the schema's grammar is {len(gbnf)} characters long: the limit is {MAX_GRAMMAR_CHARS}")
    return gbnf


ANY_JSON_OBJECT = grammar_from_schema({})


def unenforced_keywords(schema: Any, path: str = "$") -> list[str]:
    """Keywords of ``schema`` the grammar does not enforce (an output may break them), as paths."""
    found: list[str] = []
    todo = [(schema, path)]
    while todo:
        node, at = todo.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in ANNOTATIONS:
                continue
            if key not in ENFORCED:
                found.append(f"{at}.{key}")
            elif key == "format" and value not in FORMATS:
                found.append(f"{at}.format ({value})")
            elif key in BOUND_KEYS and node.get("type") not in ("integer", "number"):
                found.append(f"{at}.{key} (only on integers and numbers)")
            elif key == "oneOf":
                found.append(f"{at}.oneOf (served as anyOf: an output may match several)")
            elif key == "allOf":
                found.append(f"{at}.allOf (only the properties of its parts are kept)")
            elif key == "required" and isinstance(value, list):
                missing = [k for k in value if k not in (node.get("properties") or {})]
                if missing:
                    found.append(f"{at}.required ({', '.join(map(str, missing))}: not in properties)")
            elif isinstance(node.get("type"), list) and key not in ("type", "enum", "const"):
                found.append(f"{at}.{key} (ignored beside a list of types: use anyOf)")
        for key in ("properties", "$defs", "definitions"):
            if isinstance(node.get(key), dict):
                todo.extend((v, f"{at}.{key}.{k}") for k, v in node[key].items())
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(key), list):
                todo.extend((v, f"{at}.{key}[{i}]") for i, v in enumerate(node[key]))
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                todo.append((node[key], f"{at}.{key}"))
            elif key == "items" and isinstance(node.get(key), list):
                todo.extend((v, f"{at}.items[{i}]") for i, v in enumerate(node[key]))
    return sorted(found)
