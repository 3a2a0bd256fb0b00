"""Build the real llama-server from the same llama.cpp that llmkit runs.

    path = server_binary()     # built on first use (~7 min on 2 cores), cached afterwards

CMake and Ninja come from PyPI (the ``cmake`` and ``ninja`` packages), the
compiler from the system. The CPU features are those llama-cpp-python's own
library was compiled with (its ``llama_print_system_info()``), so that both run
the same ggml kernels: pip compiles that library with ``-march=native``, and a
build for a lower level (AVX2 where the wheel has AVX-512) computes logits that
differ in the second decimal, enough to flip a near-tie in greedy text. The
features are named one by one (``GGML_AVX512=ON`` ...), never ``-march=native``
(an AMX tile instruction from a native build crashed on a machine here), and only
those this CPU has, so the binary runs where it was built even if the wheel came
from another machine. The build folder is named after the version and the
features, so a cached binary is only reused where it fits.
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


# The x86 features ggml's system info names ("AVX2 = 1 | ..."), each with the /proc/cpuinfo flags it needs and the CMake
# options that compile it in (ggml/src/ggml-cpu/CMakeLists.txt: GGML_AVX512 adds -mavx512f, -mavx512cd, -mavx512vl,
# -mavx512dq and -mavx512bw; a native build on an AVX CPU has SSE 4.2, which the system info does not name).
X86_FEATURES = {
    "AVX": ({"avx", "sse4_2"}, ("GGML_SSE42", "GGML_AVX")),
    "AVX2": ({"avx2"}, ("GGML_AVX2",)),
    "F16C": ({"f16c"}, ("GGML_F16C",)),
    "FMA": ({"fma"}, ("GGML_FMA",)),
    "BMI2": ({"bmi2"}, ("GGML_BMI2",)),
    "AVX_VNNI": ({"avx_vnni"}, ("GGML_AVX_VNNI",)),
    "AVX512": ({"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}, ("GGML_AVX512",)),
    "AVX512_VBMI": ({"avx512vbmi"}, ("GGML_AVX512_VBMI",)),
    "AVX512_VNNI": ({"avx512_vnni"}, ("GGML_AVX512_VNNI",)),
    "AVX512_BF16": ({"avx512_bf16"}, ("GGML_AVX512_BF16",)),
    "AMX_INT8": ({"amx_tile", "amx_int8"}, ("GGML_AMX_TILE", "GGML_AMX_INT8")),
}
X86_64_V3 = ("AVX", "AVX2", "F16C", "FMA", "BMI2")  # x86-64-v3, the level of all AMD/Intel CPUs since ~2015


def system_features(info: str) -> dict[str, str]:
    """The CPU features of a ggml system-info line, ``"... CPU : SSE3 = 1 | AVX2 = 1 | ..."`` -> ``{"SSE3": "1", ...}``."""
    _, _, cpu = info.partition("CPU :")
    return dict(re.findall(r"(\w+) = (\w+)", cpu.splitlines()[0] if cpu else ""))


def wheel_features() -> dict[str, str]:
    """The CPU features llama-cpp-python's library was compiled with (what llmkit runs)."""
    import llama_cpp

    return system_features(llama_cpp.llama_print_system_info().decode())


def server_features(binary: Path) -> dict[str, str]:
    """The CPU features a llama-server binary was compiled with: it prints them at log level 4, before loading the model
    (here none: ``/dev/null`` is no GGUF, so it exits at once)."""
    run = subprocess.run([str(binary), "--log-verbosity", "4", "-m", os.devnull], capture_output=True, text=True, timeout=60, check=False)
    line = next((line for line in (run.stdout + run.stderr).splitlines() if "system_info:" in line), "")
    return system_features(line)


def cpu_flags() -> set[str]:
    """This CPU's flags, from /proc/cpuinfo (empty where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def build_features() -> tuple[str, ...]:
    """The x86 features to compile llama-server with: the wheel's, where this CPU has them (none off x86)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    compiled, flags = wheel_features(), cpu_flags()
    return tuple(name for name, (needs, _) in X86_FEATURES.items() if compiled.get(name) == "1" and needs <= flags)


def level(features: tuple[str, ...]) -> str:
    """A folder-name tag for the features: ``x86-64-v3``, ``x86-64-v3+avx512+avx512_vnni``, ``x86-64+avx``, ``aarch64``."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine().lower() or "unknown"
    base = "x86-64-v3" if set(X86_64_V3) <= set(features) else "x86-64"
    return "+".join([base, *(name.lower() for name in features if base == "x86-64" or name not in X86_64_V3)])


def cmake_flags(features: tuple[str, ...]) -> dict[str, str]:
    """CMake's -D options: the common ones, and each x86 feature's options ON or OFF."""
    on = {option for name in features for option in X86_FEATURES[name][1]}
    every = [option for _, options in X86_FEATURES.values() for option in options]
    return COMMON_FLAGS | {option: "ON" if option in on else "OFF" for option in every}


def build_dir(features: tuple[str, ...] | None = None) -> Path:
    return data_dir() / f"llama-server-{version()}-{level(build_features() if features is None else features)}"


def server_binary(*, build: bool = True, progress: bool = True) -> Path:
    """The llama-server binary of the installed version, built first if needed."""
    features = build_features()
    folder = build_dir(features)
    binary = folder / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if not build:
        raise UpstreamError(f"llama-server is not built yet ({binary}); call llmkit.course.upstream.server_binary() to build it")
    with _lock(folder):
        if not binary.is_file():  # another process may have built it while we waited
            _build(folder, features, progress)
    return binary


def _build(folder: Path, features: tuple[str, ...], progress: bool) -> None:
    source = root()
    work = folder.with_name(folder.name + ".work")
    flags = [f"-D{k}={v}" for k, v in cmake_flags(features).items()]
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
