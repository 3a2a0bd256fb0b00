"""The runtime's commands: ``serve sequential``, ``serve slots`` (its flags named like llama-server's, the engine's
in ``add_engine_flags``, read back by ``engine_config``) and ``translate``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from llmkit import models
from llmkit.cli.course import course_imports
from llmkit.engine import plugins
from llmkit.engine.config import DEFAULT_STEP_TOKENS, PLUG_INS, EngineConfig
from llmkit.engine.policy import POLICIES, LlamaServerPolicy
from llmkit.engine.speculative import SpecParams, SpecType


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """``serve sequential``, ``serve slots`` and ``translate``."""
    add_serve_parsers(sub)
    add_translate_parser(sub)


def add_serve_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server").add_subparsers(dest="kind", required=True)
    seq = serve.add_parser("sequential", help="the tutorial's translation server: one request at a time")
    add_common_server_flags(seq)
    seq.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size in tokens (default 2048)")
    seq.add_argument("--temp", type=float, default=0.3, help="sampling temperature (default 0.3, 0 = greedy)")
    seq.add_argument("-n", "--n-predict", type=int, default=-1, help="max tokens per translation (-1: no limit)")
    seq.set_defaults(run=serve_sequential)

    slots = serve.add_parser("slots", help="the OpenAI-compatible slot server: continuous batching over -np slots")
    add_common_server_flags(slots)
    add_engine_flags(slots)
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
    slots.set_defaults(run=serve_slots)


def add_common_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF file (default: $LLMKIT_MODEL, else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def add_translate_parser(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("translate", help="stream a translation from a running sequential server")
    tr.add_argument("text")
    tr.add_argument("--to", default="ja", help="target language (default ja)")
    tr.add_argument("--url", default="http://127.0.0.1:8080")
    tr.set_defaults(run=translate)


def add_engine_flags(slots: argparse.ArgumentParser) -> None:
    """The flags that make an ``EngineConfig`` (``engine_config``), named like llama-server's: the slots, the step,
    the scheduling policy, the KV cache's and speculative decoding's (each flag the engine reads is added here)."""
    add_kv_cache_flags(slots)
    add_speculative_flags(slots)
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
    add_plug_in_flags(slots)


def plug_in(builtins: dict[str, Any], kind: str, *, make: bool) -> Callable[[str], Any]:
    """An argparse type: a built-in ``kind`` by name, or your own as ``package.module:Name`` (``engine.plugins``); with
    ``make``, called with no arguments (a policy, a drafter), else taken as it is (a class or function the engine calls)."""

    def parse(spec: str) -> Any:
        try:
            found = plugins.find(spec, builtins, kind)
            return found() if make else found
        except Exception as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = kind
    return parse


def add_plug_in_flags(slots: argparse.ArgumentParser) -> None:
    """The engine's seams (``EngineConfig``'s plug-ins), each reported by name in /props: llmkit's own flags."""
    slots.add_argument(
        "--scheduling-policy",
        type=plug_in(POLICIES, "scheduling policy", make=True),
        default=LlamaServerPolicy.name,
        metavar="NAME|module:Class",
        help="llmkit's own: who goes first and which slot a request gets: llama-server's rules (default), "
        "shortest-prompt, fair-share (among X-Tenant headers), priority (the request's priority field, lower first; "
        "a request may preempt a running one of a lower priority), lpm (SGLang's longest prefix match: the most of its "
        "prompt cached first), or your own Policy class",
    )
    own = "llmkit's own: package.module:Name of your own"
    slots.add_argument(
        "--drafter",
        type=plug_in({}, "drafter", make=True),
        metavar="module:Class",
        help=f"{own} drafter class, made with no arguments (its n_max, or --spec-type's, bounds a draft)",
    )
    slots.add_argument(
        "--sampler",
        type=plug_in({}, "sampler", make=False),
        metavar="module:Name",
        help=f"{own} sampler: called with (model, SamplingParams) for each request (default llmkit.sampling.Sampler)",
    )
    slots.add_argument(
        "--stop-matcher",
        type=plug_in({}, "stop matcher", make=False),
        metavar="module:Name",
        help=f"{own} stop-string matcher: called with each request's stop strings (default llmkit.text.StopMatcher)",
    )
    slots.add_argument("--cache-choice", type=plug_in({}, "cache choice", make=False), metavar="module:Name",
                       help=f"{own} rule of the prompt cache: (entries, held, prompt) -> an entry's index or None")  # fmt: skip


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
        "--kv-resident", type=int, default=16, metavar="N",
        help="llmkit's own, with --kv-share: up to N prefixes no slot holds stay in the KV cache, until it needs the room (default 16)",
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
        policy=args.scheduling_policy, kv_events=args.kv_events is not None, kv_block_size=args.kv_block_size,
        kv_share=args.kv_share, kv_resident=args.kv_resident,
        **{name: given for name in PLUG_INS if name != "policy" and (given := getattr(args, name)) is not None},
    )  # fmt: skip


def serve_sequential(args: argparse.Namespace) -> int:
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
    return 0


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
