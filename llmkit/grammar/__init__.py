"""Structured output: JSON Schema -> GBNF, and GBNF checked before it reaches a slot.

(~ llama-server's use of common/json-schema-to-grammar in server-schema.cpp.)
One path from what a request asks for to what a slot's sampler takes:

    constraint = Schema({"type": "object", ...}) or Gbnf('root ::= "yes" | "no"')
    g = compile(constraint, model)      # convert (a schema), check, parse once; cached; GrammarError says why not
    SamplingParams(grammar=g)           # the slot's sampler clones g's parse and masks every token that leaves it

The package's parts:

    convert   JSON Schema -> GBNF: llama-cpp-python's converter with llama.cpp's corrections
    ranges    minimum/maximum on integers (as llama.cpp) and on numbers (llmkit's own)
    gbnf      the checks that keep llama.cpp from refusing late, hanging or crashing
    limits    the sizes beyond which a schema or grammar is refused, and ``GrammarError``
    sampler   the parse llama.cpp's sampler takes: ``Grammar``, ``GrammarSampler``, ``Trigger``
"""

from __future__ import annotations

from dataclasses import dataclass

from llmkit.grammar.convert import ANY_JSON_OBJECT, grammar_from_schema, schema_text, unenforced_keywords
from llmkit.grammar.gbnf import check
from llmkit.grammar.limits import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_NESTING,
    MAX_GRAMMAR_RULES,
    MAX_REPETITIONS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    GrammarError,
)
from llmkit.grammar.sampler import Grammar
from llmkit.llama import Model

__all__ = [
    "ANY_JSON_OBJECT", "MAX_GRAMMAR_CHARS", "MAX_GRAMMAR_NESTING", "MAX_GRAMMAR_RULES", "MAX_REPETITIONS",
    "MAX_SCHEMA_CHARS", "MAX_SCHEMA_DEPTH", "Constraint", "Gbnf", "Grammar", "GrammarError", "Schema",
    "check", "compile", "grammar_from_schema", "schema_text", "unenforced_keywords",
]  # fmt: skip


@dataclass(frozen=True)
class Schema:
    """A JSON Schema to answer in (``{}``: any JSON object)."""

    schema: dict
    strict: bool = False  # refuse keywords the grammar cannot enforce, instead of ignoring them
    field: str = "json_schema"  # where the request carried it: error messages name it


@dataclass(frozen=True)
class Gbnf:
    """A grammar in llama.cpp's GBNF, root rule ``root``."""

    text: str


Constraint = Schema | Gbnf


def compile(constraint: Constraint, model: Model) -> Grammar:
    """The constraint as a ``Grammar`` for ``model``'s slots: converted, checked, parsed once (each step cached).

    Raises ``GrammarError`` (a ValueError: a 400 for the HTTP layer) with the reason; a schema's
    reason names the field that carried it.
    """
    if isinstance(constraint, Gbnf):
        return check(constraint.text, model)
    try:
        if constraint.strict and (unenforced := unenforced_keywords(constraint.schema)):
            shown = ", ".join(unenforced[:8]) + (", ..." if len(unenforced) > 8 else "")
            raise GrammarError(f"strict is true but the grammar cannot enforce: {shown} (remove them, or set strict to false)")
        text = grammar_from_schema(constraint.schema)
    except GrammarError as exc:
        raise GrammarError(f"'{constraint.field}': {exc}") from None
    return check(text, model)
