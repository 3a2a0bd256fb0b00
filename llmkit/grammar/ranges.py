"""Numeric ranges as GBNF: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``.

Integers: llama.cpp's ``build_min_max_int`` (common/json-schema-to-grammar.cpp),
ported; llama-cpp-python's Python converter ignores the bounds.

Numbers: llama.cpp ignores the bounds on ``number`` (a schema ``{"type": "number",
"maximum": 10}`` can get 30); llmkit builds them into the grammar as well. Why a
grammar and not a check of the answer (reject, generate again): a check comes
after the tokens are streamed and cannot take them back, a second try costs a
whole answer and may fail again, and the slot would need a retry loop; a grammar
makes every answer valid as it is written, streamed or not, at no cost per token.
The construction reads the number as integer part and fraction:

- an integer part strictly between the bounds' integer parts takes any fraction
  (its integers are a range: ``int_range``, as for integers);
- the integer part of a bound takes only fractions on the right side of the
  bound's fraction, compared digit by digit (``_fraction``);
- negative numbers are "-" and a magnitude, the bounds swapped.

Exact for the decimal text (the bounds are read as decimals, ``0.1`` is 1/10).
What the grammar leaves out: exponents (``1e3``; every number in range is
written in plain digits), and, as llama.cpp's number rule, more than 16 digits
before the point and about as many after it. A reader that parses the text into binary floats may
round a value of 17 or more significant digits onto an exclusive bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from decimal import Decimal
from typing import NamedTuple

from llmkit.grammar.limits import GrammarError

DIGITS = 16  # at most, before and after the point (llama.cpp's integral-part and decimal-part)
ANY_FRACTION = '("." [0-9]{1,16})?'

BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def int_range(lo: int | None, hi: int | None) -> str:
    """GBNF for the decimal integers in [lo, hi], either end open (build_min_max_int in C++).

    C++ writes it as one function with lambdas; here each case is named: ``_between`` for two
    bounds, ``_at_least`` or ``_at_most`` for one, all built of digit classes ("[3-7]") and runs
    of free digits ("[0-9]{2,15}").
    """
    if lo is not None and hi is not None:
        return _between(lo, hi)
    if lo is not None:
        return _at_least(lo, DIGITS, top_level=True)
    if hi is not None:
        return _at_most(hi, DIGITS, top_level=True)
    raise ValueError("an integer range needs a minimum or a maximum")


def _digit_range(a: str, b: str) -> str:
    """One digit from ``a`` to ``b``: "[3-7]", or "[3]" for one."""
    return f"[{a}]" if a == b else f"[{a}-{b}]"


def _more_digits(min_d: int, max_d: int) -> str:
    """``min_d`` to ``max_d`` free digits: "[0-9]", "[0-9]{3}", "[0-9]{0,15}"."""
    if min_d == max_d == 1:
        return "[0-9]"
    return "[0-9]{" + str(min_d) + ("" if max_d == min_d else f",{max_d}") + "}"


def _between(lo: int, hi: int) -> str:
    """The integers in [lo, hi]: negatives as "-" and their magnitudes, then one range per number of digits
    (10..99, 100..999, ...), each of numbers written with the same number of digits."""
    if lo < 0 and hi < 0:
        return f'"-" ({_between(-hi, -lo)})'
    alts = []
    if lo < 0:
        alts.append(f'"-" ({_between(0, -lo)})')
        lo = 0
    lo_s, hi_s = str(lo), str(hi)
    for digits in range(len(lo_s), len(hi_s)):
        alts.append(_same_length_range(lo_s, "9" * digits))
        lo_s = "1" + "0" * digits
    alts.append(_same_length_range(lo_s, hi_s))
    return " | ".join(alts)


def _same_length_range(a: str, b: str) -> str:
    """The integers from ``a`` to ``b``, digit strings of one length (uniform_range in C++): the digits
    they share, as they are, then what may follow from the first digit where they differ."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    parts = [f'"{a[:i]}"'] if i > 0 else []
    if i < len(a):
        parts.append(_from_first_difference(a[i:], b[i:]) if len(a) - i > 1 else f"[{a[i]}-{b[i]}]")
    return " ".join(parts)


def _from_first_difference(a: str, b: str) -> str:
    """The integers from ``a`` to ``b`` (one length, more than one digit, ``a[0] < b[0]``): those that start
    with a's first digit, those that start with a digit between (any rest), those that start with b's."""
    first_a, first_b, rest_a, rest_b = a[0], b[0], a[1:], b[1:]
    n = len(rest_a)
    zeros, nines = "0" * n, "9" * n
    alts = []
    b_covered = False  # b's first digit already among the middle ones (its rest is all nines)
    if rest_a == zeros:  # a's first digit takes any rest: it joins the middle ones
        alts.append(f"{_digit_range(first_a, str(int(first_b) - 1))} {_more_digits(n, n)}")
    else:
        alts.append(f"[{first_a}] ({_same_length_range(rest_a, nines)})")
        if int(first_a) < int(first_b) - 1:
            b_covered = rest_b == nines
            last = first_b if b_covered else str(int(first_b) - 1)
            alts.append(f"{_digit_range(str(int(first_a) + 1), last)} {_more_digits(n, n)}")
    if not b_covered:
        alts.append(f"{_digit_range(first_b, first_b)} {_same_length_range(zeros, rest_b)}")
    return "(" + " | ".join(alts) + ")"


def _at_least(lo: int, decimals_left: int, top_level: bool) -> str:
    """The integers from ``lo`` up, of at most ``decimals_left`` digits; ``top_level`` false: the digits that
    follow a first digit already written (so they may start with 0)."""
    less = max(decimals_left - 1, 1)
    if lo < 0:
        return f'"-" ({_at_most(-lo, decimals_left, top_level=False)}) | [0] | [1-9] {_more_digits(0, decimals_left - 1)}'
    if lo == 0:
        return f"[0] | [1-9] {_more_digits(0, less)}" if top_level else _more_digits(1, decimals_left)
    if lo <= 9:  # a smaller first digit and more digits after it, or lo's digit or larger and any digits after it
        start = "1" if top_level else "0"
        longer = [f"{_digit_range(start, str(lo - 1))} {_more_digits(1, less)}"] if str(lo) > start else []
        return " | ".join([*longer, f"{_digit_range(str(lo), '9')} {_more_digits(0, less)}"])
    return _at_least_many_digits(str(lo), less, top_level)


def _at_least_many_digits(lo_s: str, less: int, top_level: bool) -> str:
    """The integers from ``lo_s`` (two digits or more) up: a smaller first digit and more digits than lo,
    lo's first digit and the rest of lo or above, a larger first digit and as many digits as lo or more."""
    c, n = lo_s[0], len(lo_s)
    alts = []
    if c > "1":
        alts.append(f"{_digit_range('1' if top_level else '0', str(int(c) - 1))} {_more_digits(n, less)}")
    alts.append(f"{_digit_range(c, c)} ({_at_least(int(lo_s[1:]), less, top_level=False)})")
    if c < "9":
        alts.append(f"{_digit_range(str(int(c) + 1), '9')} {_more_digits(n - 1, less)}")
    return " | ".join(alts)


def _at_most(hi: int, decimals_left: int, top_level: bool) -> str:
    """The integers up to ``hi`` (negatives of at most ``decimals_left`` digits); ``top_level`` false, with
    ``hi`` >= 0: from 0 only, the magnitudes under a "-" that the caller wrote."""
    if hi < 0:
        return f'"-" ({_at_least(-hi, decimals_left, top_level=False)})'
    negatives = f'"-" [1-9] {_more_digits(0, max(decimals_left - 1, 1))} | ' if top_level else ""
    return negatives + _between(0, hi)


def _bound(schema: dict, key: str, integer: bool) -> int | float | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GrammarError(f"'{key}' must be a number, got {json.dumps(value)}")
    if integer and not abs(value) < 2**63:  # as llama.cpp (int64); NaN fails this too
        raise GrammarError(f"'{key}' must be a 64-bit integer, got {value}")
    if not math.isfinite(value):
        raise GrammarError(f"'{key}' must be a finite number, got {value}")
    return value


def int_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The smallest and largest integer ``schema`` allows (None: no bound); both exclusive and inclusive count."""

    def read(key: str, to_int: Callable[[float], int]) -> int | None:
        value = _bound(schema, key, True)
        return None if value is None else to_int(value)

    lows = [read("minimum", math.ceil), read("exclusiveMinimum", lambda v: math.floor(v) + 1)]
    highs = [read("maximum", math.floor), read("exclusiveMaximum", lambda v: math.ceil(v) - 1)]
    lo = max((b for b in lows if b is not None), default=None)
    hi = min((b for b in highs if b is not None), default=None)
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(f"no integer is between the minimum ({lo}) and the maximum ({hi})")
    return lo, hi


class Bound(NamedTuple):
    value: Decimal
    exclusive: bool


def number_bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """The tighter lower and upper bound of ``schema`` (an exclusive one wins a tie), as exact decimals."""

    def read(key: str, exclusive: bool) -> Bound | None:
        value = _bound(schema, key, False)
        return None if value is None else Bound(Decimal(repr(value)), exclusive)

    lows = [b for b in (read("minimum", False), read("exclusiveMinimum", True)) if b is not None]
    highs = [b for b in (read("maximum", False), read("exclusiveMaximum", True)) if b is not None]
    lo = max(lows, default=None)  # (value, exclusive): at the same value, the exclusive one is the higher
    hi = min(highs, key=lambda b: (b.value, not b.exclusive), default=None)
    return lo, hi


def number_range(lo: Bound | None, hi: Bound | None) -> str:
    """GBNF for the JSON numbers (no exponent) between ``lo`` and ``hi`` (None: that side is open)."""
    alts = []
    if lo is None or lo.value < 0:  # negative: "-" and a magnitude above 0 (0 itself is written "0")
        mag_lo = Bound(-hi.value, hi.exclusive) if hi is not None and hi.value < 0 else Bound(Decimal(0), True)
        mag_hi = None if lo is None else Bound(-lo.value, lo.exclusive)
        if (magnitude := _magnitude(mag_lo, mag_hi)) is not None:
            alts.append(f'"-" ({magnitude})')
    if hi is None or hi.value > 0 or (hi.value == 0 and not hi.exclusive):
        nonneg_lo = lo if lo is not None and lo.value >= 0 else Bound(Decimal(0), False)
        if (magnitude := _magnitude(nonneg_lo, hi)) is not None:
            alts.append(magnitude)
    if not alts:
        shown = " and ".join(
            f"{'exclusive ' if b.exclusive else ''}{side} {b.value}" for side, b in (("minimum", lo), ("maximum", hi)) if b
        )
        raise GrammarError(f"no number (of at most {DIGITS} digits before the point) fits the {shown}")
    return " | ".join(alts)


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal as its integer part and its fraction's digits: 2.50 -> (2, "5")."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _magnitude(lo: Bound, hi: Bound | None) -> str | None:
    """GBNF for the non-negative numbers between ``lo`` (>= 0) and ``hi``; None if none can be written."""
    top = 10**DIGITS  # integer parts stay below this
    lo_int, lo_frac = _split(lo.value)
    if lo_int >= top:
        return None
    if hi is not None and _split(hi.value)[0] >= top:
        hi = None  # beyond every number the grammar writes
    alts: list[str | None] = []  # None: that part holds no number
    if hi is None:
        alts.append(f"({int_range(lo_int + 1, None)}) {ANY_FRACTION}")
        alts.append(_with_fraction(lo_int, _fraction(lo_frac, lo.exclusive, None, False)))
    else:
        hi_int, hi_frac = _split(hi.value)
        if lo_int == hi_int:
            alts.append(_with_fraction(lo_int, _fraction(lo_frac, lo.exclusive, hi_frac, hi.exclusive)))
        elif lo_int < hi_int:
            if lo_int + 1 <= hi_int - 1:  # integer parts strictly inside: any fraction
                alts.append(f"({int_range(lo_int + 1, hi_int - 1)}) {ANY_FRACTION}")
            alts.append(_with_fraction(lo_int, _fraction(lo_frac, lo.exclusive, None, False)))
            alts.append(_with_fraction(hi_int, _fraction(None, False, hi_frac, hi.exclusive)))
    kept = [a for a in alts if a is not None]
    return " | ".join(kept) if kept else None


def _with_fraction(integer: int, fraction: str | None) -> str | None:
    return None if fraction is None else f'"{integer}" {fraction}'.rstrip()


def _fraction(a: str | None, a_exclusive: bool, b: str | None, b_exclusive: bool) -> str | None:
    """GBNF for what may follow an integer part: nothing, or "." and 1 to 16 digits d, where the
    fraction 0.d is above 0.a and below 0.b (digit strings; None: that side is open). None if nothing fits.

    Digit by digit, as long as d has followed a bound's digits exactly, the next digit may not pass
    that bound's next digit (a bound past its last digit goes on with zeros); once it differs, the
    rest is free. Stopping is allowed when the zeros that follow keep d inside both bounds.
    """
    fraction = _Fraction(a_exclusive, b_exclusive)
    after_point = fraction.digits(a, b, DIGITS, stop=False)
    if after_point is None:
        return "" if fraction.may_stop(a, b) else None
    return f'("." {after_point})?' if fraction.may_stop(a, b) else f'"." {after_point}'


class _Fraction(NamedTuple):
    """``_fraction``'s digit-by-digit construction, for bounds each exclusive or not (a and b: their digits left)."""

    a_exclusive: bool
    b_exclusive: bool

    def may_stop(self, a: str | None, b: str | None) -> bool:
        """Whether the digits written so far may end here: 0.d000... is still inside both bounds."""
        above = a is None or (not a.strip("0") and not self.a_exclusive)  # 0.d000... >= 0.a
        below = b is None or not self.b_exclusive or bool(b.strip("0"))  # 0.d000... <= 0.b
        return above and below

    def digits(self, a: str | None, b: str | None, n: int, stop: bool) -> str | None:
        """GBNF for at most ``n`` more digits inside the bounds (with ``stop``, none at all may do); None if nothing fits."""
        if a == "" and not self.a_exclusive:
            a = None  # on the lower bound already: whatever follows stays above it
        if b == "":  # on the upper bound: only zeros may follow (nothing, past an exclusive one)
            if self.b_exclusive or a:
                return None
            return f'"0"{{{0 if stop else 1},{n}}}' if n else "" if stop else None
        if a == "" and b is None:  # just on an exclusive lower bound: some digit must be above 0
            if not n:
                return None
            return (f'"0"{{0,{n - 1}}} [1-9] [0-9]{{0,{n - 1}}}') if n > 1 else "[1-9]"
        alts = self.next_digit(a, b, n) if n > 0 else []
        stops = stop and self.may_stop(a, b)
        if not alts:
            return "" if stops else None
        body = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
        return f"({body})?" if stops else body

    def next_digit(self, a: str | None, b: str | None, n: int) -> list[str]:
        """The ways on from the next digit: one between the bounds' digits (the rest free), or either bound's digit."""
        low = int(a[0]) if a else 0  # the lower bound's next digit (0 past its end, or if open)
        high = 9 if b is None else int(b[0]) if b else 0
        free_low, free_high = low + (a is not None), high - (b is not None)
        alts = []
        if free_low <= free_high:  # passes the tight bounds: the rest is free
            rest = f" [0-9]{{0,{n - 1}}}" if n > 1 else ""
            alts.append(f"[{free_low}-{free_high}]{rest}" if free_low < free_high else f"[{free_low}]{rest}")
        # the lower bound's digit: still tight on it
        tight_b = b[1:] if b is not None and low == high else None
        if a is not None and low <= high and (sub := self.digits(a[1:], tight_b, n - 1, True)) is not None:
            alts.append(f'"{low}" {sub}'.rstrip())
        # the upper bound's digit: still tight on it
        if b is not None and (a is None or high > low) and (sub := self.digits(None, b[1:], n - 1, True)) is not None:
            alts.append(f'"{high}" {sub}'.rstrip())
        return alts
