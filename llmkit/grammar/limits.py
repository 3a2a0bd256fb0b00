"""The limits every grammar is held to, and the error that says which one it broke.

Measured: see the README's "Structured output" section. Beyond them llama.cpp
is slow, overflows its C stack or refuses; inside them a grammar is served.
"""

MAX_SCHEMA_CHARS = 64 * 1024  # the schema as compact JSON
MAX_SCHEMA_DEPTH = 64  # nesting of the schema document ({} and [] levels)
MAX_GRAMMAR_CHARS = 64 * 1024  # GBNF text, given or converted
MAX_GRAMMAR_NESTING = 128  # ( ... ) groups inside one another
MAX_GRAMMAR_RULES = 2048  # rules, counting the groups and repetitions the parser makes
MAX_REPETITIONS = 2000  # {m,n}: llama.cpp's own MAX_REPETITION_THRESHOLD


class GrammarError(ValueError):
    """The schema or grammar cannot be served; the message says why (a 400 for the HTTP layer)."""
