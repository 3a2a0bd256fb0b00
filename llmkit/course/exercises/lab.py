"""What the checks measure with: the model, servers and measurements, each made on first use and kept for the next check.

A learner checks an answer, changes it, checks again: the second check finds the model loaded and the servers
running (``LAB.server("slots", "-np", "2")`` returns the one started before with the same flags). Everything stops
when the kernel exits (``atexit``), or at ``LAB.close()`` (the tests, at the end of a module).

In a grading run (``classroom.grade``) the servers a check starts run in its cage, and end with it.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from llmkit.course import launch


class Lab:
    def __init__(self) -> None:
        self._servers: dict[tuple[str, ...], launch.ServerProcess] = {}
        self._memo: dict[Any, Any] = {}
        self._model: Any = None
        self._lock = threading.RLock()

    def model(self) -> Any:
        """The embedded model, loaded in this process once (``llmkit.llama.Model``)."""
        with self._lock:
            if self._model is None:
                from llmkit import models
                from llmkit.llama import Model

                self._model = Model(models.default_model_path())
            return self._model

    def server(self, kind: str, *flags: str) -> launch.ServerProcess:
        """A running server (``launch.start``'s kinds and flags), started once and kept until ``close``."""
        with self._lock:
            key = (kind, *flags)
            server = self._servers.get(key)
            if server is None or not server.running():
                server = self._servers[key] = launch.start(kind, *flags)
            return server

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per kernel for ``key``: a measurement that does not change between two checks (a count)."""
        with self._lock:
            if key not in self._memo:
                self._memo[key] = compute()
            return self._memo[key]

    def close(self) -> None:
        """Stop every server, forget the measurements, free the model."""
        with self._lock:
            for server in self._servers.values():
                server.stop()
            self._servers.clear()
            self._memo.clear()
            if self._model is not None:
                self._model.close()
                self._model = None


@contextmanager
def quiet_engine() -> Iterator[None]:
    """The engine's log muted while a check runs the learner's code in it: a failure it logs (with the kit's
    traceback) is the learner's, and the check shows it as theirs."""
    logger = logging.getLogger("llmkit.engine")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def parallel(fn: Callable[..., Any], calls: list[tuple]) -> list[Any]:
    """``fn(*args)`` for each ``args`` of ``calls``, all at once (threads), results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(len(calls), 1)) as pool:
        return list(pool.map(lambda args: fn(*args), calls))


def metric(url: str, name: str) -> float:
    """One value of a server's ``/metrics`` (``llamacpp:<name>``)."""
    import re

    import httpx

    found = re.search(rf"^llamacpp:{name} (\S+)", httpx.get(f"{url}/metrics", timeout=60).text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{url}/metrics has no llamacpp:{name}")
    return float(found.group(1))


def one_by_one(submit: Callable[[Any], Any], items: Iterable[Any], guard: Any = None) -> list[Any]:
    """Each item submitted (``submit(item)`` returns an engine ``Request``) and waited for before the next; the first
    error of the learner's code in the engine (``guard``, a ``core.Guard``) raised as theirs. The finished requests."""
    finished = []
    for item in items:
        request = submit(item)
        wait(request)
        if guard is not None:
            guard.raise_first()
        finished.append(request)
    return finished


def wait(request: Any) -> None:
    """Until ``request`` is done; a failure stays in ``request.error`` (the check reads it)."""
    with suppress(Exception):
        request.result()


def slot_of(request: Any) -> int | None:
    """The slot a finished request ended on (None: it never had one, or it failed)."""
    return request.outcome.id_slot if request.outcome is not None else None


LAB = Lab()
atexit.register(LAB.close)
