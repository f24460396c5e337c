"""Exact privacy profiles of one Gaussian and one Poisson-subsampled Gaussian release.

Under add/remove of one record, a subsampled Gaussian step with noise multiplier sigma and sample
rate q is dominated by the pair of distributions on the real line (Zhu, Dong & Wang 2022, Thm 11):

* remove: ``P = (1-q) N(0, sigma^2) + q N(1, sigma^2)`` against ``Q = N(0, sigma^2)``
* add:    ``P = N(0, sigma^2)`` against ``Q = (1-q) N(0, sigma^2) + q N(1, sigma^2)``

and its profile is ``delta(eps) = max(H_{e^eps}(remove), H_{e^eps}(add))`` with the hockey-stick
divergence ``H_a(P||Q) = int (P - a Q)_+``. The functions here evaluate both exactly, in log space,
vectorised over epsilon (``scipy.special.log_ndtr``), so they stay accurate down to delta ~ 1e-300.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import special

from gaussdp.calibration import epsilon_for_mu, log_delta_for_mu

Direction = Literal["remove", "add"]
FloatArray = NDArray[np.float64]


def _log_diff(log_a: FloatArray, log_b: FloatArray) -> FloatArray:
    """log(exp(log_a) - exp(log_b)), -inf where the difference is <= 0."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d = log_b - log_a
        out = log_a + np.log(-np.expm1(np.minimum(d, 0.0)))
    return np.where((d < 0.0) & np.isfinite(log_a), out, -np.inf)


def subsampled_log_delta(
    sigma: float, q: float, eps: ArrayLike, direction: Direction = "remove"
) -> FloatArray:
    """log H_{e^eps}(P||Q) for one subsampled Gaussian step, in the given direction, exactly.

    Remove: with ``x* = sigma^2 log((e^eps - 1 + q) / q) + 1/2`` (where P's density ratio crosses
    e^eps), ``delta = q Phi((1 - x*)/sigma) - (e^eps - 1 + q) Phi(-x*/sigma)``; below
    ``eps = log(1 - q)`` the ratio is always above e^eps and ``delta = 1 - e^eps``.
    Add: with ``x_a = sigma^2 log((e^-eps - 1 + q) / q) + 1/2``, ``delta = Phi(x_a/sigma) (1 -
    e^eps (1 - q)) - q e^eps Phi((x_a - 1)/sigma)``; zero from ``eps = -log(1 - q)`` on.
    """
    e = np.atleast_1d(np.asarray(eps, dtype=np.float64))
    out = np.full(e.shape, -np.inf)
    log_q = math.log(q)
    s2 = sigma * sigma
    if direction == "remove":
        # log(e^eps - 1 + q), valid where it is > log 0.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            t = np.where(
                e > 0.0,
                e + np.log1p(-(1.0 - q) * np.exp(-np.maximum(e, 0.0))),
                np.log(np.expm1(np.minimum(e, 0.0)) + q),
            )
        ok = np.isfinite(t) & (np.expm1(np.minimum(e, 50.0)) + q > 0.0)
        x = s2 * (t - log_q) + 0.5
        log_a = log_q + special.log_ndtr((1.0 - x) / sigma)
        log_b = t + special.log_ndtr(-x / sigma)
        res = _log_diff(log_a, log_b)
        out = np.where(ok, res, out)
        below = ~ok
        if np.any(below):
            with np.errstate(divide="ignore"):
                out = np.where(below, np.log(-np.expm1(np.minimum(e, 0.0))), out)
        return out
    # add direction
    log1mq = math.log1p(-q) if q < 1.0 else -math.inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        u = np.log(np.expm1(-e) + q)  # log(e^-eps - 1 + q)
        ok = (e < -log1mq) & np.isfinite(u)
        x = s2 * (u - log_q) + 0.5
        log_c = np.log(-np.expm1(np.minimum(e + log1mq, -1e-300)))  # log(1 - e^eps (1-q))
        log_a = special.log_ndtr(x / sigma) + log_c
        log_b = log_q + e + special.log_ndtr((x - 1.0) / sigma)
    res = _log_diff(log_a, log_b)
    return np.where(ok, res, out)


def subsampled_delta(sigma: float, q: float, epsilon: float) -> float:
    """Exact delta(epsilon) of one subsampled Gaussian step: the max over both directions."""
    if q >= 1.0:
        return math.exp(log_delta_for_mu(1.0 / sigma, epsilon))
    r = subsampled_log_delta(sigma, q, epsilon, "remove")[0]
    a = subsampled_log_delta(sigma, q, epsilon, "add")[0]
    return float(math.exp(max(r, a)))


def subsampled_epsilon(sigma: float, q: float, delta: float) -> float:
    """Exact epsilon (rounded up) of one subsampled Gaussian step at ``delta``."""
    if q >= 1.0:
        return epsilon_for_mu(mu=1.0 / sigma, delta=delta)
    from gaussdp.accounting.base import invert_delta

    return invert_delta(lambda e: subsampled_delta(sigma, q, e), delta)


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact epsilon (rounded up) of one Gaussian release with noise multiplier ``sigma``."""
    return epsilon_for_mu(mu=1.0 / sigma, delta=delta)
