"""Structured output: JSON Schema -> GBNF, and GBNF checked before it reaches a slot.

(~ llama-server's use of common/json-schema-to-grammar in server-schema.cpp.)

    gbnf = grammar_from_schema({"type": "object", "properties": {...}})   # cached per schema text
    check_grammar(gbnf, model)          # ValueError with the reason, or None: safe for a slot
    SamplingParams(grammar=gbnf)        # the slot's sampler masks every token that leaves it

The conversion is llama-cpp-python's ``SchemaConverter`` (``llama_cpp.llama_grammar``,
a Python port of llama.cpp's converter) with four corrections taken from the
C++ original: integer ``minimum``/``maximum``, JSON-valid string characters
(no raw control characters), backslashes escaped in literals, and
``minLength``/``maxLength``/``minItems``/``maxItems`` written as GBNF ``{m,n}``
instead of one nested group per repetition.

``check_grammar`` runs before a request is queued, so a bad grammar is a 400
and never reaches the engine thread. It refuses what llama.cpp itself would
refuse (syntax, undefined rules, left recursion), and, first, what would make
llama.cpp hang or crash the process instead of refusing:

- left recursion through a rule that may match nothing (``a ::= b a "x"``,
  ``b ::= "y"?``): llama.cpp's own check misses it and then loops forever;
- groups nested thousands deep, or a grammar of megabytes: its recursive
  parser overflows the C stack;
- a grammar that allows no token at all at the start.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
from typing import Any

import llama_cpp as lc
import numpy as np
from llama_cpp import llama_grammar

from llmkit.llama import Model

# --- limits (measured: see the README's "Structured output" section) ----------

MAX_SCHEMA_CHARS = 64 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # nesting of the schema document ({} and [] levels)
MAX_GRAMMAR_CHARS = 64 * 1024  # GBNF text, given or converted
MAX_GRAMMAR_NESTING = 128  # ( ... ) groups inside one another
MAX_GRAMMAR_RULES = 2048  # rules, counting the groups and repetitions the parser makes
MAX_REPETITIONS = 2000  # {m,n}: llama.cpp's own MAX_REPETITION_THRESHOLD


class GrammarError(ValueError):
    """The schema or grammar cannot be served; the message says why (a 400 for the HTTP layer)."""


# --- JSON Schema -> GBNF --------------------------------------------------------------

# llama.cpp's "char" (common/json-schema-to-grammar.cpp): JSON forbids raw control characters in
# strings, which the Python port's [^"\\] lets through (json.loads refuses such output).
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}

# What the converter turns into grammar (an output always satisfies these) ...
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "pattern", "minLength", "maxLength", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",  # on integers only
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


def _int_range(lo: int | None, hi: int | None) -> str:
    """GBNF for the decimal integers in [lo, hi], either end open (build_min_max_int in C++)."""
    out: list[str] = []
    w = out.append

    def digit_range(a: str, b: str) -> None:
        w(f"[{a}]" if a == b else f"[{a}-{b}]")

    def more_digits(min_d: int, max_d: int | None) -> None:
        w("[0-9]")
        if min_d == max_d == 1:
            return
        w("{" + str(min_d) + ("" if max_d == min_d else "," + ("" if max_d is None else str(max_d))) + "}")

    def uniform_range(a: str, b: str) -> None:  # a and b have the same number of digits
        i = 0
        while i < len(a) and i < len(b) and a[i] == b[i]:
            i += 1
        if i > 0:
            w(f'"{a[:i]}"')
        if i < len(a) and i < len(b):
            if i > 0:
                w(" ")
            sub_len = len(a) - i - 1
            if sub_len > 0:
                a_sub, b_sub = a[i + 1 :], b[i + 1 :]
                zeros, nines = "0" * sub_len, "9" * sub_len
                to_reached = False
                w("(")
                if a_sub == zeros:
                    digit_range(a[i], chr(ord(b[i]) - 1))
                    w(" ")
                    more_digits(sub_len, sub_len)
                else:
                    w(f"[{a[i]}] (")
                    uniform_range(a_sub, nines)
                    w(")")
                    if ord(a[i]) < ord(b[i]) - 1:
                        w(" | ")
                        if b_sub == nines:
                            digit_range(chr(ord(a[i]) + 1), b[i])
                            to_reached = True
                        else:
                            digit_range(chr(ord(a[i]) + 1), chr(ord(b[i]) - 1))
                        w(" ")
                        more_digits(sub_len, sub_len)
                if not to_reached:
                    w(" | ")
                    digit_range(b[i], b[i])
                    w(" ")
                    uniform_range(zeros, b_sub)
                w(")")
            else:
                w(f"[{a[i]}-{b[i]}]")

    def build(lo: int | None, hi: int | None, decimals_left: int = 16, top_level: bool = True) -> None:
        if lo is not None and hi is not None:
            if lo < 0 and hi < 0:
                w('"-" (')
                build(-hi, -lo, decimals_left, True)
                w(")")
                return
            if lo < 0:
                w('"-" (')
                build(0, -lo, decimals_left, True)
                w(") | ")
                lo = 0
            lo_s, hi_s = str(lo), str(hi)
            for digits in range(len(lo_s), len(hi_s)):
                uniform_range(lo_s, "9" * digits)
                lo_s = "1" + "0" * digits
                w(" | ")
            uniform_range(lo_s, hi_s)
            return
        less = max(decimals_left - 1, 1)
        if lo is not None:
            if lo < 0:
                w('"-" (')
                build(None, -lo, decimals_left, False)
                w(") | [0] | [1-9] ")
                more_digits(0, decimals_left - 1)
            elif lo == 0:
                if top_level:
                    w("[0] | [1-9] ")
                    more_digits(0, less)
                else:
                    more_digits(1, decimals_left)
            elif lo <= 9:
                c, start = str(lo), "1" if top_level else "0"
                if c > start:
                    digit_range(start, chr(ord(c) - 1))
                    w(" ")
                    more_digits(1, less)
                    w(" | ")
                digit_range(c, "9")
                w(" ")
                more_digits(0, less)
            else:
                lo_s = str(lo)
                c = lo_s[0]
                if c > "1":
                    digit_range("1" if top_level else "0", chr(ord(c) - 1))
                    w(" ")
                    more_digits(len(lo_s), less)
                    w(" | ")
                digit_range(c, c)
                w(" (")
                build(int(lo_s[1:]), None, less, False)
                w(")")
                if c < "9":
                    w(" | ")
                    digit_range(chr(ord(c) + 1), "9")
                    w(" ")
                    more_digits(len(lo_s) - 1, less)
            return
        if hi is not None:
            if hi >= 0:
                if top_level:
                    w('"-" [1-9] ')
                    more_digits(0, less)
                    w(" | ")
                build(0, hi, decimals_left, True)
            else:
                w('"-" (')
                build(-hi, None, decimals_left, False)
                w(")")
            return
        raise ValueError("an integer range needs a minimum or a maximum")

    build(lo, hi)
    return "".join(out)


def _bound(schema: dict, key: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GrammarError(f"'{key}' must be a number, got {json.dumps(value)}")
    if not abs(value) < 2**63:  # as llama.cpp (int64); NaN fails this too
        raise GrammarError(f"'{key}' must be a 64-bit integer, got {value}")
    return value


def _int_bounds(schema: dict) -> tuple[int | None, int | None]:
    lo = hi = None
    if (v := _bound(schema, "minimum")) is not None:
        lo = math.ceil(v)
    elif (v := _bound(schema, "exclusiveMinimum")) is not None:
        lo = math.floor(v) + 1
    if (v := _bound(schema, "maximum")) is not None:
        hi = math.floor(v)
    elif (v := _bound(schema, "exclusiveMaximum")) is not None:
        hi = math.ceil(v) - 1
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(f"no integer is between the minimum ({lo}) and the maximum ({hi})")
    return lo, hi


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

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char":
            rule = llama_grammar.BuiltinRule(_JSON_CHAR, [])
        return super()._add_primitive(name, rule)

    def visit(self, schema: Any, name: str) -> str:
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be a JSON object, got {json.dumps(schema)[:80]}")
        rule_name = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
        kind = schema.get("type")
        plain = not any(k in schema for k in ("$ref", "anyOf", "oneOf", "const", "enum"))
        if plain and kind == "integer" and any(
            k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        ):
            lo, hi = _int_bounds(schema)
            if lo is not None or hi is not None:
                return self._add_rule(rule_name, f"({_int_range(lo, hi)}) space")
        if plain and kind == "string" and ("minLength" in schema or "maxLength" in schema) and not (
            "pattern" in schema or schema.get("format") in FORMATS
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


def grammar_from_schema(schema: dict) -> str:
    """GBNF (root rule ``root``) for a JSON Schema. An empty schema means any JSON object."""
    return _convert(schema_text(schema))


@functools.lru_cache(maxsize=256)
def _convert(text: str) -> str:
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        schema = converter.resolve_refs(json.loads(text), "input")
        converter.visit(schema, "")
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
            elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") and node.get("type") != "integer":
                found.append(f"{at}.{key} (only on integers)")
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


# --- GBNF checks -----------------------------------------------------------------------


class _GbnfReader:
    """Reads GBNF as llama.cpp's parser does (src/llama-grammar.cpp), to find what it cannot handle.

    Each rule becomes a list of alternatives, each a list of symbols: ``None`` for a terminal,
    a rule name for a reference. Groups and repetitions become rules of their own, as there.
    """

    def __init__(self, text: str):
        self.src = text
        self.pos = 0
        self.rules: dict[str, list[list[str | None]]] = {}
        self.refs: dict[str, int] = {}  # referenced name -> where (for "undefined rule")
        self.n_generated = 0

    def fail(self, message: str, at: int | None = None) -> GrammarError:
        at = self.pos if at is None else at
        line = self.src.count("\n", 0, at) + 1
        column = at - (self.src.rfind("\n", 0, at) + 1) + 1
        near = self.src[at : at + 20].split("\n")[0]
        return GrammarError(f"the grammar does not parse (GBNF): {message} at line {line}, column {column}" + (f" (near {near!r})" if near else ""))

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else ""

    def space(self, newline_ok: bool) -> None:
        s, i = self.src, self.pos
        while i < len(s) and (s[i] in " \t#" or (newline_ok and s[i] in "\r\n")):
            if s[i] == "#":
                while i < len(s) and s[i] not in "\r\n":
                    i += 1
            else:
                i += 1
        self.pos = i

    def name(self) -> str:
        start = self.pos
        while self.peek() and (self.peek().isascii() and (self.peek().isalnum() or self.peek() == "-")):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting a rule name")
        return self.src[start : self.pos]

    def int(self) -> int:
        start = self.pos
        while self.peek() and self.peek() in "0123456789":
            self.pos += 1
        if self.pos == start:
            raise self.fail("expecting an integer")
        return int(self.src[start : self.pos])

    def char(self) -> None:
        c = self.peek()
        if not c:
            raise self.fail("unexpected end of input")
        if c != "\\":
            self.pos += 1
            return
        e = self.peek(1)
        size = {"x": 2, "u": 4, "U": 8}.get(e)
        if size:
            digits = self.src[self.pos + 2 : self.pos + 2 + size]
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expecting {size} hex digits after \\{e}")
            self.pos += 2 + size
        elif e and e in 'trn\\"[]-':
            self.pos += 2
        else:
            raise self.fail("unknown escape")

    def count(self) -> None:
        if len(self.rules) >= MAX_GRAMMAR_RULES:
            raise self.fail(f"more than {MAX_GRAMMAR_RULES} rules (counting groups and repetitions)")

    def generated(self, rule: str) -> str:
        self.count()
        self.n_generated += 1
        return f"{rule}_{self.n_generated}"

    def parse(self) -> dict[str, list[list[str | None]]]:
        self.space(True)
        while self.pos < len(self.src):
            self.count()
            name = self.name()
            self.space(False)
            if self.src[self.pos : self.pos + 3] != "::=":
                raise self.fail("expecting ::=")
            self.pos += 3
            self.space(True)
            self.rules[name] = self.alternates(name, nested=False, depth=0)
            if self.peek() == "\r":
                self.pos += 2 if self.peek(1) == "\n" else 1
            elif self.peek() == "\n":
                self.pos += 1
            elif self.peek():
                raise self.fail("expecting newline or end")
            self.space(True)
        for ref, at in self.refs.items():
            if ref not in self.rules:
                raise self.fail(f"undefined rule {ref!r}", at)
        if "root" not in self.rules:
            raise GrammarError("the grammar has no 'root' rule")
        return self.rules

    def alternates(self, rule: str, nested: bool, depth: int) -> list[list[str | None]]:
        alts = [self.sequence(rule, nested, depth)]
        while self.peek() == "|":
            self.pos += 1
            self.space(True)
            alts.append(self.sequence(rule, nested, depth))
        return alts

    def sequence(self, rule: str, nested: bool, depth: int) -> list[str | None]:
        seq: list[str | None] = []
        last: int | None = None  # where the last symbol starts in seq (None: nothing to repeat)
        while self.pos < len(self.src):
            c = self.peek()
            if c == '"':
                self.pos += 1
                start = len(seq)
                while self.peek() != '"':
                    self.char()
                    seq.append(None)
                self.pos += 1
                last = start if len(seq) > start else None
                del seq[start + 1 :]  # a literal is one terminal for what we look at
            elif c == "[":
                self.pos += 1
                if self.peek() == "^":
                    self.pos += 1
                while self.peek() != "]":
                    self.char()
                    if self.peek() == "-" and self.peek(1) != "]":
                        self.pos += 1
                        self.char()
                self.pos += 1
                last = len(seq)
                seq.append(None)
            elif c in "<!":
                if c == "!":
                    self.pos += 1
                if self.peek() != "<":
                    raise self.fail("expecting '<'")
                end = self.src.find(">", self.pos)
                if end < 0:
                    raise self.fail("expecting '>'")
                self.pos = end + 1
                last = len(seq)
                seq.append(None)
            elif c.isascii() and (c.isalnum() or c == "-"):
                at = self.pos
                ref = self.name()
                self.refs.setdefault(ref, at)
                last = len(seq)
                seq.append(ref)
            elif c == "(":
                if depth + 1 > MAX_GRAMMAR_NESTING:
                    raise self.fail(f"groups nested more than {MAX_GRAMMAR_NESTING} deep")
                self.pos += 1
                self.space(True)
                sub = self.generated(rule)
                self.rules[sub] = self.alternates(rule, nested=True, depth=depth + 1)
                if self.peek() != ")":
                    raise self.fail("expecting ')'")
                self.pos += 1
                last = len(seq)
                seq.append(sub)
            elif c == ".":
                self.pos += 1
                last = len(seq)
                seq.append(None)
            elif c in "*+?{":
                if last is None:
                    raise self.fail(f"expecting an item before {c}")
                self.pos += 1
                if c == "{":
                    self.space(nested)
                    lo = self.int()
                    self.space(nested)
                    if self.peek() == "}":
                        hi: int | None = lo
                    elif self.peek() == ",":
                        self.pos += 1
                        self.space(nested)
                        hi = self.int() if self.peek().isdigit() else None
                        self.space(nested)
                        if self.peek() != "}":
                            raise self.fail("expecting '}'")
                    else:
                        raise self.fail("expecting ',' or '}'")
                    self.pos += 1
                    if lo > MAX_REPETITIONS:
                        raise self.fail(f"more than {MAX_REPETITIONS} repetitions")
                    if hi is not None and hi > MAX_REPETITIONS:
                        hi = None  # llama.cpp too: no maximum
                    if hi is not None and hi < lo:
                        raise self.fail("a repetition's maximum is below its minimum")
                else:
                    lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                item = seq[last:]
                del seq[last:]
                seq.extend(item * min(lo, 2))  # for nullability and left corners, two copies say all
                if hi is None or hi > lo:  # the optional part: R ::= item R | (empty), as llama.cpp
                    rep = self.generated(rule)
                    self.rules[rep] = [item + ([rep] if hi is None or hi - lo > 1 else []), []]
                    seq.append(rep)
                last = None if not seq[last:] else last
            else:
                break
            self.space(nested)
        return seq


def _check_left_recursion(rules: dict[str, list[list[str | None]]]) -> None:
    """Refuse the left recursion that makes llama.cpp loop forever.

    A rule that can reach itself without consuming input, through a reference
    that has more symbols after it, grows llama.cpp's grammar stack at every
    turn: its loop never ends (llama.cpp's own check only sees the simplest
    cases). Through last symbols only, the stack keeps its size and llama.cpp's
    "seen" set stops the loop, so those are left to llama.cpp.
    """
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in nullable and any(all(s is not None and s in nullable for s in alt) for alt in alts):
                nullable.add(name)
                changed = True
    edges: dict[str, list[tuple[str, bool]]] = {name: [] for name in rules}
    for name, alts in rules.items():
        for alt in alts:
            for i, sym in enumerate(alt):
                if sym is None:
                    break
                edges[name].append((sym, i < len(alt) - 1))
                if sym not in nullable:
                    break
    # strongly connected components (Tarjan's algorithm, iterative)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = 0
    for start in rules:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            out = edges[node]
            if i < len(out):
                work.append((node, i + 1))
                nxt = out[i][0]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp[member] = index[node]
                    if member == node:
                        break
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    for name, out in edges.items():
        for target, grows in out:
            if grows and comp[target] == comp[name]:
                shown = name.split("_")[0]  # groups and repetitions are named after their rule
                raise GrammarError(
                    f"the grammar is left-recursive: rule {shown!r} can come back to itself without "
                    "consuming any text (llama.cpp cannot run such a grammar; rewrite it with right recursion or *)"
                )


class _LlamaErrors(logging.Handler):
    """Collects llama.cpp's error lines logged on this thread (llmkit.llama forwards them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.thread = threading.get_ident()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append(record.getMessage())


def check_grammar(gbnf: str, model: Model) -> None:
    """Raise ``GrammarError`` (a ValueError) with the reason if a slot could not serve ``gbnf``."""
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is {len(gbnf)} characters long: the limit is {MAX_GRAMMAR_CHARS}")
    _check(gbnf, model)


@functools.lru_cache(maxsize=256)  # only grammars that passed are remembered
def _check(gbnf: str, model: Model) -> None:
    try:
        raw = gbnf.encode()
    except UnicodeEncodeError:
        raise GrammarError("the grammar is not valid Unicode (it holds a lone surrogate)") from None
    if b"\x00" in raw:
        raise GrammarError("the grammar holds a NUL character")
    _check_left_recursion(_GbnfReader(gbnf).parse())
    errors = _LlamaErrors()
    llama_log = logging.getLogger("llmkit.llama")
    llama_log.addHandler(errors)
    try:
        sampler = lc.llama_sampler_init_grammar(model.vocab, raw, b"root")
    finally:
        llama_log.removeHandler(errors)
    if not sampler:
        why = "; ".join(line.strip() for line in errors.lines) or "see the server log"
        raise GrammarError(f"llama.cpp refused the grammar: {why}")
    try:  # the first step: some token (or the end) must be allowed
        data = (lc.llama_token_data * model.n_vocab)()
        view = np.ctypeslib.as_array(data)
        view["id"], view["logit"], view["p"] = np.arange(model.n_vocab, dtype=np.int32), 0.0, 0.0
        lc.llama_sampler_apply(sampler, lc.llama_token_data_array(data, model.n_vocab, -1, False))
        if not np.isfinite(view["logit"]).any():
            raise GrammarError("the grammar allows no token to start with")
    finally:
        lc.llama_sampler_free(sampler)
