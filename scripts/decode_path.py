"""The raw loop's decode path beside llama-batched-bench's, one difference at a time (issue 22).

    python scripts/decode_path.py                                  # 1 and 8 sequences, 5 rounds, every variant
    python scripts/decode_path.py --seqs 1 2 4 8 --rounds 7 --variants before fa-off llmkit
    python scripts/decode_path.py --batched-bench /path/to/llama-batched-bench

The raw loop of ``llmkit.course.bench.scenarios.levels`` on batched-bench's shapes: ``n`` sequences of a ``--prompt``-token
prompt, prefilled in one batch, then ``--gen`` decode steps of ``n`` tokens, one ``llama_decode`` each, every
token sampled by llmkit's ``Sampler`` (greedy, ``ignore_eos``) as the bench does. Only the decode steps are timed
(sampling and batch building included, as batched-bench's S_TG includes its own loop): aggregate tok/s =
n * gen / seconds.

Each variant changes one thing against ``before`` (the context llmkit.llama.Context made before issue 22:
llama-cpp-python's default llama_context_params, n_ubatch 512, ``use_extra_bufts`` off, no threadpool); ``llmkit``
is ``llmkit.llama.Context`` as it is now. Variants run interleaved, round by round (A B C A B C ...), so that the
noise of a shared machine hits them all alike; the median of the rounds is shown, with min-max, and its ratio to
``before``. ``llama-batched-bench`` (built from the same llama.cpp as the wheel) runs once a round on the same
shapes, when found.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as lc
from llama_cpp.llama_cpp import _lib as libllama

from llmkit import models
from llmkit.llama import Batch, Context, Model, default_threads
from llmkit.sampling import Sampler, SamplingParams

# --- ggml's threadpool, which llama-cpp-python 0.3.36 does not bind (llama.h: "TODO: Add llama_attach_threadpool")


class ThreadpoolParams(ctypes.Structure):  # ggml.h: struct ggml_threadpool_params
    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),  # GGML_MAX_N_THREADS
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


def _ggml_cpu() -> ctypes.CDLL:
    lib = next(Path(lc.__file__).parent.joinpath("lib").glob("libggml-cpu.*"))
    cpu = ctypes.CDLL(str(lib))  # already loaded by llama_cpp: the same handle
    cpu.ggml_threadpool_new.argtypes, cpu.ggml_threadpool_new.restype = [ctypes.POINTER(ThreadpoolParams)], ctypes.c_void_p
    cpu.ggml_threadpool_free.argtypes, cpu.ggml_threadpool_free.restype = [ctypes.c_void_p], None
    libllama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    libllama.llama_attach_threadpool.restype = None
    return cpu


def threadpool(n_threads: int, poll: int) -> tuple[int, Callable[[], None]]:
    """A ggml threadpool as common_threadpools::init makes one for llama-server (prio normal, ``poll``); and its free."""
    cpu = _ggml_cpu()
    tpp = ThreadpoolParams(n_threads=n_threads, prio=0, poll=poll, strict_cpu=False, paused=False)
    pool = cpu.ggml_threadpool_new(ctypes.byref(tpp))
    return pool, lambda: cpu.ggml_threadpool_free(pool)


# --- variants -------------------------------------------------------------------


@dataclass
class Variant:
    """One change against ``before``: fields of llama_context_params, the model's extra buffer types, a threadpool,
    or no sampling at all (random tokens, as batched-bench feeds)."""

    doc: str
    params: dict[str, object] = field(default_factory=dict)
    extra_bufts: bool = False
    poll: int | None = None  # attach a threadpool with this polling level
    sample: bool = True
    llmkit: bool = False  # llmkit.llama.Context as it is now


VARIANTS = {
    "before": Variant("llmkit's Context before issue 22 (llama-cpp-python defaults, n_ubatch 512)"),
    "fa-off": Variant("flash_attn_type disabled (the default, auto, enables it on the CPU)", {"flash_attn_type": 0}),
    "fa-on": Variant("flash_attn_type enabled", {"flash_attn_type": 1}),
    "perf": Variant("no_perf false (common_params' default: llama-server and batched-bench measure)", {"no_perf": False}),
    "swa-full-off": Variant("swa_full false (common_params' default)", {"swa_full": False}),
    "ubatch-2048": Variant("n_ubatch = n_batch = 2048", {"n_ubatch": 2048}),
    "extra-bufts": Variant("use_extra_bufts, common's default (repacked weights: none for Q4_1 on x86)", extra_bufts=True),
    "pool-50": Variant("a ggml threadpool, poll 50, as llama-server (an OpenMP build ignores poll)", poll=50),
    "pool-0": Variant("a ggml threadpool with poll 0 attached", poll=0),
    "no-sample": Variant("no sampling: random tokens, as batched-bench", sample=False),
    "llmkit": Variant("llmkit.llama.Context as it is now", llmkit=True),
}


class _Ctx:
    """What the loop needs of a context: the handle (``Sampler.sample`` reads it) and the memory."""

    def __init__(self, model: Model, n_ctx: int, n_seq_max: int, threads: int, v: Variant):
        self.free_pool: Callable[[], None] | None = None
        self.own: Context | None = None
        if v.llmkit:
            self.own = Context(model, n_ctx=n_ctx, n_batch=2048, n_seq_max=n_seq_max, n_threads=threads)
            self.handle = self.own.handle
        else:
            p = lc.llama_context_default_params()
            p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 2048, 512, n_seq_max
            p.n_threads = p.n_threads_batch = threads
            for name, value in v.params.items():
                setattr(p, name, value)
            self.handle = lc.llama_init_from_model(model.handle, p)
            if not self.handle:
                raise RuntimeError("llama.cpp could not create the context")
            if v.poll is not None:
                pool, self.free_pool = threadpool(threads, v.poll)
                libllama.llama_attach_threadpool(self.handle, pool, None)  # None: the same pool for batches
        self.memory = lc.llama_get_memory(self.handle)

    def decode(self, batch: Batch) -> None:
        if lc.llama_decode(self.handle, batch.handle) != 0:
            raise RuntimeError("llama_decode failed")

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
        else:
            lc.llama_free(self.handle)
        if self.free_pool:
            self.free_pool()


def load_model(path: Path, extra_bufts: bool) -> Model:
    """llmkit's Model; with ``extra_bufts``, its weights loaded as common_model_params_to_llama has it (Model turns them off)."""
    if not extra_bufts:
        return Model(path)
    load = lc.llama_model_load_from_file

    def with_extra_bufts(path: bytes, params: lc.llama_model_params) -> lc.llama_model_p:
        params.use_extra_bufts = True
        return load(path, params)

    lc.llama_model_load_from_file = with_extra_bufts
    try:
        return Model(path)
    finally:
        lc.llama_model_load_from_file = load


def run(model: Model, v: Variant, n: int, args: argparse.Namespace) -> tuple[float, float]:
    """One raw loop on a fresh context: aggregate decode tok/s of ``n`` sequences, per wall second and per CPU second."""
    ctx = _Ctx(model, args.ctx_per_slot * max(args.seqs), max(args.seqs), args.threads, v)
    batch = Batch(max(2048, n * args.prompt))
    samplers = [Sampler(model, SamplingParams(temperature=0, ignore_eos=True)) for _ in range(n)] if v.sample else []
    rng = random.Random(n)
    try:
        batch.clear()
        last = []
        for seq in range(n):
            for pos in range(args.prompt):
                i = batch.add(rng.randrange(model.n_vocab), pos, seq, logits=pos == args.prompt - 1)
            last.append(i)
        ctx.decode(batch)  # the prefill, untimed: it also warms the graph up
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(args.gen):
            if v.sample:
                tokens = [s.sample(ctx, i) for s, i in zip(samplers, last, strict=True)]  # type: ignore[arg-type]
            else:
                tokens = [rng.randrange(model.n_vocab) for _ in range(n)]
            batch.clear()
            last = [batch.add(t, args.prompt + step, seq, logits=True) for seq, t in enumerate(tokens)]
            ctx.decode(batch)
        lc.llama_synchronize(ctx.handle)
        return n * args.gen / (time.perf_counter() - t0), n * args.gen / (time.process_time() - c0)
    finally:
        for s in samplers:
            s.close()
        batch.close()
        ctx.close()


def batched_bench(binary: Path, model: Path, n: int, args: argparse.Namespace) -> tuple[float, float]:
    """llama-batched-bench on the same shape: S_TG (decode tok/s) of ``n`` sequences, per wall second and per CPU
    second (the CPU time of a run with 1 + ``gen`` decode steps less that of a run with 1: the steps alone)."""

    def once(n_tg: int) -> tuple[float, float]:
        command = [str(binary), "-m", str(model), "-c", str(args.ctx_per_slot * max(args.seqs)), "-b", "2048", "-ub", "512"]
        command += ["-npp", str(args.prompt), "-ntg", str(n_tg), "-npl", str(n), "-t", str(args.threads), "-tb", str(args.threads)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([*command, "--output-format", "jsonl"], capture_output=True, text=True, check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        row = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
        return row["speed_tg"], (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    speed, cpu = once(1 + args.gen)
    return speed, n * args.gen / (cpu - once(1)[1])


def find_batched_bench() -> Path | None:
    """$LLAMA_BATCHED_BENCH, else llama-batched-bench on the PATH (build it in llama-server's build tree:
    cmake --build BUILD --target llama-batched-bench)."""
    for candidate in (os.environ.get("LLAMA_BATCHED_BENCH"), shutil.which("llama-batched-bench")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the bench's model)")
    ap.add_argument("--threads", "-t", type=int, default=default_threads(), help="as the bench: all cores (default %(default)s)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=45, help="prompt tokens per sequence")
    ap.add_argument("--gen", type=int, default=128, help="decode steps")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="KV cells per sequence (the bench's ctx_per_slot)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--verbose", "-v", action="store_true", help="print every run")
    ap.add_argument("--batched-bench", type=Path, nargs="*", help="llama-batched-bench binaries (default: looked for)")
    args = ap.parse_args()
    if "before" not in args.variants:
        args.variants.insert(0, "before")
    path = models.resolve_model(args.model)
    found = find_batched_bench()
    binaries = args.batched_bench or ([found] if found else [])
    models_by_bufts = {extra: load_model(path, extra) for extra in {VARIANTS[name].extra_bufts for name in args.variants}}

    results: dict[str, dict[int, list[tuple[float, float]]]] = {name: {n: [] for n in args.seqs} for name in args.variants}
    for binary in binaries:
        results[binary.name] = {n: [] for n in args.seqs}
    print(f"{path.name}, -t {args.threads}, prompt {args.prompt}, {args.gen} decode steps, {args.rounds} rounds")
    for r in range(args.rounds):
        for name in args.variants:
            v = VARIANTS[name]
            for n in args.seqs:
                results[name][n].append(run(models_by_bufts[v.extra_bufts], v, n, args))
            if args.verbose:
                print(f"  {name}: " + "  ".join(f"{n} seq {results[name][n][-1][0]:.1f}" for n in args.seqs), flush=True)
        for binary in binaries:
            for n in args.seqs:
                results[binary.name][n].append(batched_bench(binary, path, n, args))
        last = "  ".join(f"{name} {per_n[args.seqs[-1]][-1][0]:.0f}" for name, per_n in results.items())
        print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f}), {args.seqs[-1]} seq: {last}", flush=True)

    for k, what in enumerate(("wall second", "CPU second (robust to other load at -t 1)")):
        base = {n: statistics.median(x[k] for x in results["before"][n]) for n in args.seqs}
        print(f"\naggregate decode tok/s per {what}: median of {args.rounds} [min-max], ratio of medians to 'before'")
        print(f"{'variant':26}" + "".join(f"{f'{n} seq':>28}" for n in args.seqs))
        for name, per_n in results.items():
            cells = []
            for n in args.seqs:
                xs = [x[k] for x in per_n[n]]
                med = statistics.median(xs)
                cells.append(f"{med:6.1f} [{min(xs):5.1f}-{max(xs):5.1f}] {med / base[n]:5.2f}x")
            print(f"{name:26}" + "".join(f"{c:>28}" for c in cells))
    for name in args.variants:
        print(f"  {name}: {VARIANTS[name].doc}")


if __name__ == "__main__":
    main()
