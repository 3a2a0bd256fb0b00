"""``llmkit`` command line: serve | translate | bench | upstream | fleet | sim | exercises.

llmkit serve sequential [--model PATH] [--host 127.0.0.1] [--port 8080]
llmkit serve slots      [-m PATH] [-c 8192] [-np 4] ...   (flags named like llama-server's)
llmkit translate "Hello" --to ja [--url http://127.0.0.1:8080]
llmkit bench [--url NAME=URL ...]
llmkit upstream find get_available_slot    # llama-server's C++ by name, with line numbers
llmkit upstream build                      # build llama-server from the same llama.cpp (once)
llmkit fleet --replicas 2 --server slots --policy cache_aware    # replicas behind vllm-router, until Ctrl-C
llmkit fleet --policy round_robin cache_aware --trace             # the multi-tenant trace through each policy
llmkit sim calibrate -o cost.json                                 # this machine's step costs, for the fleet's model
llmkit sim check --replicas 1 2 3 --cost cost.json                # the model against real fleets of 1-3 replicas
llmkit sim capacity --users 2000 --rate 20 --slo 1                # replicas for a TTFT p99 SLO, per policy, in the model
llmkit exercises                           # which exercises you have done, per chapter
llmkit exercises student OUT               # a student edition of the notebooks (no solutions)
llmkit exercises grade FOLDER -o OUT       # grade a class's notebooks: OUT/grades.csv and grades.html
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

from llmkit import models
from llmkit.engine.config import DEFAULT_STEP_TOKENS, EngineConfig
from llmkit.engine.policy import POLICIES, LlamaServerPolicy
from llmkit.engine.speculative import SpecParams, SpecType

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
LAB = "pip install 'llmkit[lab]'"


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


def add_common_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: $LLMKIT_MODEL, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmkit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parsers(sub)
    add_translate_parser(sub)
    add_bench_parser(sub)
    add_upstream_parser(sub)
    add_fleet_parser(sub)
    add_sim_parser(sub)
    add_exercises_parser(sub)
    return parser


def add_serve_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server").add_subparsers(dest="kind", required=True)
    seq = serve.add_parser("sequential", help="the tutorial's translation server: one request at a time")
    add_common_server_flags(seq)
    seq.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size in tokens (default 2048)")
    seq.add_argument("--temp", type=float, default=0.3, help="sampling temperature (default 0.3, 0 = greedy)")
    seq.add_argument("-n", "--n-predict", type=int, default=-1, help="max tokens per translation (-1: no limit)")

    slots = serve.add_parser("slots", help="the OpenAI-compatible slot server: continuous batching over -np slots")
    add_common_server_flags(slots)
    add_engine_flags(slots)
    add_kv_cache_flags(slots)
    add_speculative_flags(slots)
    slots.add_argument("-n", "--n-predict", type=int, default=-1, help="default max tokens per request (-1: no limit)")
    slots.add_argument("--temp", type=float, default=0.8, help="default sampling temperature (default 0.8, 0 = greedy)")
    slots.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-generation token (a request may say otherwise)")
    slots.add_argument("--alias", help="model name shown to clients (default: the GGUF file name)")
    slots.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or X-Api-Key); /health stays public")
    slots.add_argument("--metrics", action="store_true", help="enable GET /metrics (Prometheus)")
    slots.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True, help="enable GET /slots (default on)")
    slots.add_argument(
        "--sse-ping-interval", type=int, default=30, metavar="S", help="ping a stream after S seconds of silence (default 30; <= 0: never)"
    )
    slots.add_argument("--max-body-size", type=int, default=10 * 2**20, help="largest request body in bytes (default 10 MiB)")
    slots.add_argument(
        "--drain-timeout", type=float, default=30, metavar="S",
        help="llmkit's own: on SIGTERM, take no new connection and let running requests finish for up to S seconds, "
        "then exit (uvicorn's graceful shutdown; default 30)",
    )  # fmt: skip


def add_engine_flags(slots: argparse.ArgumentParser) -> None:
    """The flags that make an ``EngineConfig`` (``engine_config``), named like llama-server's."""
    slots.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=8192,
        help="TOTAL context in tokens (default 8192): shared by the slots on a unified KV cache, else split between them",
    )
    slots.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=-1,
        help="number of slots (default -1 = auto: 4 slots on a unified KV cache, as llama-server)",
    )
    slots.add_argument(
        "-kvu",
        "--kv-unified",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one KV cache shared by all slots, each may use all of -c (default: on with -np auto, off with -np N); "
        "--no-kv-unified: a KV stream of -c / -np per slot",
    )
    slots.add_argument("-b", "--batch-size", type=int, default=2048, help="max tokens per llama_decode (default 2048)")
    slots.add_argument(
        "--step-tokens",
        type=int,
        default=DEFAULT_STEP_TOKENS,
        metavar="N",
        help=f"token budget of one engine step: running streams first, then prompt chunks, so a burst of "
        f"long prompts does not stall them (default {DEFAULT_STEP_TOKENS}; 0: up to -b, as llama-server)",
    )
    slots.add_argument(
        "--scheduling-policy",
        choices=POLICIES,
        default=LlamaServerPolicy.name,
        help="llmkit's own: who goes first and which slot a request gets: llama-server's rules (default), "
        "shortest-prompt, fair-share (among X-Tenant headers), priority (the request's priority field, lower first; "
        "a request may preempt a running one of a lower priority), lpm (SGLang's longest prefix match: the most of its "
        "prompt cached first)",
    )


def add_kv_cache_flags(slots: argparse.ArgumentParser) -> None:
    """The KV cache's flags: the prompt cache in RAM, cache reuse, context shift (chapter 5)."""
    slots.add_argument(
        "--cache-ram", type=int, default=8192, metavar="MIB", help="host-RAM prompt cache size in MiB (default 8192, 0: off, -1: no limit)"
    )
    slots.add_argument(
        "--cache-idle-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="copy idle slots to the prompt cache when a request starts (default on)",
    )
    slots.add_argument(
        "--cache-reuse",
        type=int,
        default=0,
        metavar="N",
        help="move cached chunks of at least N tokens into place instead of reading them again (default 0: off)",
    )
    slots.add_argument(
        "--context-shift",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="when a generation fills its slot, drop tokens after n_keep and go on (default off)",
    )
    slots.add_argument(
        "--kv-events", nargs="?", const="", default=None, metavar="PORT|tcp://HOST:PORT",
        help="llmkit's own: publish what the slots and the prompt cache hold as KV events over ZMQ, for a router's kv_aware "
        "policy (vLLM's format; GET /kv_event_sources says where; no value: a free port on --host)",
    )  # fmt: skip
    slots.add_argument("--kv-block-size", type=int, default=16, metavar="N", help="tokens per block of the KV events (default 16)")
    slots.add_argument(
        "--kv-share", action="store_true",
        help="llmkit's own (needs -kvu): a request takes the KV cells of its longest prefix any slot holds, busy or idle, "
        "instead of reading them (SGLang's radix cache on llama.cpp's unified cache; default off: llama-server's per-slot cache)",
    )  # fmt: skip
    slots.add_argument(
        "--pd-peers", nargs="+", default=[], metavar="URL",
        help="llmkit's own: the prefill workers (http://HOST:PORT) this decode worker takes KV cells from in vllm-router's "
        "PD mode; a request naming any other is a 400 (default: none)",
    )  # fmt: skip


def add_speculative_flags(slots: argparse.ArgumentParser) -> None:
    """Draft-free speculative decoding, llama-server's flags and defaults (``SpecParams``)."""
    modes = "{" + ",".join(t.value for t in SpecType) + "}"
    slots.add_argument(
        "--spec-type", type=SpecType, choices=list(SpecType), default=SpecType.NONE, metavar=modes,
        help="guess the next tokens from n-grams of the slot's own text (default none)",
    )  # fmt: skip
    defaults = SpecParams()
    for name, help_text in (
        ("ngram_simple_size_n", "ngram-simple: tokens that must match"),
        ("ngram_simple_size_m", "ngram-simple: tokens drafted at most"),
        ("ngram_mod_n_match", "ngram-mod: tokens hashed to find the next one"),
        ("ngram_mod_n_min", "ngram-mod: a shorter draft is none"),
        ("ngram_mod_n_max", "ngram-mod: tokens drafted at most"),
    ):
        default = getattr(defaults, name)
        flag = "--spec-" + name.replace("_", "-")
        slots.add_argument(flag, type=int, default=default, metavar="N", help=f"{help_text} (default {default})")
    slots.add_argument(
        "--spec-slow-start", type=int, default=defaults.slow_start, metavar="N",
        help="llmkit's own: a request's first draft is at most N tokens, each next one at most twice what the last one kept "
        "(default 0: every draft as long as the mode drafts, as llama-server)",
    )  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    speculative = SpecParams(**{f.name: getattr(args, "spec_" + f.name) for f in fields(SpecParams)})  # --spec-<field>
    return EngineConfig(
        n_parallel=args.parallel, n_ctx=args.ctx_size, n_batch=args.batch_size, n_threads=args.threads, kv_unified=args.kv_unified,
        step_tokens=args.step_tokens, cache_ram_mib=args.cache_ram, cache_idle_slots=args.cache_idle_slots,
        cache_reuse=args.cache_reuse, context_shift=args.context_shift, speculative=speculative,
        policy=POLICIES[args.scheduling_policy](), kv_events=args.kv_events is not None, kv_block_size=args.kv_block_size,
        kv_share=args.kv_share,
    )  # fmt: skip


def add_translate_parser(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("translate", help="stream a translation from a running sequential server")
    tr.add_argument("text")
    tr.add_argument("--to", default="ja", help="target language (default ja)")
    tr.add_argument("--url", default="http://127.0.0.1:8080")


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


def add_upstream_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("upstream", help="the llama.cpp that llmkit runs: llama-server's source and binary")
    actions = up.add_subparsers(dest="action", required=True)
    find = actions.add_parser("find", help="print a C++ function, method, struct or enum by name, with line numbers")
    find.add_argument("name", help="e.g. get_available_slot, server_queue::start_loop, server_slot")
    find.add_argument("--all", action="store_true", help="every definition of that name (overloads, several classes)")
    actions.add_parser("build", help="build llama-server from that source (once, ~7 min on 2 cores) and print its path")
    actions.add_parser("path", help="fetch the source if needed and print where it is")


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
    for p in (check, cap):
        p.add_argument("--policy", nargs="+", default=None, help="router policies (default: all five; check: cache_aware)")
        p.add_argument("--cost", default=None, help="a calibration JSON (default: the one shipped, measured on a 2-core VM)")
        p.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")


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


def serve_sequential(args: argparse.Namespace) -> None:
    import uvicorn

    from llmkit.sequential.app import create_app
    from llmkit.sequential.translator import Translator

    path = models.resolve_model(args.model)
    translator = Translator(
        path, n_ctx=args.ctx_size, temperature=args.temp, seed=args.seed, max_tokens=args.n_predict, n_threads=args.threads
    )
    logging.getLogger("llmkit").info("model %s loaded (%s)", path.name, translator.model.desc())
    # uvicorn handles SIGINT/SIGTERM: it stops accepting connections, lets running streams
    # finish (tests/test_sequential.py shows it), then exits.
    uvicorn.run(create_app(translator), host=args.host, port=args.port, log_config=None)


def serve_slots(args: argparse.Namespace) -> int:
    import uvicorn

    from llmkit.engine import Engine, RequestParams
    from llmkit.server import Settings, create_app
    from llmkit.server.handoff import peer
    from llmkit.server.kv_publisher import endpoint_of

    path = models.resolve_model(args.model)  # a bad path fails here, before the server starts
    config = engine_config(args)
    try:
        config.resolved()  # the engine's own check, before the server starts
        kv_events = None if args.kv_events is None else endpoint_of(args.kv_events, args.host)
        pd_peers = frozenset(map(peer, args.pd_peers))
    except ValueError as exc:
        print(f"llmkit: error: {exc}", file=sys.stderr)
        return 2

    def load() -> Engine:
        try:
            return Engine(path, config)
        except BaseException:
            server.should_exit = True  # llama-server exits when the model does not load: so do we
            raise

    # what a request leaves out
    defaults = RequestParams.of(max_tokens=args.n_predict, temperature=args.temp, seed=args.seed, ignore_eos=args.ignore_eos)
    settings = Settings(
        alias=args.alias, api_key=args.api_key, defaults=defaults, metrics=args.metrics, slots=args.slots,
        max_body_size=args.max_body_size, n_threads=args.threads, sse_ping_interval=args.sse_ping_interval, kv_events=kv_events,
        pd_peers=pd_peers,
    )  # fmt: skip
    app = create_app(load, settings)  # /health answers 503 until load() returns
    # access_log=False: the app logs one line per request itself, with token counts. http="h11": it writes a header's
    # name as the app spells it (/metrics' Process-Start-Time-Unix, as llama-server), where httptools lowers every
    # name; measured here, ~3 us more per streamed event, against the ~7 ms of a decode step.
    # SIGTERM (a rolling restart) drains: uvicorn closes its socket, so a router's health check and retries go to the
    # other replicas, lets the running requests finish for up to --drain-timeout seconds, then stops the engine
    http = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False, http="h11",
                          timeout_graceful_shutdown=args.drain_timeout)  # fmt: skip
    server = uvicorn.Server(http)
    server.run()
    return 1 if app.state.server.load_error is not None else 0


def translate(args: argparse.Namespace) -> int:
    with course_imports("translate"):
        from llmkit.course.client import stream_translation

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request line between the translation and an error
    result = stream_translation(args.url, args.text, args.to, on_piece=lambda piece: print(piece, end="", flush=True))
    if result.pieces:
        print()
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    return 0


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
        users = sim.scaled_trace(args.users, args.rate, args.seed)
        print(sim.capacity_markdown(sim.capacity_table(users, args.policy or list(sim.POLICIES), args.slo, args.curve, cost=cost)))
    return 0


def exercises_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    with course_imports("exercises"):
        from llmkit.course.exercises import cage, classroom, done

    if args.action == "student":
        written = classroom.student_edition(Path(args.out), Path(args.notebooks) if args.notebooks else None)
        print(f"{len(written)} notebooks without their solutions in {args.out}/")
    elif args.action == "grade":
        submissions = classroom.grade(Path(args.folder), Path(args.out), cell_timeout=args.cell_timeout, total_timeout=args.timeout)
        out = Path(args.out)
        print(f"{len(submissions)} notebooks graded: {out / 'grades.csv'}, {out / 'grades.html'} (cage: {cage.kind()})")
    else:
        print(done.text())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        if args.command == "serve" and args.kind == "sequential":
            serve_sequential(args)
        elif args.command == "serve" and args.kind == "slots":
            return serve_slots(args)
        elif args.command == "translate":
            return translate(args)
        elif args.command == "bench":
            return bench(args)
        elif args.command == "upstream":
            return upstream_command(args)
        elif args.command == "fleet":
            return fleet_command(args)
        elif args.command == "sim":
            return sim_command(args)
        elif args.command == "exercises":
            return exercises_command(args)
    except models.ModelFileError as exc:
        print(f"llmkit: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
