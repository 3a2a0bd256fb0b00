"""What the KV events cost the engine per step (issue 29, item 3): ``KVEventTracker.update`` on hand-made slots, no model.

    python scripts/kv_events_cost.py                       # 4 slots of 2,000 tokens, block size 16

Rows: a decode step (one token appended to every slot, a block completed now and then), a step where nothing
changed, a prefill step (a chunk of ``--chunk`` tokens into one slot), and a prompt of ``--entry`` tokens entering the
prompt cache (hashed once, whole). Each is the mean of ``--steps`` runs, in microseconds; an engine step of the slot
server takes milliseconds (``engine.steps``), so the rows are its overhead.
"""

from __future__ import annotations

import argparse
import random
import time

from llmkit.engine.kv_events import KVEventTracker, block_names
from llmkit.engine.slot import Slot


def mean_us(run, n: int) -> float:
    t0 = time.perf_counter()
    for k in range(n):
        run(k)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens each slot holds to begin with")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128, help="a prefill step's tokens (the engine's --step-tokens)")
    parser.add_argument("--entry", type=int, default=8192, help="tokens of a prompt entering the prompt cache")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    slots = [Slot(i, 1 << 20) for i in range(args.slots)]
    for slot in slots:
        slot.append([rng.randrange(49152) for _ in range(args.tokens)])
    tracker = KVEventTracker(args.block_size)
    tracker.update(slots, None)

    def decode(k: int) -> None:
        for slot in slots:
            slot.append([k])
        tracker.update(slots, None)

    def prefill(k: int) -> None:
        slots[0].append([rng.randrange(49152) for _ in range(args.chunk)])
        tracker.update(slots, None)

    entry = [rng.randrange(49152) for _ in range(args.entry)]
    rows = {
        f"decode step, {args.slots} slots": mean_us(decode, args.steps),
        "a step that changed nothing": mean_us(lambda k: tracker.update(slots, None), args.steps),
        f"prefill step, {args.chunk} tokens": mean_us(prefill, args.steps // 10),
        f"a {args.entry}-token prompt cached": mean_us(lambda k: block_names(entry, args.block_size, 0, None), 20),
    }
    for name, us in rows.items():
        print(f"{name:<32} {us:10,.1f} us")


if __name__ == "__main__":
    main()
