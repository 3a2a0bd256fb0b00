"""Servers started in the background (``llmkit.course.launch``) go when the process that started them dies, however it
dies: a notebook kernel killed (SIGKILL: no ``finally``, no ``atexit``) leaves no server running. One real slot server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]

# A "kernel": starts a server from a thread that then ends (as asyncio.to_thread or a pool would), says its pid and
# URL, and waits to be killed.
KERNEL = """
import threading, time
from llmkit.course import launch

started = []
starter = threading.Thread(target=lambda: started.append(launch.start("slots", "-np", "1", "-c", "512", "-t", "1")))
starter.start()
starter.join()
print(started[0].process.pid, started[0].url, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie whose new parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_server_goes_when_the_process_that_started_it_is_killed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True, env=env)
    pid = 0
    try:
        pid_text, url = kernel.stdout.readline().split()
        pid = int(pid_text)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the thread that started it has ended: it runs on
        kernel.kill()  # SIGKILL, as a kernel that is killed or restarted
        kernel.wait(30)
        wait_until(lambda: gone(pid), timeout=60, interval=0.1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        kernel.kill()
        if pid and not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the server this test started, left behind by a failure
        kernel.wait(30)
