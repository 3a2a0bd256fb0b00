"""What one engine step costs: fitted from the engine's own measured steps (``Engine.steps``), saved as a small JSON.

    cost = StepCost.load()                    # the shipped fit: SmolLM2-135M, -t 1, measured on the course's 2-core VM
    cost(n_prompt=128, n_generated=3, context=9.0)   # seconds of one step (context: thousands of attention pairs)
    cost = measure()                          # measure this machine instead (~1-3 minutes), then cost.save(path)

The model is linear in what a step's batch holds, each term a kind of work llama.cpp does in ``llama_decode``:

    t = base + per_prompt * n_prompt + per_generated * n_generated + per_context * context

``base`` is the step's fixed cost (the graph, the Python bookkeeping around it); ``per_prompt`` and ``per_generated``
the weights' matrix products per token of a prompt chunk and per running stream's token (on a CPU both near the
same: a batch is cheaper per token, not free); ``per_context`` attention: each token of the batch reads the keys of
every token before it in its slot, so ``context`` is the number of (token, earlier token) pairs, in thousands. A prompt
chunk of ``k`` tokens at position ``p`` adds ``k * p + k * (k + 1) / 2`` pairs, a stream's token at ``p`` adds ``p + 1``.
``StepCost.terms`` tells how much each term buys (the fit's error without it), so the course can say which matter.
A step's cost is the CPU time of the engine's thread (llama.cpp computes on it at ``-t 1``): its time on a core of its
own, whatever else the machine runs; the fleet's model slows it when replicas and other programs share the cores.

Beside the steps, the engine copies a slot to the prompt cache and back (``Context.seq_state``): ``state_per_token``.

``GpuLikeCost`` is the other shape: a step's cost nearly flat in its tokens up to a knee, then linear (a roofline: a
step reads every weight once whatever its batch, until the batch's arithmetic outgrows the memory's bandwidth). It is
an assumption, not a measurement: see its docstring for where its numbers come from.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from llmkit.course import tr

CALIBRATION = Path(__file__).with_name("smollm2-135m-t1.json")  # the shipped fit
# The slot server's engine thread spends this many times the bare engine's CPU on the same steps (its sampler, its KV
# events, its status snapshots): 1.18, median of 9 real runs of 1-3 replicas (range 1.13-1.44, ``scripts/sim_bias.py``).
# The model of a fleet of slot servers (``check``, ``capacity``) scales the fit by it.
SERVER_STEP = 1.18
TERMS = ("base", "per_prompt", "per_generated", "per_context")


class Cost(Protocol):
    """What the simulation asks of a cost model."""

    def __call__(self, n_prompt: int, n_generated: int, context: float) -> float: ...

    @property
    def state_per_token(self) -> float: ...


class Point(NamedTuple):
    """One measured step: what its batch held and what it cost."""

    n_prompt: int
    n_generated: int
    context: float  # thousands of (token, earlier token) pairs
    seconds: float  # CPU seconds of the engine's thread: the step's time on a core of its own
    wall: float = 0.0  # the step's wall-clock seconds (more on a machine busy with other programs)


def pairs(n_tokens: int, pos: int) -> int:
    """Attention pairs of ``n_tokens`` written at positions ``pos``, ``pos + 1``, ...: each reads itself and every token before it."""
    return n_tokens * pos + n_tokens * (n_tokens + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """A step's seconds, linear in its batch (the module's docstring); fitted by ``fit``, measured by ``measure``."""

    base: float
    per_prompt: float
    per_generated: float
    per_context: float
    state_per_token: float = 0.0  # seconds to copy one token's KV cells to the prompt cache or back
    error: dict[str, float] = field(default_factory=dict)  # the fit's relative error over its points: median, p90, max
    terms: dict[str, float] = field(default_factory=dict)  # median relative error of the fit without each term
    machine: dict[str, Any] = field(default_factory=dict)  # where and how it was measured
    points: tuple[Point, ...] = ()  # the measured steps it was fitted to

    def __call__(self, n_prompt: int, n_generated: int, context: float) -> float:
        return self.base + self.per_prompt * n_prompt + self.per_generated * n_generated + self.per_context * context

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as costly (the capacity answer's sensitivity to the fit: 0.7, 1.3)."""
        terms = {t: getattr(self, t) * factor for t in TERMS}
        return replace(self, **terms, machine=self.machine | {"scaled": factor})

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str] = CALIBRATION) -> StepCost:
        data = json.loads(Path(path).read_text())
        return cls(**data | {"points": tuple(Point(*p) for p in data["points"])})

    def relative_errors(self) -> np.ndarray:
        """(predicted - measured) / measured at each fitted point."""
        return np.array([(self(p.n_prompt, p.n_generated, p.context) - p.seconds) / p.seconds for p in self.points])


Coefficients = tuple[float, float, float, float]  # in TERMS' order


def least_squares(points: Sequence[Point], terms: Sequence[str] = TERMS) -> Coefficients:
    """The coefficients of ``terms`` (the others 0) that minimise the squared *relative* error: a 10 ms step and a 2 s
    one count alike."""
    columns = {"base": [1.0] * len(points), "per_prompt": [p.n_prompt for p in points],
               "per_generated": [p.n_generated for p in points], "per_context": [p.context for p in points]}  # fmt: skip
    seconds = np.array([p.seconds for p in points])
    a = np.array([columns[t] for t in terms], dtype=float).T / seconds[:, None]
    solved, *_ = np.linalg.lstsq(a, np.ones(len(points)), rcond=None)
    found = dict(zip(terms, (float(c) for c in solved), strict=True))
    base, per_prompt, per_generated, per_context = (found.get(t, 0.0) for t in TERMS)
    return base, per_prompt, per_generated, per_context


def fit(points: Sequence[Point], state_per_token: float = 0.0, machine: dict[str, Any] | None = None) -> StepCost:
    """The cost model fitted to measured steps, with its error and the error of the fit without each of its terms (a term
    whose coefficient comes out negative is dropped: no kind of work makes a step faster)."""

    def errors(coef: Coefficients) -> np.ndarray:
        return np.abs(StepCost(*coef, points=tuple(points)).relative_errors())

    kept, coef = list(TERMS), least_squares(points)
    while negative := [t for t, c in zip(TERMS, coef, strict=True) if c < 0]:
        kept.remove(negative[0])  # a negative cost is the noise's, not a kind of work: that term goes
        coef = least_squares(points, kept)
    e = errors(coef)
    error = {"median": float(np.median(e)), "p90": float(np.percentile(e, 90)), "max": float(e.max())}
    terms = {t: float(np.median(errors(least_squares(points, [u for u in kept if u != t])))) for t in kept}
    return StepCost(*coef, state_per_token, error, terms, machine or {}, tuple(points))


@dataclass(frozen=True)
class GpuLikeCost:
    """An assumed GPU-shaped step cost: flat up to ``knee`` tokens in the batch, then linear; plus attention.

    ``t = flat * max(1, n_tokens / knee) + per_context * context``. The shape is a GPU's roofline: a step streams every
    weight from memory once whatever its batch (``flat``), and only when the batch's arithmetic outgrows that time does
    the step grow with its tokens. Where the knee sits: (the GPU's FLOP/s / its memory's bytes/s) x (bytes per weight /
    2 FLOPs per weight and token): about 150 tokens for an A100 (312 TFLOP/s fp16, 2.0 TB/s) at 16-bit weights, more in
    practice (kernels reach the FLOP/s later than the bandwidth), which is why Sarathi-Serve (OSDI 2024) and vLLM's
    chunked prefill budget 512 tokens a step. llama.cpp's own CUDA numbers show the shape
    (``examples/batched-bench/README.md``, LLaMA-7B F16, ``-ngl 99``): a decode step of 8, 16 and 32 streams takes
    57, 66 and 69 ms (vs 24 ms for one), while prompts cost 0.83 ms a token (1,200 t/s): flat to a knee of ~80 tokens,
    then linear. ``knee=256`` sits between the two. ``flat`` is one step's time at a small batch: by default (``like``)
    the CPU fit's own one-stream step, so that only the *shape* differs between the two curves, not the speed of one
    stream. This is an assumption to compare shapes, not a measured GPU: say so when you show it.
    """

    flat: float
    knee: int = 256
    per_context: float = 0.0
    state_per_token: float = 0.0

    def __call__(self, n_prompt: int, n_generated: int, context: float) -> float:
        return self.flat * max(1.0, (n_prompt + n_generated) / self.knee) + self.per_context * context

    @classmethod
    def like(cls, cpu: StepCost, knee: int = 256) -> GpuLikeCost:
        """The GPU-like shape at ``cpu``'s speed for one token: a step of up to ``knee`` tokens costs what the CPU's
        one-stream step costs; attention is scaled as the matrix products are past the knee (it is arithmetic too);
        the prompt cache's copies are the CPU's."""
        flat = cpu(0, 1, 0.0)
        return cls(flat, knee, cpu.per_context * (flat / knee) / cpu.per_prompt, cpu.state_per_token)


# --- measuring --------------------------------------------------------------------------------------------------------


def cpu_step(engine: Any) -> Point | None:
    """One ``engine.step()`` as a point: its batch from the ``StepRecord``; its cost in CPU seconds of this thread, which
    runs llama.cpp's compute at ``-t 1``, so another program's load on the machine does not count (the wall clock's
    would); each slot's start position is what it holds after the step minus what the step wrote."""
    t_cpu = time.thread_time()
    step = engine.step()
    if step is None:
        return None
    cpu = time.thread_time() - t_cpu
    context = sum(pairs(share.n_tokens, engine.slots[share.slot].n_past - share.n_tokens) for share in step.batch)
    return Point(step.n_prompt, step.n_generated, context / 1000, cpu, step.seconds)


def run_requests(engine: Any, prompts: Sequence[int], max_tokens: int, rng: random.Random, late: int = 0) -> list[Point]:
    """Random prompts of the given lengths decoded together (greedy, no early stop, no prompt reuse); with ``late``,
    one more prompt of that length arrives after the others' first tokens: its chunks share steps with their streams."""
    from llmkit.engine.request import RequestParams

    params = RequestParams.of(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_prompt=False)

    def submit(n: int) -> Any:
        return engine.submit([rng.randrange(1000, 30000) for _ in range(n)], params)

    requests, points = [submit(n) for n in prompts], []
    while not all(r.done for r in requests):
        if (point := cpu_step(engine)) is not None:
            points.append(point)
            if late and point.n_generated:  # the streams run: the late prompt's chunks join their steps
                requests.append(submit(late))
                late = 0
    return points


def measure_state_copy(engine: Any, n_tokens: int = 1024, rounds: int = 5) -> float:
    """CPU seconds per token to copy a slot's KV cells to RAM and back (what a prompt-cache save and restore cost)."""
    run_requests(engine, [n_tokens - 1], 1, random.Random(0))
    slot = next(s for s in engine.slots if s.n_past)
    t0 = time.thread_time()
    for _ in range(rounds):
        engine.ctx.set_seq_state(slot.id, engine.ctx.seq_state(slot.id))
    return (time.thread_time() - t0) / rounds / 2 / slot.n_past


def measure(model: str | None = None, threads: int = 1, seed: int = 0, scale: float = 1.0) -> StepCost:
    """Measure this machine's step costs on the real model (``Engine(start=False)``, 4 slots, ``threads`` threads) and
    fit them: prompts of 32 to 1024 tokens beside 1 to 4 streams, and prompts arriving while streams run (``scale``
    shrinks the prompts and answers for a quick check). ~1-3 minutes at ``scale=1`` on an idle 2-core machine."""
    from llmkit.engine import Engine, EngineConfig

    rng = random.Random(seed)
    config = EngineConfig(n_threads=threads, n_parallel=4, n_ctx=8192, cache_ram_mib=0)
    with Engine(model, config, start=False) as engine:
        run_requests(engine, [16], 4, rng)  # warm up: the first steps of a context are slow
        points: list[Point] = []
        for length in (32, 256, 1024):
            for n in (1, 2, 3, 4):
                n_prompt = max(4, int(length * scale))
                points += run_requests(engine, [n_prompt] * n, max(4, int(32 * scale)), rng, late=n_prompt if n < 4 else 0)
        state = measure_state_copy(engine, max(64, int(1024 * scale)))
        machine = {"model": engine.model.path.name, "threads": threads,
                   "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
                   "cpu_share": sum(p.seconds for p in points) / sum(p.wall for p in points)}  # fmt: skip
    return fit(points, state, machine)


# --- telling it ---------------------------------------------------------------------------------------------------------


def describe(cost: StepCost) -> str:
    """The fit in words: each coefficient, the error, and what each term buys."""
    m, e = cost.machine, cost.error
    lines = [
        tr("t = {base:.2f} ms + {prompt:.3f} ms x prompt tokens + {generated:.3f} ms x streams' tokens + {context:.4f} ms x "
           "thousand attention pairs", base=cost.base * 1e3, prompt=cost.per_prompt * 1e3, generated=cost.per_generated * 1e3,
           context=cost.per_context * 1e3),
        tr("prompt cache copy: {us:.1f} us a token", us=cost.state_per_token * 1e6),
        tr("fit over {n} steps: relative error median {median:.1%}, p90 {p90:.1%}, max {max:.0%}", n=len(cost.points),
           median=e["median"], p90=e["p90"], max=e["max"]),
        tr("without a term, the median error: ") + tr(", ").join(f"{t} {e:.1%}" for t, e in cost.terms.items()),
        tr("measured: {model}, -t {threads}, {cores} cores, load {load:.1f} (the steps got {share:.0%} of a core), {date}",
           model=m.get("model"), threads=m.get("threads"), cores=m.get("cores"), load=m.get("load_average", 0),
           share=m.get("cpu_share", 1), date=m.get("date")),
    ]  # fmt: skip
    return "\n".join(lines)


def plot_fit(cost: StepCost, ax: Any = None) -> Any:
    """Each measured step's seconds against the fit's, on log axes, coloured by its prompt tokens; the diagonal is a perfect fit."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(5, 5))[1]
    measured = [p.seconds for p in cost.points]
    predicted = [cost(p.n_prompt, p.n_generated, p.context) for p in cost.points]
    dots = ax.scatter(measured, predicted, c=[p.n_prompt for p in cost.points], s=12, cmap="viridis")
    low, high = min(measured + predicted), max(measured + predicted)
    ax.plot([low, high], [low, high], color="grey", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="measured step (s)", ylabel="fitted step (s)")
    ax.figure.colorbar(dots, ax=ax, label="prompt tokens in the step")
    return ax
