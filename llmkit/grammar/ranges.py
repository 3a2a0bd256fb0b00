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
    """GBNF for the decimal integers in [lo, hi], either end open (build_min_max_int in C++)."""
    out: list[str] = []
    w = out.append

    def digit_range(a: str, b: str) -> None:
        w(f"[{a}]" if a == b else f"[{a}-{b}]")

    def more_digits(min_d: int, max_d: int | None) -> None:
        w("[0-9]")
        if min_d == max_d == 1:
            return
        w("{" + str(min_d) + ("" if max_d == min_d else "," + ("" if max_d is None else str(max_d))) + "}")

    def uniform_range(a: str, b: str) -> None:  # a and b have the same number of digits
        i = 0
        while i < len(a) and i < len(b) and a[i] == b[i]:
            i += 1
        if i > 0:
            w(f'"{a[:i]}"')
        if i < len(a) and i < len(b):
            if i > 0:
                w(" ")
            sub_len = len(a) - i - 1
            if sub_len > 0:
                a_sub, b_sub = a[i + 1 :], b[i + 1 :]
                zeros, nines = "0" * sub_len, "9" * sub_len
                to_reached = False
                w("(")
                if a_sub == zeros:
                    digit_range(a[i], chr(ord(b[i]) - 1))
                    w(" ")
                    more_digits(sub_len, sub_len)
                else:
                    w(f"[{a[i]}] (")
                    uniform_range(a_sub, nines)
                    w(")")
                    if ord(a[i]) < ord(b[i]) - 1:
                        w(" | ")
                        if b_sub == nines:
                            digit_range(chr(ord(a[i]) + 1), b[i])
                            to_reached = True
                        else:
                            digit_range(chr(ord(a[i]) + 1), chr(ord(b[i]) - 1))
                        w(" ")
                        more_digits(sub_len, sub_len)
                if not to_reached:
                    w(" | ")
                    digit_range(b[i], b[i])
                    w(" ")
                    uniform_range(zeros, b_sub)
                w(")")
            else:
                w(f"[{a[i]}-{b[i]}]")

    def build(lo: int | None, hi: int | None, decimals_left: int = 16, top_level: bool = True) -> None:
        if lo is not None and hi is not None:
            if lo < 0 and hi < 0:
                w('"-" (')
                build(-hi, -lo, decimals_left, True)
                w(")")
                return
            if lo < 0:
                w('"-" (')
                build(0, -lo, decimals_left, True)
                w(") | ")
                lo = 0
            lo_s, hi_s = str(lo), str(hi)
            for digits in range(len(lo_s), len(hi_s)):
                uniform_range(lo_s, "9" * digits)
                lo_s = "1" + "0" * digits
                w(" | ")
            uniform_range(lo_s, hi_s)
            return
        less = max(decimals_left - 1, 1)
        if lo is not None:
            if lo < 0:
                w('"-" (')
                build(None, -lo, decimals_left, False)
                w(") | [0] | [1-9] ")
                more_digits(0, decimals_left - 1)
            elif lo == 0:
                if top_level:
                    w("[0] | [1-9] ")
                    more_digits(0, less)
                else:
                    more_digits(1, decimals_left)
            elif lo <= 9:
                c, start = str(lo), "1" if top_level else "0"
                if c > start:
                    digit_range(start, chr(ord(c) - 1))
                    w(" ")
                    more_digits(1, less)
                    w(" | ")
                digit_range(c, "9")
                w(" ")
                more_digits(0, less)
            else:
                lo_s = str(lo)
                c = lo_s[0]
                if c > "1":
                    digit_range("1" if top_level else "0", chr(ord(c) - 1))
                    w(" ")
                    more_digits(len(lo_s), less)
                    w(" | ")
                digit_range(c, c)
                w(" (")
                build(int(lo_s[1:]), None, less, False)
                w(")")
                if c < "9":
                    w(" | ")
                    digit_range(chr(ord(c) + 1), "9")
                    w(" ")
                    more_digits(len(lo_s) - 1, less)
            return
        if hi is not None:
            if hi >= 0:
                if top_level:
                    w('"-" [1-9] ')
                    more_digits(0, less)
                    w(" | ")
                build(0, hi, decimals_left, True)
            else:
                w('"-" (')
                build(-hi, None, decimals_left, False)
                w(")")
            return
        raise ValueError("an integer range needs a minimum or a maximum")

    build(lo, hi)
    return "".join(out)


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

    def may_stop(a: str | None, b: str | None) -> bool:
        above = a is None or (not a.strip("0") and not a_exclusive)  # 0.d000... >= 0.a
        below = b is None or not b_exclusive or bool(b.strip("0"))  # 0.d000... <= 0.b
        return above and below

    def digits(a: str | None, b: str | None, n: int, stop: bool) -> str | None:
        if a == "" and not a_exclusive:
            a = None  # on the lower bound already: whatever follows stays above it
        if b == "":  # on the upper bound: only zeros may follow (nothing, past an exclusive one)
            if b_exclusive or a:
                return None
            return f'"0"{{{0 if stop else 1},{n}}}' if n else "" if stop else None
        if a == "" and b is None:  # just on an exclusive lower bound: some digit must be above 0
            if not n:
                return None
            return (f'"0"{{0,{n - 1}}} [1-9] [0-9]{{0,{n - 1}}}') if n > 1 else "[1-9]"
        alts = []
        if n > 0:
            low = int(a[0]) if a else 0  # the lower bound's next digit (0 past its end, or if open)
            high = 9 if b is None else int(b[0]) if b else 0
            free_low, free_high = low + (a is not None), high - (b is not None)
            if free_low <= free_high:  # passes the tight bounds: the rest is free
                rest = f" [0-9]{{0,{n - 1}}}" if n > 1 else ""
                alts.append(f"[{free_low}-{free_high}]{rest}" if free_low < free_high else f"[{free_low}]{rest}")
            # the lower bound's digit: still tight on it
            tight_b = b[1:] if b is not None and low == high else None
            if a is not None and low <= high and (sub := digits(a[1:], tight_b, n - 1, True)) is not None:
                alts.append(f'"{low}" {sub}'.rstrip())
            # the upper bound's digit: still tight on it
            if b is not None and (a is None or high > low) and (sub := digits(None, b[1:], n - 1, True)) is not None:
                alts.append(f'"{high}" {sub}'.rstrip())
        if not alts:
            return "" if stop and may_stop(a, b) else None
        body = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
        return f"({body})?" if stop and may_stop(a, b) else body

    after_point = digits(a, b, DIGITS, stop=False)
    if after_point is None:
        return "" if may_stop(a, b) else None
    return f'("." {after_point})?' if may_stop(a, b) else f'"." {after_point}'
