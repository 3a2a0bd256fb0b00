"""The shape of one bench scenario (``Scenario``), the servers the first ones share (``Stage``), and what a run
measured (``Measured``: each scenario's results under its name).

A scenario is a module of ``bench/scenarios/`` that ends with its ``SCENARIO``: its name, how it runs, its section of
results.md and its targets; ``scenarios.SCENARIOS`` lists them in the order a run takes them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from llmkit.course.bench.config import Config
from llmkit.course.bench.servers import Server, start_servers
from llmkit.course.bench.targets import Target

R = TypeVar("R")  # a scenario's results: a dataclass, or a list of them (one per server, level, ...)
Measured = dict[str, Any]  # scenario name -> its results, for each scenario that ran


class Stage:
    """The servers started together (``servers.start_servers``: sequential, slots, no budget, llama-server and the
    ``--url`` ones), started when a scenario first asks for them and stopped, with whatever a scenario put on
    ``stack``, before the scenarios that start servers of their own run."""

    def __init__(self, cfg: Config, stack: contextlib.ExitStack):
        self.cfg, self.stack = cfg, stack

    @functools.cached_property
    def servers(self) -> list[Server]:
        return start_servers(self.cfg, self.stack)


@dataclass(frozen=True)
class Scenario(Generic[R]):
    """One scenario: what ``llmkit bench`` runs, writes and judges of it."""

    name: str  # its --skip name, and its key in Measured and results.json
    run: Callable[[Config, Stage], R]  # its results (every server's, every level's)
    section: Callable[[R, Config], str]  # its part of results.md: a heading, what was done, its table
    targets: Callable[[R | None, Config], list[Target]]  # judged on its results (None: not measured; a target says so)
    wanted: Callable[[Config], bool] = lambda cfg: True  # whether the config asks for it (a count of 0: no)
    shared: bool = False  # runs on the Stage's servers, before the scenarios that start their own

    def chosen(self, cfg: Config) -> bool:
        return self.name not in cfg.skip and self.wanted(cfg)
