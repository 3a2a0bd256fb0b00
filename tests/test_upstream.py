"""llmkit.course.upstream: the pinned llama.cpp source, C++ found by name, the map to llmkit, the built llama-server."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import subprocess
import sys
import tarfile
import tokenize
from pathlib import Path

import httpx
import llama_cpp
import pytest

from llmkit.course import launch, upstream
from llmkit.course.upstream import build, cpp, mapping, source
from llmkit.engine.request import TO_JSON

LLMKIT = Path(upstream.__file__).resolve().parents[2]  # llmkit/


# --- the source -----------------------------------------------------------------------


def test_the_source_is_the_installed_version():
    tree = upstream.root()
    assert tree.name == "llama.cpp" and tree.parent.name == "vendor"
    pkg_info = (tree.parent.parent / "PKG-INFO").read_text()
    assert f"\nVersion: {llama_cpp.__version__}\n" in pkg_info
    assert (tree / "tools/server/server-context.cpp").is_file()
    assert (tree / "include/llama.h").is_file()


def fake_sdist(path: Path, version: str, files: dict[str, str]) -> Path:
    """A tiny source distribution: the top folder, PKG-INFO and ``files``."""
    top = f"llama_cpp_python-{version}/"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {"PKG-INFO": f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n", **files}.items():
            data = text.encode()
            info = tarfile.TarInfo(top + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_local_source_distribution_is_unpacked_once_then_reused_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKIT_UPSTREAM_DIR", str(tmp_path / "data"))
    server_file = "vendor/llama.cpp/tools/server/server.cpp"
    sdist = fake_sdist(
        tmp_path / "s.tar.gz", llama_cpp.__version__, {server_file: "int main() {}\n", "vendor/llama.cpp/models/big.gguf": "x"}
    )
    monkeypatch.setenv("LLMKIT_UPSTREAM_SDIST", str(sdist))
    tree = source.root()
    assert (tree / "tools/server/server.cpp").read_text() == "int main() {}\n"
    assert not (tree / "models").exists(), "llama.cpp's test vocabularies are not unpacked"
    sdist.unlink()
    assert source.root() == tree  # no download, no sdist: the unpacked tree is reused


def test_a_source_distribution_of_another_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKIT_UPSTREAM_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMKIT_UPSTREAM_SDIST", str(fake_sdist(tmp_path / "old.tar.gz", "0.2.0", {})))
    with pytest.raises(source.UpstreamError, match="is not the source distribution of llama-cpp-python"):
        source.root()
    tree = tmp_path / "data" / f"llama-cpp-python-{llama_cpp.__version__}"  # a tree whose PKG-INFO says otherwise
    (tree / "vendor/llama.cpp/tools/server").mkdir(parents=True)
    (tree / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.2.0\n")
    with pytest.raises(source.UpstreamError, match=f"holds llama-cpp-python 0.2.0, but {llama_cpp.__version__} is installed"):
        source.root()


def test_no_package_index_gives_the_command_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKIT_UPSTREAM_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LLMKIT_UPSTREAM_SDIST", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip may look only in an empty folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(source.UpstreamError) as error:
        source.root()
    message = str(error.value)
    assert "could not download the source of llama-cpp-python" in message
    assert "pip download --no-deps --no-binary=llama-cpp-python" in message and "LLMKIT_UPSTREAM_SDIST" in message
    assert not (tmp_path / "data" / f"llama-cpp-python-{llama_cpp.__version__}").exists()


# --- C++ by name ------------------------------------------------------------------------


def closes_where_it_ends(symbol: upstream.Symbol) -> bool:
    """The parser's span holds the whole definition: it opens on its first line and closes on its last."""
    last = symbol.text.splitlines()[-1].strip()
    return last in ("}", "};") or last.endswith(("}", "};"))


@pytest.mark.parametrize(
    "name, path, kind",
    [
        ("get_available_slot", "tools/server/server-context.cpp", "function"),
        ("server_queue::start_loop", "tools/server/server-queue.cpp", "function"),
        ("server_context::start_loop", "tools/server/server-context.cpp", "function"),
        ("server_slot", "tools/server/server-context.cpp", "struct"),
        ("slot_state", "tools/server/server-context.cpp", "enum"),
        ("server_routes::post_completions", "tools/server/server-context.cpp", "lambda"),
        ("format_error_response", "tools/server/server-common.cpp", "function"),
        ("server_tokens::get_common_prefix", "tools/server/server-common.cpp", "function"),
    ],
)
def test_find_gives_the_whole_definition(name, path, kind):
    symbol = upstream.find(name)
    assert (symbol.path, symbol.kind) == (path, kind)
    assert symbol.name == name or symbol.name.endswith("::" + name)
    lines = (upstream.root() / path).read_text().splitlines()
    assert symbol.text == "\n".join(lines[symbol.start - 1 : symbol.end])
    assert name.rsplit("::", 1)[-1] in symbol.text.splitlines()[0]
    assert closes_where_it_ends(symbol), symbol.text.splitlines()[-1]


def test_an_ambiguous_or_unknown_name_is_an_error():
    with pytest.raises(LookupError, match="ambiguous: server_context::start_loop, server_queue::start_loop"):
        upstream.find("start_loop")
    with pytest.raises(LookupError, match="no definition of 'no_such_function'"):
        upstream.find("no_such_function")


def test_a_symbol_can_be_cut_and_shows_its_own_line_numbers():
    update = upstream.find("update_slots")
    part = update.around("pre_decode();", before=1, after=3)
    assert part.n_lines == 5 and "pre_decode();" in part.text.splitlines()[1]
    assert part.start == update.line_of("pre_decode();") - 1
    html = part._repr_html_()
    assert f"{part.where}" in html and str(part.start) in html and "pre_decode" in html
    assert str(part).splitlines()[1].lstrip().startswith(str(part.start))


def test_the_command_line_prints_a_definition_or_says_what_is_wrong():
    found = subprocess.run(
        [sys.executable, "-m", "llmkit", "upstream", "find", "server_queue::start_loop"], capture_output=True, text=True, check=False
    )
    assert found.returncode == 0
    assert found.stdout.startswith("// server_queue::start_loop (function) — tools/server/server-queue.cpp:")
    ambiguous = subprocess.run(
        [sys.executable, "-m", "llmkit", "upstream", "find", "start_loop"], capture_output=True, text=True, check=False
    )
    assert ambiguous.returncode == 1 and "ambiguous" in ambiguous.stderr and not ambiguous.stdout


def test_llama_server_is_about_22k_lines():
    sizes = upstream.count_lines("tools/server", (".cpp", ".h"))
    assert 15_000 < sum(sizes.values()) < 40_000
    assert next(iter(sizes)) == "server-context.cpp"  # the largest file: the engine and the handlers


# --- the map --------------------------------------------------------------------------


@pytest.mark.parametrize("row", mapping.MAP, ids=lambda r: f"{r.llmkit}~{r.upstream}")
def test_every_row_of_the_map_exists_on_both_sides(row):
    assert any(s.path == row.file for s in upstream.find_all(row.upstream)), f"{row.upstream} is not in {row.file}"
    mapping.resolve(row.llmkit)  # raises if the llmkit symbol is gone
    ours = upstream.llmkit_symbol(row.llmkit)  # what the reading chapter shows beside the C++
    name, head = row.llmkit.rsplit(".", 1)[-1], "\n".join(ours.text.lstrip().splitlines()[:3])  # decorators first
    assert re.search(rf"^\s*(async def|def|class)\s+{name}\b|^{name}\s*=", head, re.MULTILINE), head
    assert (LLMKIT.parent / ours.path).read_text().splitlines()[ours.start - 1 : ours.end] == ours.text.splitlines()


def head_cut(symbol: upstream.Symbol) -> str:
    """A definition's text without its head (decorators, then its first line): a fragment must show the work, not the name."""
    lines = symbol.text.lstrip().splitlines()
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    return "\n".join(lines[1:])


def fragments_missing(row: mapping.Counterpart) -> list[str]:
    """Which of the row's two fragments its symbols do not hold (the C++: any definition of that name in row.file)."""
    theirs = [head_cut(s) for s in upstream.find_all(row.upstream) if s.path == row.file]
    ours = head_cut(upstream.llmkit_symbol(row.llmkit))
    missing = [] if any(row.in_upstream in text for text in theirs) else [f"{row.upstream} has no {row.in_upstream!r}"]
    return missing + ([] if row.in_llmkit in ours else [f"{row.llmkit} has no {row.in_llmkit!r}"])


@pytest.mark.parametrize("row", mapping.MAP, ids=lambda r: f"{r.llmkit}~{r.upstream}")
def test_every_row_of_the_map_shows_the_same_work_on_both_sides(row):
    assert not fragments_missing(row)


def test_a_row_that_points_to_the_wrong_function_is_caught():
    row = next(r for r in mapping.MAP if r.llmkit == "llmkit.engine.slot.Slot.reuse_chunks")
    assert not fragments_missing(row)
    # the map's own mistake until the n_cache_reuse loop was found in pre_decode: both symbols exist, so only the fragment tells
    wrong_cpp = dataclasses.replace(row, upstream="server_context_impl::update_slots")
    test_every_row_of_the_map_exists_on_both_sides(wrong_cpp)
    assert fragments_missing(wrong_cpp) == [f"server_context_impl::update_slots has no {row.in_upstream!r}"]
    wrong_py = dataclasses.replace(row, llmkit="llmkit.engine.slot.Slot.shift_context")  # the same C++ function, another job
    test_every_row_of_the_map_exists_on_both_sides(wrong_py)
    assert fragments_missing(wrong_py) == [f"llmkit.engine.slot.Slot.shift_context has no {row.in_llmkit!r}"]
    in_the_head = dataclasses.replace(row, in_upstream="void pre_decode()", in_llmkit="def reuse_chunks(")  # names, not work
    assert len(fragments_missing(in_the_head)) == 2


def test_a_missing_symbol_on_either_side_is_caught():
    with pytest.raises(LookupError):
        mapping.resolve("llmkit.engine.scheduler.no_such_function")
    with pytest.raises(LookupError):
        mapping.resolve("llmkit.server.app.create_app.no_such_route")
    assert not upstream.find_all("server_context_impl::no_such_method")


def test_a_requests_settings_are_written_in_task_params_to_json_order():
    """RequestParams.to_dict, the one serializer of /props, /slots and generation_settings, writes llama-server's keys in
    the order of task_params::to_json (its full branch, after the metrics-only one)."""
    full = upstream.find("task_params::to_json").text.split("auto grammar_triggers", 1)[1]
    keys = re.findall(r'\{"([\w.]+)",', full)
    assert len(keys) > 40 and [k for k in keys if k in TO_JSON] == list(TO_JSON)


def references(path: Path) -> list[str]:
    """The docstrings and comments of a module that speak of llama-server (by name or by a file of it)."""
    text = path.read_text()
    docs = [
        ast.get_docstring(n) or ""
        for n in ast.walk(ast.parse(text))
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    return [unit for unit in docs + comments if re.search(r"llama-server|server[-\w]*\.(cpp|h)\b", unit)]


def test_every_llama_server_name_in_llmkit_docstrings_is_in_the_map():
    server_names = {}
    for s in cpp.index("tools/server"):
        server_names[s.name] = server_names[s.name.rsplit("::", 1)[-1]] = s.name
    mapped = {row.upstream for row in mapping.MAP} | {row.upstream.rsplit("::", 1)[-1] for row in mapping.MAP}
    named = {}
    for path in sorted(LLMKIT.rglob("*.py")):
        if "upstream" in path.parts:
            continue
        for unit in references(path):
            for word in re.findall(r"[A-Za-z_]\w*(?:::\w+)*", unit):
                if "_" in word and word in server_names and word not in mapped:
                    named.setdefault(word, path.relative_to(LLMKIT.parent).as_posix())
    assert not named, f"llama-server names in docstrings or comments that the map does not hold: {named}"


# --- the real llama-server ----------------------------------------------------------------


def test_the_cpu_features_are_ggml_names_and_options():
    """build.X86_FEATURES pairs ggml's system-info names with its CMake options: both as the pinned source spells them
    (CMake ignores an unknown -D option without a word)."""
    ggml = upstream.root() / "ggml"
    options = set(re.findall(r"option\((GGML_\w+)", (ggml / "CMakeLists.txt").read_text()))
    names = set(re.findall(r'features\.push_back\(\{ "(\w+)", "1" \}\)', (ggml / "src/ggml-cpu/ggml-cpu.cpp").read_text()))
    assert set(build.cmake_flags(())) - set(build.COMMON_FLAGS) <= options
    assert set(build.X86_FEATURES) <= names


def test_llama_server_builds_from_the_same_source_and_serves_the_same_model():
    binary = upstream.server_binary()
    assert binary.is_file() and upstream.version() in str(binary)
    with launch.serve("llama-server", "-np", "2", "-c", "2048", "-t", "1") as server:
        props = httpx.get(f"{server.url}/props").json()
        assert props["total_slots"] == 2
        assert Path(props["model_path"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["finish_reason"] == "length"
    assert not server.running()
