"""The package's rooms: the runtime apart from the course's apparatus (llmkit.course), and the maps of them.

The servers install and run without the ``lab`` extra, so no runtime module may import ``llmkit.course`` or a
package that only the extra brings (tree-sitter, Pygments, wcwidth, ...). And the maps list the same rooms as the
files on disk: ``llmkit/__init__.py``'s, each package's own docstring map (``engine``, ``server``, its
``dialects``, ``grammar``), and README.md's "Layout", down to the modules of ``engine/`` and ``server/``.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import llmkit

ROOT = Path(__file__).resolve().parents[1]
LLMKIT = Path(llmkit.__file__).parent
COURSE = "llmkit.course"


def runtime_modules(folder: Path = LLMKIT, prefix: str = "llmkit.") -> list[str]:
    """Every module under ``folder`` but the course's, found on disk (pkgutil.walk_packages would import packages)."""
    names = []
    for info in pkgutil.iter_modules([str(folder)]):
        name = prefix + info.name
        if name == COURSE or info.name == "__main__":  # __main__ runs the CLI when imported
            continue
        names.append(name)
        if info.ispkg:
            names += runtime_modules(folder / info.name, name + ".")
    return names


def lab_packages() -> list[str]:
    """The import names of the ``lab`` extra's packages (each imports under its distribution's name, ``-`` as ``_``)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    return sorted(re.match(r"[A-Za-z0-9_.-]+", req).group().lower().replace("-", "_") for req in extra)


def without_lab(code: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where the lab extra's packages cannot be imported, as if not installed."""
    # sys.modules[name] = None: importing name raises ModuleNotFoundError; ROOT first: this checkout's llmkit from any cwd
    block = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfor name in {lab_packages()!r}:\n    sys.modules[name] = None\n"
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", block + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_runtime_imports_nothing_of_the_course_or_the_lab_extra():
    modules = runtime_modules()
    assert {"llmkit.cli", "llmkit.engine.engine", "llmkit.server.app", "llmkit.sequential.app"} <= set(modules)
    code = f"""
import importlib, json
missing = {{}}
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing[name] = exc.name
print(json.dumps({{"missing": missing, "course": sorted(m for m in sys.modules if m.startswith({COURSE!r}))}}))
"""
    # Blocked rather than looked for in sys.modules afterwards: httpx imports Pygments whenever it is installed (for its
    # own command line) and does without it when it is not.
    run = without_lab(code)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["missing"] == {}, "runtime modules that need the lab extra (module: package)"
    assert found["course"] == [], "runtime modules import the course's apparatus"


def test_the_cli_names_the_lab_extra_when_a_command_needs_it(tmp_path):
    # Arguments that fail at once if the command ran after all: no model, no upstream source, no server to ask.
    commands = (
        ["upstream", "find", "get_available_slot"],
        ["bench", "-m", str(tmp_path / "none.gguf"), "-o", str(tmp_path / "out")],
        ["translate", "Hello", "--url", "http://127.0.0.1:9"],
        ["fleet", "--port", "9"],
        ["sim", "capacity", "--users", "1"],
        ["exercises"],
    )
    code = f"""
from llmkit.cli import main
for argv in {commands!r}:
    try:
        main(argv)
    except SystemExit as exc:
        print(exc.code)
"""
    nowhere = {"LLMKIT_UPSTREAM_DIR": str(tmp_path / "upstream"), "LLMKIT_UPSTREAM_SDIST": str(tmp_path / "none.tar.gz")}
    run = without_lab(code, cwd=tmp_path, env=nowhere)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    commands = ["llmkit upstream", "llmkit bench", "llmkit translate", "llmkit fleet", "llmkit sim", "llmkit exercises"]
    assert [line.split(":")[0] for line in lines] == commands, run.stdout
    assert all("pip install 'llmkit[lab]'" in line for line in lines), run.stdout


# --- one map of the rooms -------------------------------------------------------------------------

ENTRY = re.compile(r"( *)([a-z_]\w*)(?:\.py|/)?(?: |$)")  # "  engine/   the slot engine", "    launch.py   start/stop ..."


def tree(lines: list[str], indent: int) -> dict[str, dict]:
    """The entries at ``indent`` spaces (named as modules: no ``.py``, no ``/``), each with the tree of the entries
    nested under it (two spaces deeper)."""
    found: dict[str, list[str]] = {}
    for line in lines:
        entry = ENTRY.match(line)
        depth = len(entry.group(1)) if entry else -1
        if depth == indent:
            found[entry.group(2)] = []
        elif depth > indent and found and line.strip():
            found[list(found)[-1]].append(line)
    return {name: tree(under, indent + 2) for name, under in found.items()}


def readme_layout() -> list[str]:
    """The lines under ``llmkit/`` in README.md's "Layout" block, up to the next top-level entry."""
    section = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1].splitlines()
    start = block.index("llmkit/") + 1
    end = next((i for i, line in enumerate(block[start:], start) if not line.startswith(" ")), len(block))
    return block[start:end]


def on_disk(folder: Path) -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name != "__main__")


def test_the_package_map_and_the_readme_list_the_rooms_on_disk():
    readme, docstring = tree(readme_layout(), 2), tree(llmkit.__doc__.splitlines(), 4)
    disk = (on_disk(LLMKIT), on_disk(LLMKIT / "course"))
    for where, rooms in (("README.md", readme), ("llmkit/__init__.py", docstring)):
        assert (sorted(rooms), sorted(rooms.get("course", []))) == disk, f"{where}'s map and the files differ"
    assert list(readme) == list(docstring) and list(readme["course"]) == list(docstring["course"]), (
        "the two maps list the rooms in one order"
    )
    assert list(docstring)[-1] == "course", "the runtime first, then the course's apparatus"


MAP_ENTRY = re.compile(r"( *)([a-z_]\w*)(?:\.py|/)? {2,}\S")  # "config.py        EngineConfig: ...", "    dialects/    one ..."
MAPPED = ("engine", "server", "server/dialects", "grammar")  # the packages whose docstring maps their modules


def docstring_map(package: Path) -> list[str]:
    """The modules a package's docstring lists: its map's entries (a name, two spaces or more, its role) at the map's indent."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    entries = [(len(m.group(1)), m.group(2)) for line in doc.splitlines() if (m := MAP_ENTRY.match(line))]
    indent = min((i for i, _ in entries), default=0)
    return sorted(name for i, name in entries if i == indent)


@pytest.mark.parametrize("package", MAPPED)
def test_each_package_docstring_maps_its_modules_on_disk(package):
    assert docstring_map(LLMKIT / package) == on_disk(LLMKIT / package), f"llmkit/{package}/__init__.py's map and the files differ"


@pytest.mark.parametrize("package", ("engine", "server", "server/dialects"))
def test_the_readme_lists_the_modules_of_the_engine_and_the_server(package):
    rooms = tree(readme_layout(), 2)
    for part in package.split("/"):
        rooms = rooms[part]
    assert sorted(rooms) == on_disk(LLMKIT / package), f"README.md's Layout under {package}/ and the files differ"


def test_no_function_of_the_engine_or_the_server_runs_over_40_lines():
    """The engine and the server are what readers study: each function fits one screen (from ``def`` to its last line)."""
    import ast

    long = []
    for folder in ("engine", "server"):
        for path in sorted((LLMKIT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 40:
                    long.append(f"{path.relative_to(LLMKIT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


# --- the house: no import circle, no file past 450 lines ---------------------------------------------------------------

DATA_TABLES = {  # files over the limit because most of their lines are one table of data, read and tested as a table
    "llmkit.course.upstream.mapping": "MAP: about 350 of its lines are one table of llmkit <-> llama-server pairs",
}
MAX_LINES = 450


def modules_on_disk() -> dict[str, Path]:
    """Every module of llmkit by its dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted(LLMKIT.rglob("*.py")):
        parts = path.relative_to(LLMKIT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The llmkit modules ``name`` imports anywhere in its text: at the top, inside functions, under TYPE_CHECKING.
    ``from a.b import c`` imports the module ``a.b.c`` if there is one, else ``a.b`` (the parents' ``__init__`` that
    Python also runs on the way are not counted: a package importing its own modules would always close a circle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                here = name.split(".")[: len(name.split(".")) - (path.name != "__init__.py")]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    known = modules_on_disk()
    return {name: imported(name, path, known) for name, path in known.items()}


def circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest chain of imports from ``start`` back to itself, if there is one."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for after in sorted(graph[path[-1]]):
            if after == start:
                return [*path, start]
            if after not in seen:
                seen.add(after)
                paths.append([*path, after])
    return None


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that is on any, each circle named once."""
    circles, named = [], set()
    for module in sorted(graph):
        if module not in named and (circle := circle_through(graph, module)) is not None:
            named |= set(circle)
            circles.append(circle)
    return circles


def test_the_circle_finder_reads_type_only_and_local_imports_and_names_a_circle(tmp_path):
    code = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmkit.llama import Model\n\n\n"
        "def later():\n    from llmkit import text\n    import llmkit.timings\n"
    )
    (tmp_path / "fake.py").write_text(code)
    assert imported("llmkit.fake", tmp_path / "fake.py", modules_on_disk()) == {"llmkit.llama", "llmkit.text", "llmkit.timings"}
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_modules_of_llmkit():
    """Each module imports only what sits below it, type-only and function-local imports included: a reader can start
    at the bottom, and a change never has to be made on both sides of a circle."""
    circles = [" -> ".join(c) for c in import_circles(import_graph())]
    assert circles == [], "import circles"


def test_no_file_of_llmkit_runs_over_450_lines():
    """A file is read whole: past about 450 lines it holds more than one role (data tables apart)."""
    long = {
        name: n
        for name, path in modules_on_disk().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in DATA_TABLES
    }
    assert long == {}, f"files over {MAX_LINES} lines"
