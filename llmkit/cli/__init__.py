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

from llmkit import models
from llmkit.cli import course, serve

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; each ends in ``set_defaults(run=handler)``, so ``main`` calls ``args.run(args)``."""
    parser = argparse.ArgumentParser(prog="llmkit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parsers(sub)
    course.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        return args.run(args)
    except models.ModelFileError as exc:
        print(f"llmkit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
