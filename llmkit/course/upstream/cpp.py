"""Find llama.cpp's C++ by name, with a real parser (tree-sitter's C++ grammar).

    find("get_available_slot")            # a method, found inside its struct
    find("server_queue::start_loop")      # qualified: this class's, not server_context's
    find("server_slot")                   # a struct; enums and classes too
    find("server_routes::post_completions")  # a route handler: a lambda assigned in init_routes

A ``Symbol`` knows its file, first and last line and text; in a notebook it
shows itself highlighted (Pygments) with the file's line numbers. Long ones
can be cut to what matters: ``symbol.lines(a, b)`` or ``symbol.around("text")``.
"""

from __future__ import annotations

import functools
import html
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import tree_sitter_cpp
from tree_sitter import Language, Node, Parser

from llmkit.course import tr
from llmkit.course.upstream.source import root

SEARCHED = ("tools/server", "common", "src", "include")  # in this order: llama-server first
SUFFIXES = (".cpp", ".h", ".hpp")
TYPE_KINDS = {"struct_specifier": "struct", "class_specifier": "class", "enum_specifier": "enum", "union_specifier": "union"}
SCOPES = {"namespace_definition", *TYPE_KINDS}


@dataclass(frozen=True)
class Symbol:
    """One definition in the source: ``name`` is qualified (``server_context_impl::update_slots``)."""

    name: str
    kind: str  # function, struct, class, enum, union, lambda (Python: function, class, method, module)
    path: str  # relative to llama.cpp's root, e.g. tools/server/server-context.cpp (Python: to the repo's root)
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    text: str
    language: str = "cpp"  # or "python": llmkit's side of a comparison

    @property
    def n_lines(self) -> int:
        return self.end - self.start + 1

    def lines(self, first: int, last: int) -> Symbol:
        """The part of this symbol between two line numbers of its file (inclusive)."""
        first, last = max(first, self.start), min(last, self.end)
        if first > last:
            raise ValueError(f"{self.name} spans lines {self.start}-{self.end}")
        text = "\n".join(self.text.splitlines()[first - self.start : last - self.start + 1])
        return replace(self, start=first, end=last, text=text)

    def line_of(self, needle: str) -> int:
        """The file's line number of the first line of this symbol that contains ``needle``."""
        for number, line in enumerate(self.text.splitlines(), self.start):
            if needle in line:
                return number
        raise LookupError(f"{needle!r} is not in {self.name} ({self.path}:{self.start}-{self.end})")

    def around(self, needle: str, before: int = 2, after: int = 12) -> Symbol:
        """The lines around the first that contains ``needle``."""
        at = self.line_of(needle)
        return self.lines(at - before, at + after)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.start}-{self.end}"

    @property
    def kind_name(self) -> str:
        """``kind`` in the reader's language (the label of a caption)."""
        names = {"function": tr("function"), "struct": tr("struct"), "class": tr("class"), "enum": tr("enum"), "union": tr("union"),
                 "lambda": tr("lambda"), "method": tr("method"), "module": tr("module")}  # fmt: skip
        return names.get(self.kind, self.kind)

    def __str__(self) -> str:
        width = len(str(self.end))
        numbered = (f"{n:>{width}}  {line}" for n, line in enumerate(self.text.splitlines(), self.start))
        comment = "//" if self.language == "cpp" else "#"
        return f"{comment} {self.name} ({self.kind_name}) — {self.where}\n" + "\n".join(numbered)

    def _repr_html_(self) -> str:
        return highlight(self)


def highlight(symbol: Symbol) -> str:
    """HTML: a caption (name, file, lines) over the code, highlighted, numbered as in the file."""
    from pygments import highlight as pygmentize
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import CppLexer, PythonLexer

    lexer = CppLexer() if symbol.language == "cpp" else PythonLexer()
    formatter = HtmlFormatter(linenos="inline", linenostart=symbol.start, noclasses=True, style="default")
    caption = (
        f"<div style='font-family:monospace;font-size:90%;color:#555'>{html.escape(symbol.name)} "
        f"({tr('{kind}, {n} lines', kind=symbol.kind_name, n=symbol.n_lines)}) — {html.escape(symbol.where)}</div>"
    )
    return caption + pygmentize(symbol.text, lexer, formatter)


@dataclass(frozen=True)
class SideBySide:
    """Two or more symbols in columns (C++ beside Python); a plain listing outside a notebook."""

    symbols: tuple[Symbol, ...]

    def __str__(self) -> str:
        return "\n\n".join(map(str, self.symbols))

    def _repr_html_(self) -> str:
        columns = "".join(f"<div style='flex:1;min-width:0;overflow-x:auto'>{highlight(s)}</div>" for s in self.symbols)
        return f"<div style='display:flex;gap:1em;align-items:flex-start'>{columns}</div>"


def side_by_side(*symbols: Symbol) -> SideBySide:
    return SideBySide(symbols)


def find(name: str) -> Symbol:
    """The definition called ``name`` (or ending in ``::name``); overloads: the first.

    Raises ``LookupError`` if there is none, or if the name fits several
    different symbols (the message lists them: qualify the name).
    """
    found = find_all(name)
    if not found:
        raise LookupError(f"no definition of {name!r} in llama.cpp's {', '.join(SEARCHED)}")
    exact = [s for s in found if s.name == name]  # `server_task` is the struct, not its constructor
    names = sorted({s.name for s in exact or found})
    if len(names) > 1:
        raise LookupError(f"{name!r} is ambiguous: {', '.join(names)}")
    return (exact or found)[0]


def find_all(name: str) -> list[Symbol]:
    """Definitions named ``name`` or ``...::name``, from the first searched folder that has any."""
    for folder in SEARCHED:
        found = [s for s in index(folder) if s.name == name or s.name.endswith("::" + name)]
        if found:
            return found
    return []


@functools.cache
def index(folder: str = "tools/server") -> tuple[Symbol, ...]:
    """Every definition with a body in one folder of llama.cpp (parsed once per process)."""
    base = root()
    files = (p for p in sorted((base / folder).rglob("*")) if p.suffix in SUFFIXES)
    return tuple(s for path in files for s in definitions(path, base))


@functools.cache
def _parser() -> Parser:
    return Parser(Language(tree_sitter_cpp.language()))


def definitions(path: Path, base: Path) -> Iterator[Symbol]:
    """The functions, types and lambda-valued assignments defined in one file."""
    source = path.read_bytes()
    tree = _parser().parse(source)
    relative = path.relative_to(base).as_posix()
    lines = source.decode("utf-8", errors="replace").splitlines()

    def symbol(node: Node, name: str, kind: str) -> Symbol:
        start, end = node.start_point[0], node.end_point[0]
        return Symbol(name, kind, relative, start + 1, end + 1, "\n".join(lines[start : end + 1]))

    def walk(node: Node, scope: tuple[str, ...]) -> Iterator[Symbol]:
        for child in node.named_children:
            if child.type == "function_definition" and (name := function_name(child)):
                qualified = "::".join((*scope, name))
                yield symbol(child, qualified, "function")
                yield from lambdas(child, qualified.rsplit("::", 1)[0] if "::" in qualified else "")
            elif child.type in SCOPES and child.child_by_field_name("body") is not None:
                name = text(child.child_by_field_name("name")) or "(anonymous)"
                if child.type in TYPE_KINDS:
                    yield symbol(child, "::".join((*scope, name)), TYPE_KINDS[child.type])
                yield from walk(field(child, "body"), (*scope, name))
            else:
                yield from walk(child, scope)

    def lambdas(function: Node, owner: str) -> Iterator[Symbol]:
        """``this->post_completions = [this](...) {...};``: route handlers are defined this way."""
        for node in descendants(function.child_by_field_name("body")):  # (none: "= default", "= delete")
            if node.type == "assignment_expression" and field(node, "right").type == "lambda_expression":
                left = field(node, "left")
                target = left.child_by_field_name("field") if left.type == "field_expression" else left
                if target is not None and target.type in ("identifier", "field_identifier"):
                    parent = node.parent
                    statement = parent if parent is not None and parent.type == "expression_statement" else node
                    yield symbol(statement, "::".join(filter(None, (owner, text(target)))), "lambda")

    yield from walk(tree.root_node, ())


def field(node: Node, name: str) -> Node:
    """A child that nodes of this kind always have (a definition's body, an assignment's sides)."""
    child = node.child_by_field_name(name)
    if child is None:
        raise LookupError(f"a {node.type} without its {name} at line {node.start_point[0] + 1}")
    return child


def function_name(node: Node) -> str | None:
    """``void server_context::start_loop()`` -> ``server_context::start_loop``; None for odd macros."""
    declarator = node.child_by_field_name("declarator")
    while declarator is not None and declarator.type != "function_declarator":
        declarator = declarator.child_by_field_name("declarator")
    name = declarator.child_by_field_name("declarator") if declarator is not None else None
    return text(name).replace(" ", "") if name is not None else None


def descendants(node: Node | None) -> Iterator[Node]:
    stack = [node] if node is not None else []
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.named_children))


def text(node: Node | None) -> str:
    return node.text.decode() if node is not None and node.text is not None else ""


def count_lines(folder: str | Path, suffixes: tuple[str, ...] = SUFFIXES) -> dict[str, int]:
    """Lines per file under ``folder`` (relative to llama.cpp's root, or absolute), largest first."""
    base = Path(folder) if Path(folder).is_absolute() else root() / folder
    counts = {p.relative_to(base).as_posix(): len(p.read_bytes().splitlines()) for p in base.rglob("*") if p.suffix in suffixes}
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
