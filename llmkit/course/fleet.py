"""A fleet: N replicas of a server behind a real router, started and stopped in one line.

    with fleet.start(replicas=2, server="slots", policy="cache_aware") as f:
        f.url                    # the router: chat, completions, Responses, Anthropic Messages, whole or streamed
        f.replicas               # each replica's ServerProcess: url, log_path, kill(), ...
        f.router                 # the router's ServerProcess (its log says what it chose and why)
        f.replica_of(answer)     # which replica served an answer (each replica is named <model>@<index>)
        f.kill(1); f.restart(1)  # a replica crashes; it comes back on its port and rejoins
        with f.routed("kv_aware") as g: ...   # another router in front of the same replicas (no model loaded again)
        with f.routed("cache_aware", replicas=[0]) as one: ...   # ... or of some of them

The router is vLLM's (PyPI ``vllm-router``, a Rust binary in the ``lab`` extra; its policies are ``POLICIES``),
never one written here: llmkit's part is to be a worker it routes well (``llmkit.server.worker``). The replicas
are slot servers (``llmkit serve slots``) or the real llama-server, ``-t 1`` each: on a 2-core machine llama.cpp's
spinning threads must not fight over the cores. Every process has its own log (``Fleet.logs``); all are stopped on
exit, on an exception and on Ctrl-C. A port that is taken is named before anything starts, and a replica that fails
to start is named with its log's last lines.

The router's defaults suit a data centre; three are shortened here so a fleet on a laptop reacts within seconds
(``ROUTER_FLAGS``): the start-up poll of each replica's ``/health`` (30 s → 1 s), the health check after it
(60 s → 2 s: a replica that died is out after 3 failed checks, back after 2 good ones), and how long an open
circuit keeps a replica out (60 s → 10 s): 10 failed attempts in a row open it, and when a replica dies under load
its retries fail that fast, before any health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmkit import models
from llmkit.course import launch
from llmkit.course.launch import ServerProcess
from llmkit.course.trace import Record, Trace, areplay

POLICIES = ("random", "round_robin", "power_of_two", "consistent_hash", "cache_aware", "kv_aware", "sticky_least_loaded")
SERVERS = ("slots", "llama-server")
REPLICA_FLAGS = ("-t", "1")
ROUTER_FLAGS = ("--worker-startup-check-interval", "1", "--health-check-interval-secs", "2", "--cb-timeout-duration-secs", "10")


class FleetError(RuntimeError):
    """A fleet could not start: which process, and why (its log's last lines)."""


@dataclass
class Fleet:
    """Running replicas and their router (``start`` makes one)."""

    server: str
    policy: str
    router: ServerProcess
    replicas: list[ServerProcess] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the model name each replica answers with

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def logs(self) -> dict[str, Path]:
        return {"router": self.router.log_path} | {f"replica {i}": r.log_path for i, r in enumerate(self.replicas)}

    def replica_of(self, answer: dict[str, Any] | str) -> int | None:
        """The index of the replica that served ``answer`` (a response or stream chunk, or its ``model``), if it is one of ours."""
        name = answer.get("model") if isinstance(answer, dict) else answer
        return self.names.index(name) if name in self.names else None

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index``: a crash, mid-request (its port is free at once)."""
        self.replicas[index].kill()

    def restart(self, index: int, timeout: float = 120) -> None:
        """Start replica ``index`` again on its port, then wait until the router reports every replica healthy."""
        self.replicas[index].restart(timeout)
        launch.wait_healthy(self.url, timeout)

    def rolling_restart(self, timeout: float = 120) -> list[float]:
        """Each replica in turn: SIGTERM (the slot server drains: it takes no new connection, so the router retries
        elsewhere, and its running requests finish), started again on its port, and back in the router's rotation
        before the next one goes: what a deployment does to update a fleet without failing a request. Returns when
        each was told to stop (``time.perf_counter()``)."""
        stopped = []
        for i, replica in enumerate(self.replicas):
            stopped.append(time.perf_counter())
            replica.stop(timeout)
            self.restart(i, timeout)
            self.wait_routed(i, timeout)
        return stopped

    def wait_routed(self, index: int, timeout: float = 60) -> None:
        """Wait until the router counts replica ``index`` healthy again (its health checks passed)."""
        url, deadline = self.replicas[index].url, time.monotonic() + timeout
        while not self.router_says_healthy(url):
            if time.monotonic() > deadline:
                raise FleetError(f"the router did not take replica {index} ({url}) back within {timeout:.0f} s")
            time.sleep(0.2)

    def router_metrics(self, prefix: str | tuple[str, ...] = "vllm_router_") -> dict[str, float]:
        """The router's own Prometheus metrics whose names start with ``prefix`` (read with prometheus_client's parser):
        ``'name{label="value",...}'`` -> value."""
        port = self.router.argv[self.router.argv.index("--prometheus-port") + 1]
        text = httpx.get(f"http://{launch.HOST}:{port}/metrics", timeout=10).text
        samples = (s for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith(prefix))
        return {s.name + "{" + ",".join(f'{k}="{v}"' for k, v in s.labels.items()) + "}": s.value for s in samples}

    def router_says_healthy(self, url: str) -> bool:
        """Whether the router's ``/workers/{url}`` reports that worker healthy."""
        answer = httpx.get(f"{self.url}/workers/{quote(url, safe='')}", timeout=10)
        return answer.status_code == 200 and answer.json().get("is_healthy") is True

    @contextlib.contextmanager
    def routed(
        self, policy: str, router_flags: Sequence[str] = (), replicas: Sequence[int] | None = None, timeout: float = 60
    ) -> Iterator[Fleet]:
        """Another router, with ``policy`` (and ``router_flags``), in front of the same replicas (or of the ``replicas``
        given, by index) for the block: policies and fleet sizes compared without loading a model again (their caches
        stay warm: ``Trace.fresh``). The fleet it yields has those replicas only, numbered from 0."""
        chosen = range(len(self.replicas)) if replicas is None else replicas
        members, names = [self.replicas[i] for i in chosen], [self.names[i] for i in chosen]
        router = start_router(policy, [r.url for r in members], router_flags, None, timeout)
        try:
            yield dataclasses.replace(self, policy=policy, router=router, replicas=members, names=names)
        finally:
            router.stop()

    def stop(self) -> None:
        """The router first (no new requests), then every replica at once: SIGTERM, SIGKILL after 15 s."""
        self.router.stop()
        stop_all(self.replicas)


def stop_all(processes: Sequence[ServerProcess], timeout: float = 15) -> None:
    """SIGTERM to all, then wait for each (SIGKILL if it hangs): the processes shut down side by side."""
    for p in processes:
        if p.running():
            p.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            p.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def replica_names(server: str, n: int, flags: Sequence[str]) -> list[str]:
    """``<model file>@<index>``: what each replica calls its model (``--alias``), so that an answer says where it came from."""
    given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f in ("-m", "--model")]
    model = Path(given[-1]).name if given else models.resolve_model().name
    return [f"{model}@{i}" for i in range(n)]


def start_replicas(server: str, n: int, flags: Sequence[str], names: list[str], timeout: float, pd: bool = False) -> list[ServerProcess]:
    """All replicas loading at once, then each waited for; if one fails, all are stopped and it is named. ``pd``: each
    decode worker is told its prefill workers (``--pd-peers``), the only servers it fetches KV cells from."""
    ports = [launch.free_port() for _ in range(n)]
    prefill = [f"http://{launch.HOST}:{port}" for port in ports[: prefill_count(n)]] if pd else []
    replicas: list[ServerProcess] = []
    try:
        for i in range(n):
            peers = ("--pd-peers", *prefill) if pd and i >= len(prefill) else ()
            replicas.append(launch.spawn(server, *REPLICA_FLAGS, *flags, *peers, "--alias", names[i], port=ports[i], name=f"replica{i}"))
        for i, replica in enumerate(replicas):
            try:
                replica.wait_ready(timeout)
            except RuntimeError as exc:
                raise FleetError(f"replica {i} of {n} ({server} on port {replica.port}) failed to start: {exc}") from None
    except BaseException:
        stop_all(replicas)
        raise
    return replicas


def prefill_count(n: int) -> int:
    """How many of ``n`` replicas read prompts in PD mode: the first half (at least one)."""
    return max(1, n // 2)


def router_workers(urls: Sequence[str], pd: bool = False) -> tuple[str, ...]:
    """The router's worker flags: every replica alike; or, disaggregated (``pd``), the first half reading prompts and the
    rest generating (vllm-router's PD mode: ``llmkit.server.handoff``)."""
    if not pd:
        return ("--worker-urls", *urls)
    half = prefill_count(len(urls))
    prefill, decode = [f for u in urls[:half] for f in ("--prefill", u)], [f for u in urls[half:] for f in ("--decode", u)]
    return ("--vllm-pd-disaggregation", *prefill, *decode)


def start_router(
    policy: str, urls: list[str], router_flags: Sequence[str], port: int | None, timeout: float, pd: bool = False
) -> ServerProcess:
    flags = (*router_workers(urls, pd), "--policy", policy, "--prometheus-port", str(launch.free_port()), *ROUTER_FLAGS, *router_flags)
    router = launch.spawn("vllm-router", *flags, port=port, name="router")
    try:
        router.wait_ready(timeout)
    except RuntimeError as exc:
        raise FleetError(f"the router (vllm-router, policy {policy}, on port {router.port}) failed to start: {exc}") from None
    return router


@contextlib.contextmanager
def start(
    replicas: int = 2,
    server: str = "slots",
    policy: str = "cache_aware",
    *,
    flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
    port: int | None = None,
    timeout: float = 180,
    pd: bool = False,
) -> Iterator[Fleet]:
    """``with start(2, "slots", "cache_aware") as fleet:`` — replicas (each ``-t 1``, plus ``flags``) and the router
    (``policy``, on ``port`` if given, plus ``router_flags``), all healthy before it returns, all stopped after.
    ``pd=True``: disaggregated prefill and decode, the first half of the replicas reading prompts, the rest generating."""
    if server not in SERVERS or policy not in POLICIES:
        raise ValueError(f"server must be one of {SERVERS} and policy one of {POLICIES} (got {server!r}, {policy!r})")
    if pd and server != "slots":
        raise ValueError("pd=True needs the slot server: llama-server has no KV hand-off")
    if importlib.util.find_spec("vllm_router") is None:
        raise FleetError("the router is not installed: pip install 'llmkit[lab]' (vllm-router has a wheel for Linux x86-64 only)")
    if port is not None:
        launch.check_free(port)  # before the replicas load: a taken port is named at once
    names = replica_names(server, replicas, flags)
    running = start_replicas(server, replicas, flags, names, timeout, pd)
    try:
        router = start_router(policy, [r.url for r in running], router_flags, port, timeout, pd)
        fleet = Fleet(server, policy, router, running, names)
    except BaseException:
        stop_all(running)
        raise
    try:
        yield fleet
    finally:
        fleet.stop()


def warm_up(fleet: Fleet) -> None:
    """One tiny chat to each replica directly (not through the router): the first request of a process is slow."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for replica in fleet.replicas:
        httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def run_trace(fleet: Fleet, trace: Trace, **params: Any) -> list[Record]:
    """Replay ``trace`` through the fleet's router; each record's ``replica`` is the replica's index ("0", "1", ...)."""
    return asyncio.run(arun_trace(fleet, trace, **params))


def run_dealt(routers: Sequence[Fleet], trace: Trace, **params: Any) -> list[Record]:
    """``arun_dealt`` outside an event loop."""
    return asyncio.run(arun_dealt(routers, trace, **params))


async def arun_trace(fleet: Fleet, trace: Trace, **params: Any) -> list[Record]:
    """``run_trace`` in a running event loop (a notebook's: ``records = await fleet.arun_trace(f, trace)``)."""
    return await arun_dealt([fleet], trace, **params)


async def arun_dealt(routers: Sequence[Fleet], trace: Trace, **params: Any) -> list[Record]:
    """The trace's conversations dealt to ``routers`` in turn (conversation i to router i mod n), replayed at once: two
    router instances in front of one fleet, as a front end runs them for redundancy, each knowing only the requests it
    routed. The routers must front the same replicas; records as ``arun_trace``'s, ordered by when they were sent."""
    await asyncio.to_thread(warm_up, routers[0])
    n = len(routers)
    parts = [dataclasses.replace(trace, conversations=trace.conversations[k::n]) for k in range(n)]
    replays = await asyncio.gather(*(areplay(part, f.url, **params) for f, part in zip(routers, parts, strict=True)))
    records = sorted((r for replayed in replays for r in replayed), key=lambda r: r.sent)
    for record in records:
        index = routers[0].replica_of(record.replica) if record.replica is not None else None
        record.replica = None if index is None else str(index)
    return records


def rotated(arms: Sequence[Any], round_: int) -> list[Any]:
    """``arms`` in the order of round ``round_``: started one further on each round, so that no arm always runs first (on
    a cold machine) or right after the same neighbour."""
    k = round_ % len(arms) if arms else 0
    return [*arms[k:], *arms[:k]]


@dataclass(frozen=True)
class Repeated:
    """One metric over repeated runs: the median and the range (min-max), printed as ``median (min-max)``."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> float:
        """The range: max - min."""
        return max(self.values) - min(self.values)

    def above(self, other: Repeated, spread: float) -> bool:
        """Whether every run of this lies above every run of ``other`` and the medians differ by more than ``spread``
        (an A/A pair's: what the same policy twice moves on this machine)."""
        return min(self.values) > max(other.values) and self.median - other.median > spread

    def format(self, spec: str = ".1f") -> str:
        return f"{self.median:{spec}} ({min(self.values):{spec}}-{max(self.values):{spec}})"


def compare(
    server: str,
    policies: Sequence[str],
    trace: Trace,
    replicas: int = 2,
    flags: Sequence[str] = (),
    router_flags: Sequence[str] = (),
    **params: Any,
) -> dict[str, list[Record]]:
    """The same trace through a fresh fleet per policy (cold caches each time): policy -> the replay's records."""
    results = {}
    for policy in policies:
        with start(replicas, server, policy, flags=flags, router_flags=router_flags) as fleet:
            results[policy] = run_trace(fleet, trace, **params)
    return results


# --- a replica fails under load -------------------------------------------------------------------------------------


@dataclass
class DrillRequest:
    """One request of ``drill``: when it was sent, how long it took, who answered, what went wrong."""

    client: int
    sent: float  # seconds after the drill began
    seconds: float
    replica: int | None
    pieces: int
    error: str | None  # None, "HTTP 5xx: ...", or the client's exception (a stream broken off)


async def steady_load(f: Fleet, clients: int, during: Callable[[], Any]) -> tuple[list[dict], Any]:
    """``clients`` clients, each sending streamed chats one after another through the router while ``during`` runs
    (in a thread: a rolling restart, say); every request's replica, status, finish reason, error and times (``t0``,
    ``t1``: perf_counter), and what ``during`` returned."""
    done, records = asyncio.Event(), []

    async def client(c: int, http: httpx.AsyncClient) -> None:
        k = 0
        while not done.is_set():
            body = {"model": "any", "messages": [{"role": "user", "content": f"Count from {c * 100 + k}."}],
                    "max_tokens": 24, "ignore_eos": True, "stream": True}  # fmt: skip
            out: dict = {"replica": None, "status": None, "finish": None, "error": None, "t0": time.perf_counter()}
            try:
                async with http.stream("POST", f"{f.url}/v1/chat/completions", json=body) as r:
                    out["status"] = r.status_code
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and (chunk := json.loads(line[6:]))["choices"]:
                            out["replica"] = f.replica_of(chunk)
                            out["finish"] = chunk["choices"][0].get("finish_reason") or out["finish"]
            except httpx.HTTPError as exc:
                out["error"] = type(exc).__name__
            records.append(out | {"t1": time.perf_counter()})
            k += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)) as http:
        tasks = [asyncio.create_task(client(c, http)) for c in range(clients)]
        try:
            result = await asyncio.to_thread(during)
        finally:
            done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)  # none hangs
    return records, result


async def drill(fleet: Fleet, victim: int = 1, clients: int = 6, seconds: float = 40, kill_at: float = 10, restart_at: float = 25) -> dict:
    """``clients`` users sending short streamed chats back to back for ``seconds`` (bounded load, loopback only);
    replica ``victim`` is killed at ``kill_at`` and restarted on its port at ``restart_at``. Returns every
    ``DrillRequest`` and the times of the kill, of the restart and of the router's /health back to 200."""
    t0, events = time.perf_counter(), {}

    async def chaos() -> None:
        await asyncio.sleep(kill_at)
        fleet.kill(victim)
        events["killed"] = time.perf_counter() - t0
        await asyncio.sleep(max(0.0, restart_at - (time.perf_counter() - t0)))
        events["restarted"] = time.perf_counter() - t0
        await asyncio.to_thread(fleet.restart, victim)
        events["rejoined"] = time.perf_counter() - t0

    async def user(c: int, client: httpx.AsyncClient) -> list[DrillRequest]:
        outcomes, k = [], 0
        while time.perf_counter() - t0 < seconds:
            body = {"model": "any", "messages": [{"role": "user", "content": f"User {c}, question {k}: name a number."}], "max_tokens": 24}
            sent = time.perf_counter() - t0
            result = await ask_streamed(client, fleet, body)
            outcomes.append(DrillRequest(c, sent, time.perf_counter() - t0 - sent, *result))
            k += 1
        return outcomes

    async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5)) as client:
        users = asyncio.gather(*(user(c, client) for c in range(clients)))
        _, runs = await asyncio.gather(chaos(), users)
    return {"outcomes": [o for outcomes in runs for o in outcomes], **events}


async def ask_streamed(client: httpx.AsyncClient, fleet: Fleet, body: dict) -> tuple[int | None, int, str | None]:
    """Stream one chat through the router: (replica, pieces, error)."""
    replica, pieces = None, 0
    try:
        async with client.stream("POST", f"{fleet.url}/v1/chat/completions", json=body | {"stream": True}) as r:
            if r.status_code != 200:
                return None, 0, f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    replica = fleet.replica_of(chunk) if replica is None else replica
                    pieces += 1
    except httpx.HTTPError as exc:
        return replica, pieces, f"{type(exc).__name__}: {exc}"
    return replica, pieces, None
