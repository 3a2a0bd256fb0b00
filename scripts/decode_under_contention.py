"""How fast a slot server decodes beside a busy core, by thread count: which ``-t`` the notebooks' servers should use.

    python scripts/decode_under_contention.py                  # -t 1 and -t 2, 64 tokens, 3 runs each
    python scripts/decode_under_contention.py --threads 1 2 4 --tokens 128

For each thread count, one ``llmkit serve slots -t N`` (llmkit.course.launch) streams ``--tokens`` tokens
(``ignore_eos``) from /completion, first on its own, then beside a child spinning on one core. Decode speed is
measured at the client, from the first streamed token to the last, and read from the answer's ``timings``
(``predicted_per_second``: the server's own count, first token included); the median of ``--runs`` runs is shown.
A few seconds per row: the rest of the machine is not quiet, so the load average is shown beside each row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from llmkit.course import launch

PROMPT = "Once upon a time, in a small village by the sea,"


@contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """A child spinning on one core inside the block (none if not ``busy``); killed on exit, whatever happens."""
    if not busy:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nwhile os.getppid() == {os.getpid()}:\n    pass"])
    try:
        time.sleep(0.5)  # let the scheduler see it
        yield
    finally:
        hog.kill()
        hog.wait()


def decode(url: str, tokens: int) -> tuple[float, float]:
    """One streamed completion: (tokens/s at the client, first to last token; the server's predicted_per_second)."""
    body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals, timings = [], {}
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("content"):
                arrivals.append(time.perf_counter())
            timings = chunk.get("timings", timings)
    client = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else float("nan")
    return client, timings.get("predicted_per_second", float("nan"))


def measure(threads: int, tokens: int, runs: int) -> list[tuple[bool, float, float, float]]:
    """(busy, load average, client tokens/s, server tokens/s) for one server of ``threads`` threads, quiet then busy."""
    rows = []
    with launch.serve("slots", "-np", "1", "-c", "1024", "-t", str(threads)) as server:
        decode(server.url, 8)  # warm-up: the first decode allocates the compute buffers
        for busy in (False, True):
            with busy_core(busy):
                results = [decode(server.url, tokens) for _ in range(runs)]
                load = os.getloadavg()[0]
            rows.append((busy, load, statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the -t values to try (default: 1 2)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion (default: 64)")
    parser.add_argument("--runs", type=int, default=3, help="completions per row, the median shown (default: 3)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.tokens} tokens per completion, median of {args.runs}\n")
    print("| -t | busy loop | load avg (1 min) | tokens/s (client) | tokens/s (server timings) |")
    print("|---:|:----------|-----------------:|------------------:|--------------------------:|")
    for threads in args.threads:
        for busy, load, client, server in measure(threads, args.tokens, args.runs):
            print(f"| {threads} | {'on' if busy else 'off'} | {load:.2f} | {client:.1f} | {server:.1f} |", flush=True)


if __name__ == "__main__":
    main()
