"""Disaggregated prefill and decode (vllm-router's PD mode over two slot servers at -t 1) beside one co-located slot
server at -t 2, the same two cores: what moves between the workers, and what a running stream feels while long
prompts arrive (issue 29, item 4).

    python scripts/pd_measure.py                          # 3 rounds, 3 long prompts of ~1,500 tokens a round
    python scripts/pd_measure.py --rounds 5 --words 2000 --n-long 4
    python scripts/pd_measure.py --colocated-threads 2 1         # the co-located server at -t 2, and at -t 1

1. The transfer, on the PD pair: a long prompt prefilled on P with ``kv_transfer_params`` (as the router sends it),
   then ``GET /kv_handoff/{id}`` timed from here: bytes per prompt token, ms, MB/s (loopback: one machine).
2. The gaps: a stream runs (at most ``--tokens`` tokens); after its 10th token, ``--n-long`` long prompts (distinct, each
   ``max_tokens`` 4) arrive ``--spacing`` s apart. The stream's inter-token gaps from the first long prompt's
   arrival to the last one's first token (p50, p99, max), and the long prompts' TTFT, for each setup:
   ``co-located`` (one server, ``-t 2``) and ``pd`` (the router in front of P and D, ``-t 1`` each).
Rounds alternate the setups (A B A B ...), so the machine's noise hits both alike; medians over rounds are shown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import Iterator

import httpx

from llmkit.course import fleet, launch
from llmkit.course.client import astream, chat_piece
from llmkit.course.trace import WORDS

SERVER_FLAGS = ("--temp", "0", "-np", "2", "--cache-ram", "0")


def long_prompt(seed: int, n_words: int) -> list[dict]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return [{"role": "user", "content": f"Notes {seed}: {text}. Summarize the notes in one sentence."}]


@contextlib.contextmanager
def colocated(threads: int) -> Iterator[str]:
    server = launch.start("slots", "-t", str(threads), *SERVER_FLAGS)
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def disaggregated() -> Iterator[tuple[str, str]]:
    """The router's URL and the prefill worker's."""
    with fleet.start(2, "slots", "round_robin", flags=SERVER_FLAGS, pd=True) as f:
        yield f.url, f.replicas[0].url


def transfer(prefill_url: str, n_words: int, seed: int) -> dict:
    """One hand-off by hand: the prefill request as the router sends it, then the fetch, timed."""
    body = {"model": "m", "messages": long_prompt(seed, n_words), "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    answer = httpx.post(f"{prefill_url}/v1/chat/completions", json=body, timeout=600).json()
    params = answer["kv_transfer_params"]
    t0 = time.perf_counter()
    cells = httpx.get(f"{prefill_url}/kv_handoff/{params['remote_block_ids'][0]}", timeout=600).content
    ms = (time.perf_counter() - t0) * 1e3
    n = answer["usage"]["prompt_tokens"]
    return {"tokens": n, "bytes": len(cells), "bytes_per_token": len(cells) / n, "ms": ms, "mb_per_s": len(cells) / ms / 1e3}


async def under_long_prompts(url: str, args: argparse.Namespace, seed: int) -> dict:
    """The stream's gaps while the long prompts arrive, and their TTFTs. The stream runs until the last long prompt has
    its first token (it is cut then), so its gaps cover the whole window however fast it decodes."""
    stream_body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                   "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    started, arrivals = asyncio.Event(), []

    def on_piece(piece: str) -> None:
        arrivals.append(time.perf_counter())
        if len(arrivals) >= 10:
            started.set()

    async with httpx.AsyncClient(timeout=900) as client:
        running = asyncio.create_task(astream(client, f"{url}/v1/chat/completions", stream_body, chat_piece, on_piece=on_piece))
        long_results = []
        await started.wait()
        t_first_long = time.perf_counter()
        for i in range(args.n_long):
            body = {"model": "m", "messages": long_prompt(seed * 100 + i, args.words), "max_tokens": 4, "temperature": 0, "stream": True}
            long_results.append(asyncio.create_task(astream(client, f"{url}/v1/chat/completions", body, chat_piece)))
            await asyncio.sleep(args.spacing)
        longs = await asyncio.gather(*long_results)
        running.cancel()  # the stream was there to be measured meanwhile: the client leaves, the server frees its slot
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert all(r.status == 200 and r.error is None for r in longs), [(r.status, r.error) for r in longs]
    t_end = max(r.t_sent + r.ttft for r in longs)
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals) if b >= t_first_long and a <= t_end]
    return {"gap_p50": statistics.median(gaps), "gap_p99": quantile(gaps, 0.99), "gap_max": max(gaps),
            "ttft": statistics.median(r.ttft for r in longs) * 1e3, "n_gaps": len(gaps)}  # fmt: skip


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=1500, help="words of each long prompt (about one token each)")
    parser.add_argument("--n-long", type=int, default=3)
    parser.add_argument("--spacing", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=2000, help="the running stream's longest length (cut once the long prompts answer)")
    parser.add_argument("--colocated-threads", type=int, nargs="+", default=[2], help="-t of the co-located server (several: a row each)")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {f"co-located -t {t}": [] for t in args.colocated_threads} | {"pd (-t 1 + -t 1)": []}
    transfers = []
    for r in range(args.rounds):
        for threads in args.colocated_threads:
            with colocated(threads) as url:
                rows[f"co-located -t {threads}"].append(asyncio.run(under_long_prompts(url, args, seed=r + 1)))
        with disaggregated() as (url, prefill_url):
            rows["pd (-t 1 + -t 1)"].append(asyncio.run(under_long_prompts(url, args, seed=r + 1)))
            transfers.append(transfer(prefill_url, args.words, seed=1000 + r))
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]}" for k, v in rows.items()), flush=True)
    print(f"\ntransfer (loopback), median of {len(transfers)}: " + ", ".join(
        f"{k} {statistics.median(t[k] for t in transfers):,.1f}" for k in ("tokens", "bytes_per_token", "ms", "mb_per_s")))  # fmt: skip
    for name, results in rows.items():
        cells = ", ".join(f"{k} {statistics.median(x[k] for x in results):,.0f}" for k in ("gap_p50", "gap_p99", "gap_max", "ttft"))
        print(f"{name:<17} (ms, median of {len(results)} rounds): {cells}")


if __name__ == "__main__":
    main()
