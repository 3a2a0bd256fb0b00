"""GBNF checked before it reaches a slot: what llama.cpp would refuse, and what would hang or crash it.

``check`` runs before a request is queued, so a bad grammar is a 400 and never
reaches the engine thread. It refuses what llama.cpp itself would refuse
(syntax, undefined rules, left recursion), and, first, what would make
llama.cpp hang or crash the process instead of refusing:

- left recursion through a rule that may match nothing (``a ::= b a "x"``,
  ``b ::= "y"?``): llama.cpp's own check misses it and then loops forever;
- groups nested thousands deep, or a grammar of megabytes: its recursive
  parser overflows the C stack;
- a grammar that allows no token at all at the start.

A grammar that passes is a ``Grammar``: llama.cpp's parse of it, which every
request's sampler clones (kept by the model, Model.grammars, and freed with it).
"""

from __future__ import annotations

import numpy as np

from llmkit.grammar.limits import MAX_GRAMMAR_CHARS, MAX_GRAMMAR_NESTING, MAX_GRAMMAR_RULES, MAX_REPETITIONS, GrammarError
from llmkit.grammar.sampler import Grammar
from llmkit.llama import Model


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
        return GrammarError(
            f"the grammar does not parse (GBNF): {message} at line {line}, column {column}" + (f" (near {near!r})" if near else "")
        )

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

    def integer(self) -> int:
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
        """The symbols of one alternative, up to "|", ")" or the end of the rule."""
        seq: list[str | None] = []
        last: int | None = None  # where the last symbol starts in seq (None: nothing to repeat)
        while self.pos < len(self.src):
            if self.peek() in "*+?{":
                if last is None:
                    raise self.fail(f"expecting an item before {self.peek()}")
                last = self.repeat(rule, nested, seq, last)
            else:
                symbols = self.item(rule, depth)
                if symbols is None:
                    break
                last = len(seq) if symbols else None
                seq.extend(symbols)
            self.space(nested)
        return seq

    def item(self, rule: str, depth: int) -> list[str | None] | None:
        """The symbols of the item that starts here (one, or none for ""), or None if no item starts here."""
        c = self.peek()
        if c == '"':
            return self.literal()
        if c == "[":
            self.char_class()
            return [None]
        if c in "<!":
            self.token()
            return [None]
        if c == ".":
            self.pos += 1
            return [None]
        if c.isascii() and (c.isalnum() or c == "-"):
            at = self.pos
            ref = self.name()
            self.refs.setdefault(ref, at)
            return [ref]
        if c == "(":
            return [self.group(rule, depth)]
        return None

    def literal(self) -> list[str | None]:
        """A "..." string: one terminal for what we look at, or nothing if it is empty."""
        self.pos += 1
        empty = True
        while self.peek() != '"':
            self.char()
            empty = False
        self.pos += 1
        return [] if empty else [None]

    def char_class(self) -> None:
        """Skips a [...] character class, ranges and "^" included."""
        self.pos += 1
        if self.peek() == "^":
            self.pos += 1
        while self.peek() != "]":
            self.char()
            if self.peek() == "-" and self.peek(1) != "]":
                self.pos += 1
                self.char()
        self.pos += 1

    def token(self) -> None:
        """Skips a token written <...> or !<...> (by id or by text)."""
        if self.peek() == "!":
            self.pos += 1
        if self.peek() != "<":
            raise self.fail("expecting '<'")
        end = self.src.find(">", self.pos)
        if end < 0:
            raise self.fail("expecting '>'")
        self.pos = end + 1

    def group(self, rule: str, depth: int) -> str:
        """A ( ... ) group, made a rule of its own; returns its name."""
        if depth + 1 > MAX_GRAMMAR_NESTING:
            raise self.fail(f"groups nested more than {MAX_GRAMMAR_NESTING} deep")
        self.pos += 1
        self.space(True)
        sub = self.generated(rule)
        self.rules[sub] = self.alternates(rule, nested=True, depth=depth + 1)
        if self.peek() != ")":
            raise self.fail("expecting ')'")
        self.pos += 1
        return sub

    def repeat(self, rule: str, nested: bool, seq: list[str | None], last: int) -> int | None:
        """Applies *, +, ? or {m,n} to the item at ``seq[last:]``; returns where that item now starts (None: gone)."""
        c = self.peek()
        self.pos += 1
        lo, hi = self.braces(nested) if c == "{" else {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        item = seq[last:]
        del seq[last:]
        seq.extend(item * min(lo, 2))  # for nullability and left corners, two copies say all
        if hi is None or hi > lo:  # the optional part: R ::= item R | (empty), as llama.cpp
            rep = self.generated(rule)
            self.rules[rep] = [item + ([rep] if hi is None or hi - lo > 1 else []), []]
            seq.append(rep)
        return None if not seq[last:] else last

    def braces(self, nested: bool) -> tuple[int, int | None]:
        """The minimum and maximum of {m}, {m,} or {m,n} (None: no maximum), read after the "{"."""
        self.space(nested)
        lo = self.integer()
        self.space(nested)
        if self.peek() == "}":
            hi: int | None = lo
        elif self.peek() == ",":
            self.pos += 1
            self.space(nested)
            hi = self.integer() if self.peek().isdigit() else None
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
        return lo, hi


def _check_left_recursion(rules: dict[str, list[list[str | None]]]) -> None:
    """Refuse the left recursion that makes llama.cpp loop forever.

    A rule that can reach itself without consuming input, through a reference
    that has more symbols after it, grows llama.cpp's grammar stack at every
    turn: its loop never ends (llama.cpp's own check only sees the simplest
    cases). Through last symbols only, the stack keeps its size and llama.cpp's
    "seen" set stops the loop, so those are left to llama.cpp.
    """
    edges = _left_references(rules, _nullable(rules))
    component = _Components(edges).of
    for name, out in edges.items():
        for target, grows in out:
            if grows and component[target] == component[name]:
                shown = name.split("_")[0]  # groups and repetitions are named after their rule
                raise GrammarError(
                    f"the grammar is left-recursive: rule {shown!r} can come back to itself without "
                    "consuming any text (llama.cpp cannot run such a grammar; rewrite it with right recursion or *)"
                )


def _nullable(rules: dict[str, list[list[str | None]]]) -> set[str]:
    """The rules that may match nothing: those with an alternative made only of such rules (until none is added)."""
    nullable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            if name not in nullable and any(all(s is not None and s in nullable for s in alt) for alt in alts):
                nullable.add(name)
                changed = True
    return nullable


def _left_references(rules: dict[str, list[list[str | None]]], nullable: set[str]) -> dict[str, list[tuple[str, bool]]]:
    """Each rule's references reachable before any text, each with whether more symbols follow it."""
    edges: dict[str, list[tuple[str, bool]]] = {name: [] for name in rules}
    for name, alts in rules.items():
        for alt in alts:
            for i, sym in enumerate(alt):
                if sym is None:
                    break
                edges[name].append((sym, i < len(alt) - 1))
                if sym not in nullable:
                    break
    return edges


class _Components:
    """The strongly connected components of a graph of rules (Tarjan's algorithm).

    Iterative: a chain of rules as long as the limit allows would overflow Python's recursion.
    ``of`` maps each rule to its component (the index of the component's first rule found).
    """

    def __init__(self, edges: dict[str, list[tuple[str, bool]]]):
        self.edges = edges
        self.index: dict[str, int] = {}  # rule -> order of discovery
        self.low: dict[str, int] = {}  # rule -> the lowest index it reaches among the rules on the stack
        self.of: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        for start in edges:
            if start not in self.index:
                self.explore(start)

    def explore(self, start: str) -> None:
        """Depth first from ``start``, a work list of (rule, its next edge) in place of recursion."""
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                self.enter(node)
            out = self.edges[node]
            if i < len(out):
                work.append((node, i + 1))
                nxt = out[i][0]
                if nxt not in self.index:
                    work.append((nxt, 0))
                elif nxt in self.on_stack:
                    self.low[node] = min(self.low[node], self.index[nxt])
                continue
            if self.low[node] == self.index[node]:
                self.close(node)
            if work:
                parent = work[-1][0]
                self.low[parent] = min(self.low[parent], self.low[node])

    def enter(self, node: str) -> None:
        """Numbers a rule seen for the first time and puts it on the stack."""
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        self.on_stack.add(node)

    def close(self, root: str) -> None:
        """Pops the component whose first rule is ``root`` off the stack."""
        while True:
            member = self.stack.pop()
            self.on_stack.discard(member)
            self.of[member] = self.index[root]
            if member == root:
                break


def check(gbnf: str, model: Model) -> Grammar:
    """``gbnf`` parsed for ``model``, or ``GrammarError`` (a ValueError) with the reason a slot could not serve it.
    A grammar that passed is kept by the model (``Model.grammars``): sent again, it is neither checked nor parsed."""
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar is {len(gbnf)} characters long: the limit is {MAX_GRAMMAR_CHARS}")
    kept = model.grammars.get(gbnf)
    return kept if isinstance(kept, Grammar) else model.grammars.keep(_check(gbnf, model))


def _check(gbnf: str, model: Model) -> Grammar:
    try:
        raw = gbnf.encode()
    except UnicodeEncodeError:
        raise GrammarError("the grammar is not valid Unicode (it holds a lone surrogate)") from None
    if b"\x00" in raw:
        raise GrammarError("the grammar holds a NUL character")
    _check_left_recursion(_GbnfReader(gbnf).parse())
    try:
        grammar = Grammar.parse(gbnf, model)
    except ValueError as why:
        raise GrammarError(f"llama.cpp refused the grammar: {why}") from None
    probe = grammar.sampler.clone()  # the first step: some token (or the end) must be allowed
    try:
        probe.masked(np.zeros(model.n_vocab, dtype=np.float32))
    except ValueError:
        raise GrammarError("the grammar allows no token to start with") from None
    finally:
        probe.close()
    return grammar
