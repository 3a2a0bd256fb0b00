"""A cage for a submission's code: each grading process runs in a sandbox of its own, and nothing of it outlives it.

With bubblewrap (``bwrap``, Debian's ``bubblewrap``), where the kernel lets it make namespaces:

- its own process tree (``--unshare-pid``): it cannot see or signal the grader or another submission, and when its
  first process ends the kernel ends every other one (a ``setsid`` daemon too); ``--die-with-parent``, ``--new-session``;
- a read-only view of the system and the venv (``--ro-bind / /``), a fresh ``/tmp``, writes only in its scratch folder;
  what it must not read (the other submissions, the results, the kit's notebooks with their solutions, the chapters'
  checks while the answers run) is covered by an empty folder or ``/dev/null``;
- no network but its own loopback (``--unshare-net``: the servers a check starts listen there), no capabilities;
- its output capped at the descriptor: stdout and stderr are files, and ``RLIMIT_FSIZE`` stops any write past the cap
  (``EFBIG``), whoever writes it (``print``, ``sys.__stdout__``, ``os.write(1, ...)``).

Where bubblewrap is missing or refused (no user namespaces): the **weaker** fallback, said so in the grades. A session
and process group of its own (``setsid``), the same output cap, a scratch folder as its working directory, every
process of the group killed after it, then every process still carrying the run's mark in its environment. It reads
and writes what the grader's user can: a determined submission can still touch files, use the network, signal the
grader (``os.kill(os.getppid(), 9)`` ends the whole run), and a daemon that clears its environment escapes the
clean-up. ``LLMKIT_CAGE=process-group`` forces it (to try it where bubblewrap works).
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

CAGE_ENV = "LLMKIT_CAGE"  # the fallback's mark on every process of one run; "process-group" here forces the fallback
BUBBLEWRAP = "bubblewrap"
FALLBACK = "process group (weaker: no namespaces, the same file and network rights as the grader)"


@functools.cache
def bwrap_works() -> bool:
    """Is ``bwrap`` installed, and may it make the namespaces the cage needs here (and is the fallback not asked for)?"""
    if shutil.which("bwrap") is None or os.environ.get(CAGE_ENV) == "process-group":
        return False
    probe = subprocess.run([*bwrap_argv(Path("/tmp"), [], []), "/bin/true"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def kind() -> str:
    """Which cage this machine gives: bubblewrap, or the weaker fallback."""
    return BUBBLEWRAP if bwrap_works() else FALLBACK


KIT_ROOT = Path(__file__).resolve().parents[3]  # the checkout llmkit runs from (a clone may live under /tmp)


def upstream_dir() -> Path:
    """Where the built llama-server lives (a check may start it in the cage)."""
    from llmkit.course.upstream.source import data_dir

    return data_dir().resolve()


def bwrap_argv(scratch: Path, hidden_dirs: Sequence[Path], hidden_files: Sequence[Path]) -> list[str]:
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
    for kept in {KIT_ROOT, Path(sys.prefix).resolve(), upstream_dir()}:  # readable where the fresh /tmp would hide them
        if kept.exists() and any(Path(fresh) in kept.parents for fresh in ("/tmp", "/dev/shm")):
            argv += ["--ro-bind", str(kept), str(kept)]
    for folder in hidden_dirs:
        if folder.is_dir():
            argv += ["--tmpfs", str(folder)]
    for file in hidden_files:
        if file.is_file():
            argv += ["--ro-bind", "/dev/null", str(file)]
    argv += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch), "--setenv", "TMPDIR", "/tmp"]
    return [*argv, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--"]  # fmt: skip


@dataclass
class Ran:
    """How a caged process ended: its exit code (None: killed by the grader), and whether it overran."""

    returncode: int | None
    overran: bool
    stderr_tail: str


def capped(limit: int) -> Callable[[], None]:
    """In the child before it starts: every file it (and its children) write stops at ``limit`` bytes (EFBIG, not a signal)."""

    def limit_writes() -> None:  # signal, setrlimit, setsid: no lock a thread of the grader could hold
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        if not bwrap_works():
            os.setsid()

    return limit_writes


def run(
    argv: list[str], scratch: Path, logs: Path, *, env: dict[str, str], output_limit: int, deadline: Callable[[], bool],
    hidden_dirs: Sequence[Path] = (), hidden_files: Sequence[Path] = (),
) -> Ran:  # fmt: skip
    """Run ``argv`` caged, its working folder ``scratch`` (the one place it may write), stdout and stderr to files in
    ``logs`` (outside the cage's reach); stop it when ``deadline()`` says so (polled); nothing of it is left after."""
    caged, mark = bwrap_works(), uuid.uuid4().hex
    full = [*bwrap_argv(scratch, hidden_dirs, hidden_files), *argv] if caged else argv
    env = {**env, CAGE_ENV: mark}
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        process = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=scratch, env=env,
                                   preexec_fn=capped(output_limit), close_fds=True)  # noqa: PLW1509  # fmt: skip
        overran = False
        try:
            while process.poll() is None:
                if deadline():
                    overran = True
                    break
                time.sleep(0.1)
        finally:
            end(process, caged, mark)
    with open(logs / "stderr", "rb") as f:
        f.seek(max(0, os.path.getsize(logs / "stderr") - 2000))
        tail = f.read().decode(errors="replace")
    return Ran(None if overran else process.returncode, overran, tail)


def end(process: subprocess.Popen, caged: bool, mark: str) -> None:
    """Kill ``process`` and everything it started. Caged: killing bwrap ends its pid namespace (the kernel kills every
    process in it). The fallback: its process group, then any process that still carries this run's ``mark`` in its
    environment (a child that left the group or the session; one that also cleared its environment escapes)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL) if not caged else process.kill()
    process.wait()
    if not caged:
        for pid in marked(mark):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def marked(mark: str) -> list[int]:
    """The processes whose environment holds ``CAGE_ENV=mark``."""
    wanted, found = f"{CAGE_ENV}={mark}".encode(), []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found
