"""Build the real llama-server from the same llama.cpp that llmkit runs.

    path = server_binary()     # built on first use (~7 min on 2 cores), cached afterwards

CMake and Ninja come from PyPI (the ``cmake`` and ``ninja`` packages), the
compiler from the system. The CPU flags are chosen so that the binary runs on
any x86-64 machine of the kind it was built on, not just this one: no
``-march=native`` (an AMX tile instruction from a native build crashed on a
machine here), AVX2/FMA/F16C/BMI2 when this CPU has them, else the baseline.
The build folder is named after the version and the flags, so a cached binary
is only reused where it fits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from llmkit.course import tr
from llmkit.course.upstream.source import UpstreamError, data_dir, root, version

X86_64_V3 = ("avx2", "fma", "f16c", "bmi2")  # the x86-64-v3 extensions ggml uses; all AMD/Intel CPUs since ~2015
COMMON_FLAGS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",  # one self-contained binary
    "GGML_NATIVE": "OFF",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_UI": "OFF",  # the web UI needs Node.js and a download: llama-server runs without it
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_CURL": "OFF",
}


def cpu_level() -> str:
    """``x86-64-v3`` if this CPU has AVX2, FMA, F16C and BMI2; else ``baseline``."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "baseline"
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return "x86-64-v3" if flags.issuperset(X86_64_V3) else "baseline"


def cmake_flags(level: str | None = None) -> dict[str, str]:
    level = level or cpu_level()
    on = "ON" if level == "x86-64-v3" else "OFF"
    return COMMON_FLAGS | {"GGML_AVX": on, "GGML_AVX2": on, "GGML_FMA": on, "GGML_F16C": on, "GGML_BMI2": on,
                           "GGML_AVX512": "OFF", "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF"}  # fmt: skip


def build_dir(level: str | None = None) -> Path:
    return data_dir() / f"llama-server-{version()}-{level or cpu_level()}"


def server_binary(*, build: bool = True, progress: bool = True) -> Path:
    """The llama-server binary of the installed version, built first if needed."""
    binary = build_dir() / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if not build:
        raise UpstreamError(f"llama-server is not built yet ({binary}); call llmkit.course.upstream.server_binary() to build it")
    with _lock(build_dir()):
        if not binary.is_file():  # another process may have built it while we waited
            _build(build_dir(), progress)
    return binary


def _build(folder: Path, progress: bool) -> None:
    source = root()
    work = folder.with_name(folder.name + ".work")
    flags = [f"-D{k}={v}" for k, v in cmake_flags().items()]
    cmake, ninja = tool("cmake"), tool("ninja")
    log = folder.with_name(folder.name + ".log")
    with log.open("w") as out:
        _run([cmake, "-S", str(source), "-B", str(work), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", *flags], out, log)
        steps = _run_steps([cmake, "--build", str(work), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], out, log)
        _follow(steps, progress)
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "bin" / "llama-server", folder / "bin" / "llama-server.tmp")
    os.replace(folder / "bin" / "llama-server.tmp", folder / "bin" / "llama-server")
    shutil.rmtree(work, ignore_errors=True)  # ~0.3 GB of objects; a failed build keeps them to resume


def tool(name: str) -> str:
    """``cmake`` / ``ninja`` from their PyPI packages (in this environment), else from PATH."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if found is None:
        raise UpstreamError(f"{name} not found: pip install {name} (it is in llmkit's [lab] extra)")
    return found


def _run(command: list[str], out, log: Path) -> None:
    if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode != 0:
        raise UpstreamError(f"building llama-server failed at: {' '.join(command[:2])} ... (log: {log})\n{_tail(log)}")


def _run_steps(command: list[str], out, log: Path) -> Iterator[tuple[int, int]]:
    """Run the build, echoing its output to the log; yield ninja's ``[done/total]`` as it goes."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None  # stdout=PIPE
    for line in process.stdout:
        out.write(line)
        if m := re.match(r"\[(\d+)/(\d+)\]", line):
            yield int(m[1]), int(m[2])
    if process.wait() != 0:
        out.flush()
        raise UpstreamError(f"building llama-server failed (log: {log})\n{_tail(log)}")


def _follow(steps: Iterator[tuple[int, int]], show: bool) -> None:
    """Wait for the build, with a progress bar (a widget in a notebook, a line in a terminal)."""
    from tqdm.auto import tqdm

    desc = tr("building llama-server {version} (once, ~7 min on 2 cores)", version=version())
    with tqdm(desc=desc, unit="step", mininterval=2, disable=not show) as bar:
        for done, total in steps:
            bar.total = total
            bar.update(done - bar.n)


def _tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


@contextlib.contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """One build at a time per folder, across processes (tests and a notebook may both ask)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
