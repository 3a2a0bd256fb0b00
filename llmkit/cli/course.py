"""The course's commands: ``bench``, ``upstream``, ``fleet``, ``sim`` and ``exercises``, each a parser and its handler.

Their tools come with the ``lab`` extra, so each handler imports them inside itself (``course_imports``): building the
parser imports none of them, and the servers install without the extra (``tests/test_layout.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LAB = "pip install 'llmkit[lab]'"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    add_bench_parser(sub)
    add_upstream_parser(sub)
    add_fleet_parser(sub)
    add_sim_parser(sub)
    add_exercises_parser(sub)


@contextmanager
def course_imports(command: str) -> Iterator[None]:
    """Around an import of the course apparatus (``llmkit.course``): if a package of the lab extra is missing, say so and exit.

    The servers need only the core packages; ``translate``, ``bench`` and ``upstream`` use the course's tools (its
    HTTP helpers, the bench, llama-server's C++ read with tree-sitter), whose packages come with the lab extra.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "llmkit":
            raise  # a module of llmkit itself: a bug, not a missing extra
        raise SystemExit(f"llmkit {command}: needs the package {exc.name!r}, which comes with the lab extra: {LAB}") from exc


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark the servers side by side (tokens/s, time to first token, targets)")
    b.add_argument("--url", action="append", default=[], metavar="NAME=URL", help="also bench this OpenAI-compatible server (repeatable)")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N", help="concurrent streams (default 1 2 4 8)")
    b.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per stream (default 128)")
    b.add_argument("-t", "--threads", type=int, default=None, help="CPU threads of the servers started here and of the raw loop")
    b.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    b.add_argument("-o", "--out", default="bench-results", help="output folder (default bench-results/)")
    b.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=[
            "sequential",
            "slots",
            "no-budget",
            "llama-server",
            "raw",
            "levels",
            "apis",
            "prefix",
            "arrivals",
            "kv-cache",
            "speculation",
            "priority",
            "fleet",
            "shared-prefix",
        ],
        help="leave out a server or a scenario (no-budget: the slot server with --step-tokens 0; llama-server: built from "
        "the pinned llama.cpp; levels: the 1-8 stream levels; apis: the same streams through chat, Responses and Messages; "
        "speculation: --spec-type ngram-simple and ngram-mod on and off, on both servers; priority: a high-priority "
        "request while every slot is busy, waiting or preempting; fleet: the router's policies in front of 2 replicas of each "
        "server on a multi-tenant trace)",
    )
    b.add_argument(
        "--priority-rounds", type=int, default=3, metavar="N",
        help="priority scenario: high-priority requests, each while every slot streams (default 3; 0: skip it)",
    )  # fmt: skip
    b.add_argument(
        "--arrivals",
        type=int,
        nargs="*",
        default=[1, 4],
        metavar="K",
        help="arrivals scenario: K streams running when long prompts arrive (default 1 4; none: skip)",
    )
    b.add_argument("--ctx-per-slot", type=int, default=1024, help="slot server context per slot (default 1024)")
    b.add_argument("--prefix-tokens", type=int, default=800, help="shared prefix of the prefix-reuse scenario (default 800)")
    b.add_argument("--cache-prompt", action="store_true", help="let servers reuse cached prompts in the concurrency levels")
    b.add_argument("--soak", type=int, default=0, metavar="N", help="also N short requests to a 4 x 2048 slot server, RSS sampled")
    b.add_argument(
        "--rounds", type=int, default=1, metavar="R", help="run every level R times (servers in rotating order), report the median run"
    )
    b.add_argument(
        "--greedy-runs",
        type=int,
        default=0,
        metavar="R",
        help="also answer chapter 6's 8 reviews greedily alone, then R times batched on 4 slots, and count the answers that differ",
    )
    b.set_defaults(run=bench)


def bench(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    with course_imports("bench"):
        from llmkit.course import bench as bench_

    # SIGTERM unwinds like Ctrl-C, so the servers the bench started are stopped too (else they outlive it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for noisy in ("httpx", "matplotlib", "llmkit.llama"):  # per-request lines, font cache, model load: the bars say enough
        logging.getLogger(noisy).setLevel(logging.WARNING)
    urls = dict(u.split("=", 1) if "=" in u else (u, u) for u in args.url)
    cfg = bench_.Config(
        concurrency=tuple(args.concurrency), max_tokens=args.max_tokens, threads=args.threads, model=args.model, urls=urls,
        out=Path(args.out), skip=frozenset(args.skip), ctx_per_slot=args.ctx_per_slot, prefix_tokens=args.prefix_tokens,
        arrivals=tuple(args.arrivals),
        cache_prompt=args.cache_prompt, soak=args.soak, rounds=args.rounds, greedy_runs=args.greedy_runs,
        priority_rounds=args.priority_rounds,
    )  # fmt: skip
    try:
        results = bench_.run(cfg)
    except (bench_.BenchError, RuntimeError) as exc:
        print(f"llmkit bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the servers it started are stopped on the way out
        print("llmkit bench: interrupted", file=sys.stderr)
        return 130
    print(results.markdown)
    written = [results.table_path, results.plot_path, results.table_path.with_name("results.json")]
    print("written:", ", ".join(str(path) for path in written if path is not None))
    return 0


def add_upstream_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("upstream", help="the llama.cpp that llmkit runs: llama-server's source and binary")
    actions = up.add_subparsers(dest="action", required=True)
    find = actions.add_parser("find", help="print a C++ function, method, struct or enum by name, with line numbers")
    find.add_argument("name", help="e.g. get_available_slot, server_queue::start_loop, server_slot")
    find.add_argument("--all", action="store_true", help="every definition of that name (overloads, several classes)")
    actions.add_parser("build", help="build llama-server from that source (once, ~7 min on 2 cores) and print its path")
    actions.add_parser("path", help="fetch the source if needed and print where it is")
    up.set_defaults(run=upstream_command)


def upstream_command(args: argparse.Namespace) -> int:
    with course_imports("upstream"):
        from llmkit.course import upstream

    try:
        if args.action == "build":
            print(upstream.server_binary())
        elif args.action == "path":
            print(upstream.root())
        else:
            for symbol in upstream.find_all(args.name) if args.all else [upstream.find(args.name)]:
                print(symbol, end="\n\n")
    except (upstream.UpstreamError, LookupError) as exc:
        print(f"llmkit upstream: {exc}", file=sys.stderr)
        return 1
    return 0


def add_fleet_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fleet", help="replicas of a server behind a real router (vllm-router), until Ctrl-C; or a trace through them")
    f.add_argument("--replicas", type=int, default=2, help="how many servers (default 2), each -t 1")
    f.add_argument("--server", choices=("slots", "llama-server"), default="slots", help="what each replica runs (default slots)")
    f.add_argument("--policy", nargs="+", default=["cache_aware"], help="the router's policy (default cache_aware); several with --trace")
    f.add_argument("--port", type=int, default=None, help="the router's port (default: a free one)")
    f.add_argument("--flags", default="", help='more flags for every replica, one string: --flags "-c 4096 -np 2"')
    f.add_argument("--router-flags", default="", help='more flags for vllm-router: --router-flags "--balance-abs-threshold 2"')
    f.add_argument("--trace", action="store_true", help="replay the multi-tenant trace through each policy, print what it measured, exit")
    f.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    f.add_argument("--conversations", type=int, default=10, help="the trace's conversations (default 10)")
    f.add_argument("--turns", type=int, default=4, help="questions per conversation (default 4)")
    f.add_argument("--tenants", type=int, default=4, help="tenants, each with its own system prompt and examples (default 4)")
    f.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default 24)")
    f.add_argument("--out", default=None, help="with --trace: also write every request's record here (JSON)")
    f.set_defaults(run=fleet_command)


def fleet_command(args: argparse.Namespace) -> int:
    import dataclasses
    import importlib.util
    import json
    import os
    import shlex
    import signal
    import time
    from pathlib import Path

    with course_imports("fleet"):
        from llmkit.course import fleet, trace

        if importlib.util.find_spec("vllm_router") is None:  # the router: a package of the lab extra, run as a process
            raise ModuleNotFoundError("no vllm_router", name="vllm_router")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: the fleet is stopped on the way out
    logging.getLogger("httpx").setLevel(logging.WARNING)
    flags, router_flags = shlex.split(args.flags), shlex.split(args.router_flags)
    try:
        if args.trace:
            plan = trace.make_trace(args.seed, args.tenants, args.conversations, args.turns)
            sizes = f"{plan.n_requests} requests, {len(plan.conversations)} conversations, {len(plan.tenants)} tenants"
            print(f"trace (seed {args.seed}): {sizes}")
            runs = {}
            for policy in args.policy:
                load = os.getloadavg()[0]
                run = fleet.compare(args.server, [policy], plan, args.replicas, flags, router_flags, max_tokens=args.max_tokens)
                runs[policy] = run[policy]
                print(f"{args.server} x{args.replicas} {policy:<16} {trace.summarize(runs[policy]).line()}  (load {load:.1f})", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({p: [dataclasses.asdict(r) for r in rs] for p, rs in runs.items()}, indent=1))
            return 0
        with fleet.start(args.replicas, args.server, args.policy[0], flags=flags, router_flags=router_flags, port=args.port) as running:
            print(f"router ({args.policy[0]}): {running.url}")
            for name, path in running.logs.items():
                print(f"  {name}: {path}")
            print("Ctrl-C stops every process.", flush=True)
            while running.router.running() and all(r.running() for r in running.replicas):
                time.sleep(0.5)
            print("llmkit fleet: a process exited; see its log above", file=sys.stderr)
            return 1
    except (fleet.FleetError, fleet.launch.PortInUse, ValueError) as exc:
        print(f"llmkit fleet: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llmkit fleet: stopped", file=sys.stderr)
        return 130


def add_sim_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sim", help="the fleet in a discrete-event model, calibrated from the engine's step costs")
    actions = s.add_subparsers(dest="action", required=True)
    cal = actions.add_parser("calibrate", help="measure this machine's step costs on the real model and fit them (1-3 min)")
    cal.add_argument("-o", "--out", default="step-cost.json", help="where to write the fit (default step-cost.json)")
    cal.add_argument("-t", "--threads", type=int, default=1, help="llama.cpp threads, as each replica's -t (default 1)")
    check = actions.add_parser("check", help="real fleets of N replicas against the model, on the same trace (minutes)")
    check.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="fleet sizes (default 1 2 3)")
    check.add_argument("--cores", type=float, default=None, help="cores the replicas share in the model (default: this machine's)")
    cap = actions.add_parser("capacity", help="replicas for a TTFT p99 SLO at scale, per policy and cost curve (model only)")
    cap.add_argument("--users", type=int, default=2000, help="conversations in the scaled trace (default 2000)")
    cap.add_argument("--rate", type=float, default=20.0, help="conversations starting per second (default 20)")
    cap.add_argument("--slo", type=float, default=1.0, help="TTFT p99 target in seconds (default 1)")
    cap.add_argument("--curve", nargs="+", default=["cpu", "gpu-like"], choices=("cpu", "gpu-like"), help="step cost curves")
    cap.add_argument("--cost-scale", type=float, default=1.0, help="every step this many times as costly (the answer's sensitivity)")
    for p in (check, cap):
        p.add_argument("--policy", nargs="+", default=None, help="router policies (default: all five; check: cache_aware)")
        p.add_argument("--cost", default=None, help="a calibration JSON (default: the one shipped, measured on a 2-core VM)")
        p.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    s.set_defaults(run=sim_command)


def sim_command(args: argparse.Namespace) -> int:
    with course_imports("sim"):
        from llmkit.course import sim, trace

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.action == "calibrate":
        cost = sim.measure(threads=args.threads)
        cost.save(args.out)
        print(sim.describe(cost), f"written: {args.out}", sep="\n")
        return 0
    cost = sim.StepCost.load(args.cost) if args.cost else sim.StepCost.load()
    if args.action == "check":
        rows = [
            r
            for p in args.policy or ["cache_aware"]
            for r in sim.compare(trace.make_trace(args.seed), args.replicas, p, cost=cost, cores=args.cores)
        ]
        print(sim.table(rows))
    else:
        users, cost = sim.scaled_trace(args.users, args.rate, args.seed), cost.scaled(args.cost_scale)
        print(sim.capacity_markdown(sim.capacity_table(users, args.policy or list(sim.POLICIES), args.slo, args.curve, cost=cost)))
    return 0


def add_exercises_parser(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("exercises", help="your progress in the exercises; a student edition; a class's notebooks graded")
    actions = ex.add_subparsers(dest="action")
    student = actions.add_parser("student", help="write the notebooks without their solutions, both editions")
    student.add_argument("out", help="folder to write en/ and ja/ in")
    student.add_argument("--notebooks", help="the course's notebooks folder (default: the checkout's notebooks/)")
    grade = actions.add_parser("grade", help="grade every notebook under a folder: a table of student x exercise (CSV and HTML)")
    grade.add_argument("folder", help="the submitted notebooks (a student: a notebook, or a folder of them)")
    grade.add_argument("-o", "--out", default="grades", help="folder for grades.csv and grades.html (default ./grades)")
    grade.add_argument("--cell-timeout", type=float, default=300, metavar="S", help="seconds a cell may run (default 300)")
    grade.add_argument("--timeout", type=float, default=1800, metavar="S", help="seconds a whole submission may run (default 1800)")
    ex.set_defaults(run=exercises_command)


def exercises_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    with course_imports("exercises"):
        from llmkit.course.exercises import cage, chapters, classroom, done

    if args.action == "student":
        written = classroom.student_edition(Path(args.out), Path(args.notebooks) if args.notebooks else None)
        print(f"{len(written)} notebooks without their solutions in {args.out}/")
    elif args.action == "grade":
        submissions = classroom.grade(Path(args.folder), Path(args.out), cell_timeout=args.cell_timeout, total_timeout=args.timeout)
        out = Path(args.out)
        print(f"{len(submissions)} notebooks graded: {out / 'grades.csv'}, {out / 'grades.html'} (cage: {cage.kind()})")
    else:
        print(done.text(chapters()))
    return 0
