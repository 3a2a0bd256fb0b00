"""What every scenario's targets are made of: a ``Target`` is one line of results.md's targets table, judged on ratios
measured in the same run (a slower or busier machine moves both sides of a ratio alike). Each scenario computes its own
(``Scenario.targets``, in its module, each threshold a named constant just above the function that uses it, with what
it is and why that number); ``scenarios.judge`` collects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class OfServer(Protocol):
    @property
    def server(self) -> str: ...


S = TypeVar("S", bound=OfServer)  # one server's result in a scenario: PrefixReuse, KvCache, ...


def fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def percent(share: float | None, spec: str = ".0f") -> str:
    return fmt(None if share is None else 100 * share, spec, " %")


@dataclass(frozen=True)
class Target:
    """One line of the targets table: what is aimed at (its threshold in the words), what this run measured, the verdict."""

    name: str
    measured: str  # the number as shown, with what explains it ("not measured": this run has no such number)
    ok: bool | None  # met or not; None: not judged (not measured, or within this run's own noise)
    info: bool = False  # a number shown beside the targets, never judged

    @property
    def verdict(self) -> str:
        """PASS, FAIL, n/a (not judged) or info."""
        if self.info:
            return "info"
        return "n/a" if self.ok is None else "PASS" if self.ok else "FAIL"


def unmeasured(name: str) -> Target:
    return Target(name, "not measured", None)


def info(name: str, measured: str) -> Target:
    return Target(name, measured, None, info=True)


def result_of(results: Sequence[S], server: str) -> S | None:
    """The result of ``server`` in one scenario's ``results``, or None."""
    return next((r for r in results if r.server == server), None)
