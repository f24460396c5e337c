"""Log-space helpers shared by the RDP bounds: no cancellation, no overflow.

Renyi divergences of mixtures are ``log E_Q[(P/Q)^alpha] / (alpha - 1)`` with ``E_Q[P/Q] = 1``. Near
``P = Q`` the expectation is ``1 + tiny`` and summing it directly loses ``tiny`` to rounding (below
1e-16 it becomes exactly 0: an RDP of 0, which claims delta = 0). Writing ``P/Q = 1 + r`` with
``E_Q[r] = 0``, ``E_Q[(1 + r)^alpha] - 1 = E_Q[(1 + r)^alpha - 1 - alpha r]``, whose integrand is
non-negative for ``alpha >= 1`` (convexity): :func:`log_excess` evaluates its logarithm accurately and
:func:`log1p_exp` adds the 1 back at the very end.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

__all__ = ["log1p_exp", "log_excess"]

FloatArray = NDArray[np.float64]


def log1p_exp(log_x: float) -> float:
    """``log(1 + e^log_x)``, accurate for tiny and huge x."""
    return log_x + math.log1p(math.exp(-log_x)) if log_x > 0.0 else math.log1p(math.exp(log_x))


def log_excess(r: FloatArray, log_r: FloatArray, log1p_r: FloatArray, alpha: float) -> FloatArray:
    """``log((1 + r)^alpha - 1 - alpha r)`` for ``r > -1`` and ``alpha > 1``, elementwise (``-inf`` at 0).

    Args:
        r: the ratio minus one (it may overflow to ``inf`` where ``log_r`` is finite).
        log_r: ``log r`` where ``r > 0`` (read only there).
        log1p_r: ``log(1 + r)``, formed without overflow by the caller.

    Three regimes, each free of cancellation: where ``|r| max(1, alpha) < 0.1`` the binomial series
    ``sum_{j >= 2} C(alpha, j) r^j`` (each term at most a tenth of the one before: 23 terms reach
    1e-23 relative); for other ``r < 0`` the plain formula, whose terms are then of order one
    (``(1 + r)^alpha - (1 + alpha r) >= 0.0045`` relative to them); for other ``r > 0``
    ``alpha log(1 + r) + log(1 - (1 + alpha r) / (1 + r)^alpha)`` with ``log(1 + alpha r)`` formed
    from ``log_r``, so that huge ``r`` does not overflow.
    """
    out = np.empty_like(log1p_r)
    small = np.abs(r) * max(1.0, alpha) < 0.1
    rs = r[small]
    coef, total, power = 1.0, np.zeros_like(rs), np.ones_like(rs)
    for j in range(1, 24):
        coef *= (alpha - j + 1) / j
        power = power * rs
        if j >= 2:
            total += coef * power
    with np.errstate(divide="ignore", invalid="ignore"):
        out[small] = np.log(total)  # -inf at r = 0 exactly: that point adds nothing
        neg = ~small & (r < 0.0)
        rn = r[neg]
        out[neg] = np.log(np.exp(alpha * log1p_r[neg]) - 1.0 - alpha * rn)
        pos = ~small & (r > 0.0)
        lp = log1p_r[pos]
        log1p_ar = np.logaddexp(0.0, math.log(alpha) + log_r[pos])
        out[pos] = alpha * lp + np.log(-np.expm1(log1p_ar - alpha * lp))
    return out
