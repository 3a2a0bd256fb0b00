"""Why the fleet model's TTFT ran low (issue 39, item 4), and what a prefix-aware router's render fan-out costs (item 5):
chapter 10's trace through real fleets of 1-3 slot servers (cache_aware, as the chapter runs them), repeated, with what
each process spent meanwhile; the runs saved for ``llmkit.course.sim.check`` to model again without a fleet.

    python scripts/sim_bias.py                          # 3 repetitions of 1, 2 and 3 replicas (order rotated), ~6 min idle
    python scripts/sim_bias.py --reps 5 --out runs.json

Each run saves: the records (request by request, as the chapter's ``run``), the other programs' busy threads
(``sim.check.Background``), and per replica the engine's own counters from ``/metrics`` (seconds inside steps, inside
``llama_decode``, the batches' tokens) and the process's CPU seconds (``/proc/PID/stat``), the router's CPU seconds too:
what the replicas spent outside their steps (HTTP, SSE, tokenizing, the router's render calls) is the difference.
Then the render calls alone: ``--renders`` calls to one idle replica (its CPU seconds each, and the latency), and a
one-token request straight to a replica, through a round_robin router (no render) and a cache_aware one (a render to
every worker first), at 2 and 3 replicas: what the router and its fan-out add to a request's TTFT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmkit.course import fleet
from llmkit.course.sim.check import Background, render_cost
from llmkit.course.trace import Record, make_trace, summarize

# chapter 10's trace and answers (its first cell)
TRACE = make_trace(seed=1, tenants=3, conversations=6, turns=3, rate=1.5, think=0.5, system_words=80, shots=2, question_words=8)
MAX_TOKENS = 8
COUNTERS = ("step_seconds_total", "decode_seconds_total", "n_decode_total", "batch_prompt_tokens_total", "batch_generated_tokens_total")


def cpu_seconds(pid: int, thread: str | None = None) -> float:
    """User and system CPU seconds of a process so far (``/proc/PID/stat`` fields 14 and 15), or of one of its threads."""
    stat = Path(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_cpu(pid: int) -> dict[str, float]:
    """Each thread's CPU seconds so far: a run's busiest is a slot server's engine thread (llama.cpp computes on it at -t 1)."""
    return {task.name: cpu_seconds(pid, task.name) for task in Path(f"/proc/{pid}/task").iterdir()}


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {s.name.removeprefix("llamacpp:"): s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: found.get(name, 0.0) for name in COUNTERS}


def spent(f: fleet.Fleet) -> dict:
    """Each replica's engine counters and CPU seconds, and the router's CPU seconds, now."""
    replicas = [counters(r.url) | {"cpu": cpu_seconds(r.process.pid), "threads": threads_cpu(r.process.pid)} for r in f.replicas]
    return {"replicas": replicas, "router": cpu_seconds(f.router.process.pid)}


def difference(after: dict, before: dict) -> dict:
    replicas = [{k: a[k] - b[k] for k in a if k != "threads"} | {"engine_cpu": busiest(a["threads"], b["threads"])}
                for a, b in zip(after["replicas"], before["replicas"], strict=True)]  # fmt: skip
    return {"replicas": replicas, "router": after["router"] - before["router"]}


def busiest(after: dict[str, float], before: dict[str, float]) -> float:
    """The CPU seconds of the thread that spent the most between the two readings (the engine's)."""
    return max(seconds - before.get(tid, 0.0) for tid, seconds in after.items())


def trace_run(f: fleet.Fleet, n: int, name: str) -> dict:
    """The chapter's trace, fresh, through a cache_aware router in front of the first ``n`` replicas (as its ``run``)."""
    with f.routed("cache_aware", ("--log-level", "debug"), tuple(range(n))) as routed:
        busy = Background([r.process.pid for r in routed.replicas])
        before = spent(routed)
        busy.start()
        t0 = time.perf_counter()
        records = fleet.run_trace(routed, TRACE.fresh(name), max_tokens=MAX_TOKENS)
        wall = time.perf_counter() - t0
        busy.done.set()
        used = difference(spent(routed), before)
    return {"replicas": n, "records": [dataclasses.asdict(r) for r in records], "background": busy.mean, "wall": wall, "spent": used}


def one_token(url: str, k: int, tag: str) -> list[float]:
    """``k`` one-token chats of a short new prompt, one after another: each one's seconds to the answer."""
    seconds = []
    for i in range(k):
        body = {"model": "m", "messages": [{"role": "user", "content": f"{tag} {i}: hello?"}], "max_tokens": 1}
        t0 = time.perf_counter()
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
        seconds.append(time.perf_counter() - t0)
    return seconds


def render_price(f: fleet.Fleet, k: int) -> dict:
    """``k`` render calls to an idle replica (a prompt of the trace's size): the replica's CPU and the latency, each."""
    replica = f.replicas[-1]
    cpu, latency = render_cost(replica.url, replica.process.pid, TRACE.messages(TRACE.conversations[0], []), k)
    return {"cpu_ms": cpu * 1e3, "latency_ms": latency * 1e3}


def router_delays(f: fleet.Fleet, k: int) -> dict:
    """A one-token request's seconds (median of ``k``) straight to replica 0, and through each router at 2 and 3 replicas."""
    found = {"direct": statistics.median(one_token(f.replicas[0].url, k, "direct"))}
    for n in (2, 3):
        for policy in ("round_robin", "cache_aware"):
            with f.routed(policy, (), tuple(range(n))) as routed:
                one_token(routed.url, 2, "warm")
                found[f"{policy} {n}"] = statistics.median(one_token(routed.url, k, f"{policy} {n}"))
    return {name: seconds * 1e3 for name, seconds in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--renders", type=int, default=200)
    parser.add_argument("--out", default="sim_bias.json")
    args = parser.parse_args()
    found: dict = {"runs": []}
    with fleet.start(3, "slots", "round_robin", flags=("--kv-events", "--metrics")) as f:
        fleet.warm_up(f)
        found["render"] = render_price(f, args.renders)
        found["router_ms"] = router_delays(f, 20)
        print(json.dumps({k: found[k] for k in ("render", "router_ms")}), flush=True)
        for rep in range(args.reps):
            sizes = args.sizes[rep % len(args.sizes) :] + args.sizes[: rep % len(args.sizes)]
            for n in sizes:
                run = trace_run(f, n, f"bias {rep} {n}")
                found["runs"].append(run)
                s = summarize([Record(**r) for r in run["records"]])
                print(f"rep {rep} n {n}: background {run['background']:.1f}, {s.line()}, spent {run['spent']}", flush=True)
                Path(args.out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
