"""Start and stop servers in the background, for notebooks, tests and the benchmark.

Two ways, both context managers that wait for ``GET /health`` and always stop
what they started:

- ``serve("sequential" | "slots", *flags)`` runs ``llmkit serve ...`` as a
  child process on a free loopback port (what the notebooks use: a real
  server, its own log, killed for sure on exit); ``serve("llama-server",
  *flags)`` runs the real llama-server, built from the same llama.cpp
  (``llmkit.course.upstream.server_binary``), on the same model unless ``-m`` is given;
- ``serve_app(app)`` runs an ASGI app on uvicorn in a thread of this
  process, for when you want to change the app first (add a route, say).

A server started here goes when this process ends, however it ends: a notebook kernel killed or restarted (SIGKILL
included: no ``finally`` runs) leaves no server behind. On Linux each child asks the kernel for a SIGTERM when its
parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere only the context managers stop them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, alive=lambda: True) -> None:
    """Poll ``url/health`` until it answers 200; fail early if the server died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s")


class PortInUse(RuntimeError):
    """A port asked for is already bound by another process."""


def check_free(port: int) -> None:
    """Raise ``PortInUse`` if something listens on ``port`` (a socket in TIME_WAIT does not count, as for the servers)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as exc:
            raise PortInUse(f"port {port} on {HOST} is taken ({exc.strerror}): stop what listens there, or choose another port") from None


@dataclass
class ServerProcess:
    """A server running as a child process. ``log()`` returns what it printed."""

    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)  # the flags it was given
    argv: list[str] = field(default_factory=list)  # its whole command line (``restart`` runs it again)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it hangs."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> int:
        """SIGKILL: the process dies at once, mid-request (a crash, not a shutdown)."""
        if self.running():
            self.process.kill()
        return self.process.wait()

    def wait_ready(self, timeout: float = 120) -> None:
        """Wait until ``/health`` answers 200; if it does not (or on Ctrl-C), stop the process and raise with its log."""
        try:
            wait_healthy(self.url, timeout, self.running)
        except BaseException as exc:  # noqa: BLE001 -- stop the process whatever went wrong (Ctrl-C too), then report
            self.stop()
            tail = self.log()[-3000:]
            raise RuntimeError(f"{self.kind} server failed to start: {exc}\n--- its log ({self.log_path}) ---\n{tail}") from None

    def restart(self, timeout: float = 120) -> None:
        """Run the same command line again (same port, same log, appended), once it has stopped; wait until healthy."""
        if self.running():
            raise RuntimeError(f"{self.kind} on {self.url} is still running: stop() or kill() it first")
        check_free(self.port)
        self.process = popen(self.argv, self.log_path, self.env, append=True)
        self.wait_ready(timeout)


def command(kind: str, port: int, flags: tuple[str, ...]) -> list[str]:
    """The command line of a server: ``llmkit serve KIND`` or the real llama-server (built if needed)."""
    if kind == "llama-server":
        from llmkit import models
        from llmkit.course import upstream

        given = {"-m", "--model", "--models-dir", "--models-preset"} & set(flags)  # a model, or router mode's models
        model = [] if given else ["-m", str(models.resolve_model())]
        return [str(upstream.server_binary()), *model, "--host", HOST, "--port", str(port), *flags]
    if kind == "vllm-router":  # the fleet's router (the lab extra's vllm-router), on the same interpreter
        return [sys.executable, "-m", "vllm_router.launch_router", "--host", HOST, "--port", str(port), *flags]
    return [sys.executable, "-m", "llmkit", "serve", kind, "--host", HOST, "--port", str(port), *flags]


def popen(argv: list[str], log_path: Path, env: dict[str, str], *, append: bool = False) -> subprocess.Popen:
    """Run ``argv`` in a session of its own (Ctrl-C in a terminal reaches only us), its output to ``log_path``; it is
    told to stop when this process ends (``stops_with``), from the one thread every server is started from here."""
    with open(log_path, "ab" if append else "wb") as log:
        start = functools.partial(subprocess.Popen, argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  start_new_session=True, preexec_fn=stops_with(os.getpid()))  # fmt: skip
        return spawner(os.getpid()).submit(start).result()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stops_with(parent: int) -> Callable[[], None] | None:
    """Popen's ``preexec_fn`` (run in the child before it runs the server): SIGTERM when ``parent`` dies, as a stop()
    sends it (Linux's parent-death signal); at once if it died before the child could ask. None: not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # found here: the child only calls it

    def ask() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between the fork and the prctl: nobody will tell
            os.kill(os.getpid(), signal.SIGTERM)

    return ask


@functools.cache
def spawner(pid: int) -> ThreadPoolExecutor:
    """The thread that starts every server of process ``pid``. The kernel sends the parent-death signal when the
    *thread* that started a child ends, not the process: a server started from a passing thread (``asyncio.to_thread``,
    a pool) would be stopped when that thread ends. This one lives as long as the process (to its normal exit)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmkit-launch")


def spawn(kind: str, *flags: str, port: int | None = None, env: dict | None = None, name: str | None = None) -> ServerProcess:
    """Start a server without waiting for it (``wait_ready()`` next): several can load at once."""
    if port is not None:
        check_free(port)
    port = port or free_port()
    argv = command(kind, port, flags)
    log_path = Path(tempfile.mkstemp(prefix=f"llmkit-{name or kind}-", suffix=".log")[1])
    process = popen(argv, log_path, env or {})
    return ServerProcess(kind, f"http://{HOST}:{port}", process, log_path, list(flags), argv, dict(env or {}))


def start(kind: str, *flags: str, port: int | None = None, timeout: float = 120, env: dict | None = None) -> ServerProcess:
    """Start a server (``"sequential"``, ``"slots"``, ``"llama-server"``, ``"vllm-router"``), wait until it is healthy. ``stop()`` after."""
    server = spawn(kind, *flags, port=port, env=env)
    server.wait_ready(timeout)
    return server


@contextlib.contextmanager
def serve(kind: str, *flags: str, port: int | None = None, timeout: float = 120, env: dict | None = None) -> Iterator[ServerProcess]:
    """``with serve("slots", "-np", "4") as server: ...`` — stopped on exit, whatever happens."""
    server = start(kind, *flags, port=port, timeout=timeout, env=env)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def serve_app(app, *, port: int | None = None, timeout: float = 60) -> Iterator[str]:
    """Run an ASGI app on uvicorn in a background thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://{HOST}:{port}"
    try:
        wait_healthy(url, timeout, thread.is_alive)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
