"""Argument checks of the family's public classes (energies, samplers): each names the argument and what it must
be. The ops' own checks, shared with the kernels, are in ``twins.py``."""

from __future__ import annotations

import math
import numbers

INT64_MAX = (1 << 63) - 1  # the ops take int64: a larger count would not reach them


def real(name: str, value) -> float:
    """``value`` as a float; raises TypeError naming ``name`` for anything but a real number."""
    if type(value) is float or type(value) is int:  # the common case, without the ABC checks' ~1 us
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def finite(name: str, value) -> float:
    v = real(name, value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return v


def positive(name: str, value) -> float:
    v = real(name, value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return v


def non_negative(name: str, value) -> float:
    v = real(name, value)
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return v


def integer(name: str, value, low: int, high: int = INT64_MAX) -> int:
    """``value`` as an int in [low, high]; raises TypeError for a non-integer, ValueError naming the range."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {_power(high)}], got {value}")
    return int(value)


def _power(n: int) -> str:
    """2^k - 1 and 2^k as such (the bounds read as what they are)."""
    for k in range(1, 64):
        if n == 1 << k:
            return f"2^{k}"
        if n == (1 << k) - 1 and k > 8:
            return f"2^{k} - 1"
    return str(n)
