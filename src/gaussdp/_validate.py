"""Boundary validation shared by every public function: one place, one message format."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from gaussdp.errors import InvalidParameter

__all__ = [
    "SetOnce",
    "check_choice",
    "check_counts",
    "check_delta",
    "check_epsilon",
    "check_nonnegative",
    "check_positive",
    "check_probability",
    "real_number",
]


def real_number(name: str, value: Any) -> float:
    """Return ``value`` as a float, refusing bools, complex numbers and non-numbers with TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})")
    out = float(value)
    if math.isnan(out) or math.isinf(out):
        raise InvalidParameter(f"{name} must be finite, got {name}={value!r}")
    return out


def check_positive(name: str, value: Any) -> float:
    """A finite real number > 0."""
    out = real_number(name, value)
    if out <= 0.0:
        raise InvalidParameter(f"{name} must be > 0, got {name}={value!r}")
    return out


def check_nonnegative(name: str, value: Any) -> float:
    """A finite real number >= 0 (NaN and infinities refused with the same message)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out) or out < 0.0:
        raise InvalidParameter(f"{name} must be finite and >= 0, got {name}={value!r}")
    return out


def check_epsilon(value: Any, name: str = "epsilon") -> float:
    """A finite epsilon > 0."""
    return check_positive(name, value)


def check_delta(value: Any, name: str = "delta") -> float:
    """A delta strictly inside (0, 1)."""
    out = real_number(name, value)
    if not 0.0 < out < 1.0:
        raise InvalidParameter(f"{name} must be in (0, 1), got {name}={value!r}")
    return out


def check_probability(name: str, value: Any) -> float:
    """A sampling probability in (0, 1]."""
    out = real_number(name, value)
    if not 0.0 < out <= 1.0:
        raise InvalidParameter(f"{name} must be in (0, 1], got {name}={value!r}")
    return out


def check_choice(name: str, value: Any, choices: Sequence[str]) -> Any:
    """One of ``choices`` (strings); InvalidParameter naming the argument otherwise.

    >>> check_choice("noise", "fast", ("secure", "fast"))
    'fast'
    >>> check_choice("noise", "numpy", ("secure", "fast"))
    Traceback (most recent call last):
    ...
    gaussdp.errors.InvalidParameter: noise must be 'secure' or 'fast', got noise='numpy'
    """
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise InvalidParameter(f"{name} must be {listed}, got {name}={value!r}")
    return value


class SetOnce:
    """Base for objects whose calibrated settings must not drift apart: each attribute named in
    ``_CALIBRATED`` may be assigned once (in ``__init__``), never reassigned.

    A release that clips to one bound while the noise or the charge was computed for another (say
    ``obj.clip_norm = 10`` after calibrating for 1) would print an epsilon that is not true.
    """

    _CALIBRATED: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._CALIBRATED and name in self.__dict__:
            raise AttributeError(
                f"{name} is fixed when the {type(self).__name__} is made (calibrated with the noise); "
                "make a new one"
            )
        object.__setattr__(self, name, value)


def check_counts(**named: Any) -> None:
    """Each keyword's value must be an int >= 1 (not a bool): sizes, steps, counts.

    Raises:
        InvalidParameter: naming the first argument that is not, with its value.
    """
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameter(f"{name} must be an integer >= 1, got {name}={value!r}")
