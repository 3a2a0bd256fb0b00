"""Run the notebook suite beside a CPU hog and report the wall time: every notebook must hold on a busy machine too.

    python scripts/test_busy.py                                    # notebooks/en and notebooks/ja, both editions (make test-editions)
    python scripts/test_busy.py notebooks/en/00_start_here.ipynb   # one notebook
    python scripts/test_busy.py --cores 2 -x                       # two busy cores; anything else goes to pytest
    make test-busy [PYTEST_ARGS=...]

While pytest runs the notebooks under nbval (``--nbval-lax``), a child process spins on a core (``while True``).
It is killed at the end whatever happens (a failure, Ctrl-C, SIGTERM), and it stops by itself if this script dies
without cleaning up (it spins only while its parent lives). Stopped early, the script also stops pytest and everything
below it (kernels, the notebooks' servers). The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

NOTEBOOKS = ["notebooks/en", "notebooks/ja"]


def busy_core() -> subprocess.Popen:
    """A child that keeps one core at 100 % for as long as this process lives."""
    spin = f"import os\nwhile os.getppid() == {os.getpid()}:\n    pass"
    return subprocess.Popen([sys.executable, "-c", spin])


def pytest_command(args: list[str]) -> list[str]:
    """pytest on the notebooks under nbval; ``args`` naming no existing path run the whole suite (en and ja)."""
    paths = [] if any(Path(a.split("::")[0]).exists() for a in args if not a.startswith("-")) else NOTEBOOKS
    return [sys.executable, "-m", "pytest", *paths, *args, "--nbval-lax", "-p", "no:cacheprovider"]


def run_to_the_end(command: list[str]) -> int:
    """Run pytest; if this script is stopped (Ctrl-C, SIGTERM), stop pytest and everything below it."""
    pytest = subprocess.Popen(command)
    try:
        return pytest.wait()
    except BaseException:
        stop_tree(pytest)
        raise


def stop_tree(process: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM a process and all below it, SIGKILL what is left after ``grace`` seconds. The tree, not the process
    group: the notebooks' servers run in sessions of their own (launch.start), and a kernel killed mid-cell never
    reaches its ``with launch.serve(...)`` exit, so they would outlive the run."""
    pids = [process.pid, *descendants(process.pid)]
    signal_all(pids, signal.SIGTERM)  # uvicorn and llama-server shut down on it
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    time.sleep(1)  # the servers' own shutdown
    signal_all(pids, signal.SIGKILL)
    process.wait()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux; elsewhere none)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(name)": state, ppid
    found, level = [], [pid]
    while level:
        level = [child for child, ppid in parent.items() if ppid in level]
        found += level
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cores", type=int, default=1, help="how many cores to keep busy (default: 1)")
    options, args = parser.parse_known_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run the finally below on kill too
    command = pytest_command(args)
    hogs = [busy_core() for _ in range(options.cores)]
    start = time.monotonic()
    try:
        return run_to_the_end(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        minutes, seconds = divmod(time.monotonic() - start, 60)
        print(f"\nwall time beside {options.cores} busy core(s): {int(minutes)} min {seconds:.1f} s  ({' '.join(command[3:])})")


if __name__ == "__main__":
    sys.exit(main())
