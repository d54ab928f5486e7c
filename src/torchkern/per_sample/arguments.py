"""Argument checks of the per_sample API: a ValueError naming the argument and what was expected."""

from __future__ import annotations

import math
import numbers


def fail(message: str):
    raise ValueError(f"torchkern.per_sample: {message}")


def real(name: str, value: object, low: float, high: float = math.inf, *, low_open: bool = True,
         high_open: bool = False) -> float:
    """``value`` as a float if it is a finite real number (not a bool) within the bounds, else a ValueError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        if high == math.inf:
            bound = f"{'>' if low_open else '>='} {low:g}"
        else:
            bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        fail(f"{name} must be a finite real number {bound}, got {value!r}")
    return float(value)


def integer(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        fail(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
