"""Privacy numbers for people: printed rounded the safe way, or exactly.

Every epsilon gaussdp prints is an upper bound, so a printed epsilon must not be below the number it
stands for: ``f"{eps:.6g}"`` rounds to nearest and prints 8.89523 for 8.895232137 (below it). The
helpers here round the *exact* binary value of a float (``decimal.Decimal(x)``) in the safe
direction and check the decimal string they return against it:

* :func:`format_upper`: upper bounds (epsilon, delta, a spent budget, a calibrated noise
  multiplier: more noise is the safe side), rounded up (toward +inf);
* :func:`format_lower`: lower bounds (an audit's empirical epsilon), rounded down;
* :func:`format_exact`: parameters echoed back as given (a target epsilon or delta, a sample rate,
  a clip norm, a budget): the shortest decimal that reads back as the very same float, so that
  anything recomputed from the printed text is recomputed from the same number;
* :func:`format_calibrated`: a calibrated noise multiplier printed for a user to type again: rounded
  up, and the printed value itself re-checked against the target.

Machine-readable outputs (``--json``, ``gaussdp_privacy.json``) keep full precision (the floats
themselves, which JSON writes as their shortest round-trip repr) and never go through these helpers.

Not-a-number is a numerical fault: every helper raises :class:`FloatingPointError` rather than print
it. Infinities print as ``inf`` / ``-inf`` (an infinite epsilon is a true, if useless, bound).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Any

__all__ = ["format_calibrated", "format_exact", "format_lower", "format_upper"]

DIGITS = 6  # significant digits of a printed privacy number, unless a caller asks for fewer


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if math.isnan(out):
        raise FloatingPointError(f"refusing to print {name}: it is not a number (a numerical fault)")
    return out


def _check_digits(digits: Any) -> int:
    if isinstance(digits, bool) or not isinstance(digits, numbers.Integral) or not 1 <= int(digits) <= 17:
        raise ValueError(f"digits must be an int in [1, 17], got digits={digits!r}")
    return int(digits)


def _g_style(value: Decimal, digits: int) -> str:
    """``value`` (at most ``digits`` significant digits) the way ``%g`` lays a float out, exactly."""
    value = value.normalize()  # no trailing zeros: "8.8" not "8.80000"
    exp = value.adjusted()
    if -4 <= exp < digits:
        return format(value, "f")
    sign, figures, _ = value.as_tuple()
    mantissa = str(figures[0]) + ("." + "".join(map(str, figures[1:])) if len(figures) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


def _rounded(value: float, digits: int, rounding: str) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0.0:
        return "0"
    exact = Decimal(value)  # the float's exact binary value, every digit of it
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.rounding = rounding
        text = _g_style(+exact, digits)  # unary plus rounds to ctx.prec digits, in ctx.rounding
    # The layout above is exact (Decimal to text); check anyway: a wrong direction is a privacy bug.
    back = Decimal(text)
    if (back < exact) if rounding == ROUND_CEILING else (back > exact):
        raise FloatingPointError(f"rounding {value!r} gave {text}, on the wrong side")  # pragma: no cover
    return text


def format_upper(value: Any, digits: int = DIGITS) -> str:
    """``value`` to ``digits`` significant digits, rounded UP: the decimal printed is >= the float.

    For upper bounds (epsilon, delta, a spent budget) and calibrated noise (more noise is safe).
    ``digits`` in [1, 17]; NaN raises :class:`FloatingPointError`; bools and non-numbers TypeError.

    >>> format_upper(8.895232137), f"{8.895232137:.6g}"
    ('8.89524', '8.89523')
    >>> format_upper(0.1 + 0.2, 3), format_upper(2.0), format_upper(float("inf"))
    ('0.301', '2', 'inf')

    The float nearest 0.1 lies above 0.1, so it prints above it (echo an input with
    :func:`format_exact` instead: its text reads back as the very same float):

    >>> format_upper(0.1), format_exact(0.1)
    ('0.100001', '0.1')
    """
    return _rounded(_float("value", value), _check_digits(digits), ROUND_CEILING)


def format_lower(value: Any, digits: int = DIGITS) -> str:
    """``value`` to ``digits`` significant digits, rounded DOWN: the decimal printed is <= the float.

    For lower bounds (an audit's empirical epsilon). Same domain as :func:`format_upper`.

    >>> format_lower(0.97999), format_lower(1.0000001, 3)
    ('0.97999', '1')
    """
    return _rounded(_float("value", value), _check_digits(digits), ROUND_FLOOR)


def format_exact(value: Any) -> str:
    """The shortest decimal that reads back as the same float (``repr``), without a trailing ``.0``.

    For parameters echoed as given (a sample rate, a clip norm, a configured budget).

    >>> format_exact(0.004267), format_exact(1.0), format_exact(1e-05), format_exact(3)
    ('0.004267', '1', '1e-05', '3')
    """
    out = repr(_float("value", value))
    return out[:-2] if out.endswith(".0") else out


def format_calibrated(
    value: Any, meets: Callable[[float], bool], digits: int = DIGITS, *, what: str = "noise multiplier"
) -> tuple[str, float]:
    """A calibrated noise parameter as printed and as a user would type it back: ``(text, float(text))``.

    ``text`` is ``value`` rounded up to ``digits`` significant digits, so ``float(text) >= value``
    (more noise). ``meets(float(text))`` must say the printed value still meets the target (e.g.
    re-accounted epsilon <= target): where an accountant's numerics are not monotone in the noise,
    the last digit is raised (at most 20 times) until it does; if it never does, FloatingPointError,
    nothing printed.

    >>> format_calibrated(0.6557749, lambda s: s >= 0.6557749)
    ('0.655775', 0.655775)
    """
    value = _float(what, value)
    if not math.isfinite(value) or value <= 0.0:
        raise FloatingPointError(f"refusing to print {what}={value!r}: not a finite positive number")
    digits = _check_digits(digits)
    text = format_upper(value, digits)
    for _ in range(20):
        printed = float(text)
        if meets(printed):
            return text, printed
        step = Decimal(1).scaleb(Decimal(text).adjusted() - digits + 1)  # one unit in the last place
        with localcontext() as ctx:
            ctx.prec = digits + 1
            text = _g_style(Decimal(text) + step, digits + 1)
    raise FloatingPointError(f"the printed {what} {text} does not meet its target even rounded up")
