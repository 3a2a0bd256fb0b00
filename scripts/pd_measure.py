"""Disaggregated prefill and decode (vllm-router's PD mode over two slot servers at -t 1) against co-located serving on
the same two cores: one slot server at -t 2, the same with a small step budget (``--step-tokens``: llmkit's stall-free
batching, the "chunked prefill with a proper chunk size" vLLM's disagg_prefill doc names as the other cure), and two
co-located replicas at -t 1 behind round_robin. What moves between the workers, what a running stream feels while long
prompts arrive, and what each setup serves (issue 29, item 4; issue 39, item 3).

    python scripts/pd_measure.py                          # 3 rounds, 3 long prompts of ~1,500 tokens a round, 4 setups
    python scripts/pd_measure.py --rounds 5 --words 2000 --n-long 4
    python scripts/pd_measure.py --setups pd "co-located -t 1"      # the half-hardware baseline of the chapter's first draft

1. The transfer, on the PD pair: a long prompt prefilled on P with ``kv_transfer_params`` (as the router sends it),
   then ``GET /kv_handoff/{id}`` timed from here: bytes per prompt token, ms, MB/s (loopback: one machine).
2. The gaps: a stream runs (at most ``--tokens`` tokens); after its 10th token, ``--n-long`` long prompts (distinct, each
   ``max_tokens`` 4) arrive ``--spacing`` s apart. The stream's inter-token gaps from the first long prompt's
   arrival to the last one's first token (p50, p99, max), its tokens/s over that window, and the long prompts' TTFT.
3. The throughput: ``--n-load`` requests of ``--load-words`` words and ``--load-tokens`` tokens each, sent at once:
   tokens generated a second from the first send to the last answer (vLLM's doc: PD "DOES NOT improve throughput").
Rounds rotate the setups' order (A B C D, B C D A, ...), so the machine's noise hits them alike; each cell is the
median over rounds with its range [min-max]: a difference inside the ranges is not one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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
def colocated(threads: int, *flags: str) -> Iterator[str]:
    with launch.serve("slots", "-t", str(threads), *SERVER_FLAGS, *flags) as server:
        yield server.url


@contextlib.contextmanager
def disaggregated() -> Iterator[tuple[str, str]]:
    """The router's URL and the prefill worker's."""
    with fleet.start(2, "slots", "round_robin", flags=SERVER_FLAGS, pd=True) as f:
        yield f.url, f.replicas[0].url


@contextlib.contextmanager
def replicated(n: int = 2) -> Iterator[str]:
    """``n`` co-located replicas at -t 1 behind round_robin: the PD pair's processes and cores, each doing both jobs."""
    with fleet.start(n, "slots", "round_robin", flags=SERVER_FLAGS) as f:
        yield f.url


@contextlib.contextmanager
def pd_router() -> Iterator[str]:
    with disaggregated() as (url, _):
        yield url


METRICS = ("gap_p50", "gap_p99", "gap_max", "ttft", "stream_tok_s", "tok_s")
SMALL_BUDGET = ("--step-tokens", "32")  # a quarter of the default 128: a step's prompt chunk costs ~0.15 s at -t 1, not ~0.6
SETUPS: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {  # two cores' worth of each
    "pd (-t 1 + -t 1)": pd_router,
    "co-located -t 2": lambda: colocated(2),
    "co-located -t 2, step 32": lambda: colocated(2, *SMALL_BUDGET),
    "2 replicas -t 1, round_robin": replicated,
    "co-located -t 1": lambda: colocated(1),  # half the hardware: not in the default rounds
}
EQUAL_HARDWARE = tuple(name for name in SETUPS if name != "co-located -t 1")


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
            "ttft": statistics.median(r.ttft for r in longs) * 1e3, "n_gaps": len(gaps),
            "stream_tok_s": len(gaps) / (t_end - t_first_long)}  # fmt: skip


async def throughput(url: str, n: int, words: int, tokens: int, seed: int) -> float:
    """``n`` requests of a ``words``-word prompt and ``tokens`` tokens each, sent at once: tokens generated a second."""
    async with httpx.AsyncClient(timeout=900) as client:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json={
            "model": "m", "messages": long_prompt(seed * 100 + i, words), "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0}) for i in range(n)))  # fmt: skip
        seconds = time.perf_counter() - t0
    return sum(a.raise_for_status().json()["usage"]["completion_tokens"] for a in answers) / seconds


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spread(values: list[float], digits: int = 0) -> str:
    """The median and the range over rounds: ``1,234 [1,100-1,300]``."""
    return f"{statistics.median(values):,.{digits}f} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]"


def measure(name: str, args: argparse.Namespace, seed: int, transfers: list[dict]) -> dict:
    """One round of one setup: the gaps under long prompts, then the throughput (and the transfer, on the PD pair)."""
    if name == "pd (-t 1 + -t 1)":
        with disaggregated() as (url, prefill_url):
            transfers.append(transfer(prefill_url, args.words, seed=1000 + seed))
            return run_both(url, args, seed)
    with SETUPS[name]() as url:
        return run_both(url, args, seed)


def run_both(url: str, args: argparse.Namespace, seed: int) -> dict:
    gaps = asyncio.run(under_long_prompts(url, args, seed))
    return gaps | {"tok_s": asyncio.run(throughput(url, args.n_load, args.load_words, args.load_tokens, seed))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=1500, help="words of each long prompt (about one token each)")
    parser.add_argument("--n-long", type=int, default=3)
    parser.add_argument("--spacing", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=2000, help="the running stream's longest length (cut once the long prompts answer)")
    parser.add_argument("--n-load", type=int, default=4, help="requests sent at once for the throughput")
    parser.add_argument("--load-words", type=int, default=200)
    parser.add_argument("--load-tokens", type=int, default=64)
    parser.add_argument("--setups", nargs="+", default=list(EQUAL_HARDWARE), choices=list(SETUPS))
    parser.add_argument("--json", help="also write every round's numbers here")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in args.setups}
    transfers: list[dict] = []
    for r in range(args.rounds):
        for name in args.setups[r % len(args.setups) :] + args.setups[: r % len(args.setups)]:
            rows[name].append(measure(name, args, r + 1, transfers))
            print(f"round {r + 1}: {name}: {rows[name][-1]}", flush=True)
    if transfers:
        print(f"\ntransfer (loopback), median of {len(transfers)}: " + ", ".join(
            f"{k} {statistics.median(t[k] for t in transfers):,.1f}" for k in ("tokens", "bytes_per_token", "ms", "mb_per_s")))  # fmt: skip
    head = "gap p50 ms | gap p99 ms | gap max ms | long TTFT ms | stream tok/s"
    print(f"\n| setup (median [range] of {args.rounds} rounds) | {head} | tok/s at {args.n_load} |")
    print("|---|---|---|---|---|---|---|")
    for name, results in rows.items():
        cells = [spread([x[k] for x in results], 1 if k.endswith("tok_s") else 0) for k in METRICS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "transfers": transfers}, indent=1))


if __name__ == "__main__":
    main()
