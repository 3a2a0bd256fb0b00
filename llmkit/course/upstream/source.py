"""The llama.cpp source that llmkit runs, fetched once and kept.

llmkit drives llama.cpp through llama-cpp-python, whose source distribution
on PyPI carries the exact llama.cpp it was built from (``vendor/llama.cpp``,
llama-server's ``tools/server/`` included). ``root()`` gives that tree for the
installed version: the first call downloads the source distribution with pip
(about 75 MB, ~20 s), unpacks it into the per-user data folder, and later
calls (offline too) reuse it.

    root() / "tools/server/server-context.cpp"

``$LLMKIT_UPSTREAM_DIR`` moves the folder; ``$LLMKIT_UPSTREAM_SDIST`` names a
``llama_cpp_python-<version>.tar.gz`` already on disk (no download).
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import llama_cpp
import platformdirs

from llmkit.course import tr

PACKAGE = "llama-cpp-python"
SKIPPED = ("models/",)  # llama.cpp's test vocabularies (75 MB): nothing here reads them


class UpstreamError(Exception):
    """The source cannot be had (the message says what to run), or it is not the installed version."""


def version() -> str:
    """The installed llama-cpp-python's version: the source must be exactly this one."""
    return llama_cpp.__version__


def data_dir() -> Path:
    """``$LLMKIT_UPSTREAM_DIR``, else ``<user data dir>/llmkit/upstream``."""
    env = os.environ.get("LLMKIT_UPSTREAM_DIR")
    return Path(env).expanduser() if env else platformdirs.user_data_path("llmkit", appauthor=False) / "upstream"


def root(*, fetch: bool = True) -> Path:
    """The ``vendor/llama.cpp`` folder of the installed version's source, fetched if needed."""
    tree = data_dir() / f"{PACKAGE}-{version()}"
    if not (tree / "PKG-INFO").is_file():
        if not fetch:
            raise UpstreamError(f"the llama.cpp source is not here yet ({tree}); call llmkit.course.upstream.root() to fetch it")
        unpack(download(), tree)
    check_version(tree)
    return tree / "vendor" / "llama.cpp"


def download() -> Path:
    """The source distribution as a file: ``$LLMKIT_UPSTREAM_SDIST`` if set, else from the package index."""
    if sdist := os.environ.get("LLMKIT_UPSTREAM_SDIST"):
        return Path(sdist)
    dest = Path(tempfile.mkdtemp(prefix="llmkit-sdist-"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", f"--no-binary={PACKAGE}",
               "--disable-pip-version-check", "--quiet", f"{PACKAGE}=={version()}", "-d", str(dest)]  # fmt: skip
    print(
        tr("Downloading the source of {package} {version} (llama.cpp with llama-server, ~75 MB) ...", package=PACKAGE, version=version()),
        file=sys.stderr,
    )
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(dest.glob("*.tar.gz"))
    if done.returncode != 0 or not found:
        shutil.rmtree(dest, ignore_errors=True)
        raise UpstreamError(
            f"could not download the source of {PACKAGE} {version()} from the package index.\n"
            f"pip said: {(done.stderr or done.stdout).strip()[-800:]}\n"
            f"With access to PyPI, run:  {' '.join(command[:-2])} -d DIR\n"
            "then set LLMKIT_UPSTREAM_SDIST=DIR/<the .tar.gz> (or retry when the index can be reached)."
        )
    return found[0]


def unpack(sdist: Path, tree: Path) -> None:
    """Unpack ``sdist`` into ``tree`` (atomically: a half-unpacked tree is never left under that name)."""
    if not sdist.is_file():
        raise UpstreamError(f"source distribution not found: {sdist}")
    tree.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=tree.name + ".", dir=tree.parent))
    try:
        with tarfile.open(sdist) as tar:
            top = f"{PACKAGE.replace('-', '_')}-{version()}/"
            members = [m for m in tar.getmembers() if m.name.startswith(top) and not _skipped(m.name[len(top) :])]
            if not members:
                raise UpstreamError(f"{sdist} is not the source distribution of {PACKAGE} {version()}")
            tar.extractall(tmp, members, filter="data")
        if not (tree / "PKG-INFO").is_file():
            shutil.rmtree(tree, ignore_errors=True)  # a leftover of an interrupted unpack
        try:
            os.replace(tmp / top, tree)
        except OSError:  # another process unpacked it first
            if not (tree / "PKG-INFO").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _skipped(path: str) -> bool:
    return any(path.startswith("vendor/llama.cpp/" + prefix) for prefix in SKIPPED)


def check_version(tree: Path) -> None:
    """Refuse a tree that is not the installed llama-cpp-python's (the C++ would not be what runs)."""
    meta = email.parser.Parser().parsestr((tree / "PKG-INFO").read_text(errors="replace"), headersonly=True)
    if meta["Version"] != version():
        raise UpstreamError(f"{tree} holds {PACKAGE} {meta['Version']}, but {version()} is installed")
    if not (tree / "vendor" / "llama.cpp" / "tools" / "server").is_dir():
        raise UpstreamError(f"{tree} has no vendor/llama.cpp/tools/server: remove the folder and fetch it again")
