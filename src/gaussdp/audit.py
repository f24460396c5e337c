"""Empirical lower bounds on epsilon: test a privacy claim against samples of the mechanism.

Given independent outputs of ``M(D)`` and ``M(D')`` on neighbouring inputs, any event ``S`` gives
``epsilon >= ln((P[M(D) in S] - delta) / P[M(D') in S])`` for a truly (epsilon, delta)-DP mechanism.
With Clopper-Pearson intervals (a lower bound on the first probability, an upper bound on the
second) this is a lower bound that holds with probability at least ``1 - alpha``. If it exceeds the
claimed epsilon, the claim is false (up to that error rate).

Events searched:

* threshold events ``{y > t}`` and ``{y < t}`` (what a Gaussian's likelihood ratio is monotone in);
* low-order-bit events ``{y * 2**j is not an integer}``: the naive floating-point path
  ``x + sigma * Z`` produces outputs whose finest bits depend on ``x`` (Mironov 2012), which these
  events catch.

The search is honest about multiple testing: half of each sample set chooses the best event, the
other half evaluates that single event, so the Clopper-Pearson level applies unchanged.

References:
    Jagielski, M., Ullman, J. & Oprea, A. (2020). Auditing Differentially Private Machine Learning:
    How Private is Private SGD? NeurIPS.
    Clopper, C. J. & Pearson, E. S. (1934). The use of confidence or fiducial limits. Biometrika.
    Mironov, I. (2012). On Significance of the Least Significant Bits for Differential Privacy. CCS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from gaussdp._validate import real_number
from gaussdp.errors import InvalidParameter, UnsafeInput

__all__ = ["AuditResult", "clopper_pearson", "epsilon_lower_bound"]


@dataclass(frozen=True)
class AuditResult:
    """The best event found and the epsilon lower bound it certifies (with probability 1 - alpha)."""

    epsilon_lower_bound: float
    event: str
    count: int
    count_neighbour: int
    n: int
    n_neighbour: int
    alpha: float


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds: P[p >= lo] >= 1 - alpha and P[p <= hi] >= 1 - alpha."""
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1.0 - alpha, k + 1, n - k))
    return lo, hi


def _bound(k0: int, n0: int, k1: int, n1: int, alpha: float, delta: float) -> float:
    lo, _ = clopper_pearson(k0, n0, alpha)
    _, hi = clopper_pearson(k1, n1, alpha)
    if lo - delta <= 0.0:
        return 0.0
    return max(0.0, math.log((lo - delta) / hi))


def _events(reference: NDArray[np.float64], thresholds: int, bits: range) -> list[tuple[str, Any]]:
    qs = np.unique(np.quantile(reference, np.linspace(0.0, 1.0, thresholds + 2)[1:-1]))
    events: list[tuple[str, Any]] = []
    for t in qs:
        events.append((f"y > {t:.6g}", lambda y, t=t: y > t))
        events.append((f"y < {t:.6g}", lambda y, t=t: y < t))
    for j in bits:
        events.append((f"y * 2**{j} not an integer", lambda y, j=j: _not_multiple(y, j)))
    return events


def _not_multiple(y: NDArray[np.float64], j: int) -> NDArray[np.bool_]:
    scaled = np.ldexp(y, j)  # exact: a power-of-two scaling
    with np.errstate(invalid="ignore"):
        return np.asarray(scaled != np.floor(scaled))


def epsilon_lower_bound(
    samples: Any,
    samples_neighbour: Any,
    *,
    delta: float = 0.0,
    alpha: float = 0.05,
    thresholds: int = 64,
    low_bits: range = range(0, 64),
) -> AuditResult:
    """Empirical epsilon lower bound from outputs of M(D) (``samples``) and M(D') (``samples_neighbour``).

    Args:
        samples: 1-D array of scalar outputs of the mechanism on D (one per independent run).
        samples_neighbour: the same on the neighbouring D'.
        delta: the claimed delta (subtracted as the definition allows).
        alpha: error probability of the bound (it holds with probability >= 1 - alpha).
        thresholds: number of quantile thresholds searched.
        low_bits: exponents ``j`` of the low-order-bit events searched.

    Returns:
        :class:`AuditResult` with the certified lower bound and the event that gave it.

    The textbook ``x + sigma * Z`` in float64 (x=1 vs x'=0, sigma=1, so the claim would be
    epsilon(1e-5) = 4.38) is caught by its low-order bits:

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> r = epsilon_lower_bound(1.0 + rng.normal(0, 1, 20000), rng.normal(0, 1, 20000), delta=1e-5)
    >>> r.epsilon_lower_bound > 4.38, r.event
    (True, 'y * 2**53 not an integer (neighbour side)')
    """
    a = _samples("samples", samples)
    b = _samples("samples_neighbour", samples_neighbour)
    delta = real_number("delta", delta)
    alpha = real_number("alpha", alpha)
    if not 0.0 <= delta < 1.0:
        raise InvalidParameter(f"delta must be in [0, 1), got delta={delta!r}")
    if not 0.0 < alpha < 1.0:
        raise InvalidParameter(f"alpha must be in (0, 1), got alpha={alpha!r}")
    a_sel, a_eval = a[: a.size // 2], a[a.size // 2 :]
    b_sel, b_eval = b[: b.size // 2], b[b.size // 2 :]
    events = _events(np.concatenate((a_sel, b_sel)), thresholds, low_bits)
    best: tuple[float, str, Callable[[Any], Any], bool] = (-1.0, "", lambda y: y, True)
    for name, ev in events:
        k_a, k_b = int(np.count_nonzero(ev(a_sel))), int(np.count_nonzero(ev(b_sel)))
        for forward in (True, False):  # either direction of the neighbouring pair
            k0, n0, k1, n1 = (
                (k_a, a_sel.size, k_b, b_sel.size) if forward else (k_b, b_sel.size, k_a, a_sel.size)
            )
            score = _bound(k0, n0, k1, n1, alpha, delta)
            if score > best[0]:
                best = (score, name, ev, forward)
    _, name, ev, forward = best
    k_a, k_b = int(np.count_nonzero(ev(a_eval))), int(np.count_nonzero(ev(b_eval)))
    if forward:
        k0, n0, k1, n1 = k_a, a_eval.size, k_b, b_eval.size
    else:
        k0, n0, k1, n1 = k_b, b_eval.size, k_a, a_eval.size
        name = f"{name} (neighbour side)"
    # Two one-sided bounds at alpha/2 each: both hold together with probability >= 1 - alpha.
    eps = _bound(k0, n0, k1, n1, alpha / 2.0, delta)
    return AuditResult(eps, name, k0, k1, n0, n1, alpha)


def _samples(name: str, x: Any) -> NDArray[np.float64]:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a real-valued array, got dtype {arr.dtype}")
    arr = arr.reshape(-1).astype(np.float64)  # exact for float16/32 outputs
    if arr.size < 4:
        raise UnsafeInput(f"{name} needs at least 4 samples, got {arr.size}")
    if not np.isfinite(arr).all():
        raise UnsafeInput(f"{name} contains NaN or Inf")
    return arr
