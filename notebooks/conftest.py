"""nbval runs each notebook as a test; this checks that none leaves a server running.

``llmkit.course.launch`` starts servers in their own session, so a server that a
notebook forgets to stop outlives the notebook's kernel: we look for
``llmkit serve`` and ``llama-server`` processes started by this run's
kernels (children of a child of this pytest process) that are still there
when the notebook ends.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

_before: dict[str, set[int]] = {}


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def llmkit_servers() -> set[int]:
    """``llmkit serve`` and ``llama-server`` processes whose grandparent is this pytest (kernel -> server)."""
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_server = (b"llmkit" in argv and b"serve" in argv) or argv[0].endswith(b"/llama-server")
        if is_server and parent(parent(int(proc.name))) == os.getpid():
            pids.add(int(proc.name))
    return pids


def pytest_runtest_setup(item):
    _before.setdefault(item.parent.nodeid, llmkit_servers())


def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and nextitem.parent is item.parent:
        return  # the notebook is not over yet
    left = llmkit_servers() - _before.pop(item.parent.nodeid, set())
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{item.parent.name} left {len(left)} server process(es) running: {sorted(left)}"
