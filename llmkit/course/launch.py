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
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
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


@dataclass
class ServerProcess:
    """A server running as a child process. ``log()`` returns what it printed."""

    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

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


def command(kind: str, port: int, flags: tuple[str, ...]) -> list[str]:
    """The command line of a server: ``llmkit serve KIND`` or the real llama-server (built if needed)."""
    if kind == "llama-server":
        from llmkit import models
        from llmkit.course import upstream

        model = [] if {"-m", "--model"} & set(flags) else ["-m", str(models.resolve_model())]
        return [str(upstream.server_binary()), *model, "--host", HOST, "--port", str(port), *flags]
    return [sys.executable, "-m", "llmkit", "serve", kind, "--host", HOST, "--port", str(port), *flags]


def start(kind: str, *flags: str, port: int | None = None, timeout: float = 120, env: dict | None = None) -> ServerProcess:
    """Start a server (``"sequential"``, ``"slots"`` or ``"llama-server"``), wait until it is healthy. ``stop()`` after."""
    port = port or free_port()
    args = command(kind, port, flags)
    log_path = Path(tempfile.mkstemp(prefix=f"llmkit-{kind}-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)
    server = ServerProcess(kind, f"http://{HOST}:{port}", process, log_path, list(flags))
    try:
        wait_healthy(server.url, timeout, server.running)
    except BaseException as exc:  # noqa: BLE001 -- stop the process whatever went wrong (Ctrl-C too), then report
        server.stop()
        raise RuntimeError(f"{kind} server failed to start: {exc}\n--- its log ---\n{server.log()[-3000:]}") from None
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
