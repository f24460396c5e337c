"""Banded Toeplitz strategies for the prefix-sum workload, optimised in numpy/scipy and cached.

A banded matrix-factorisation mechanism trains on ``x_t + (C^{-1} z)_t`` (step ``t``'s clipped sum
plus correlated noise): a post-processing of the Gaussian release ``C x + z``, after which SGD's
iterates are the prefix sums ``A x`` (``A`` the lower-triangular matrix of ones) plus ``B z`` with
``B = A C^{-1}``. For a lower-triangular Toeplitz ``C`` with ``b`` bands, coefficients ``c_0 .. c_{b-1}``,
``C^{-1}`` and ``B`` are lower-triangular Toeplitz as well: ``C^{-1}`` has the coefficients ``r`` of
the power series ``1 / c(x)``, ``B`` their running sums ``s``. So the expected squared error of every
iterate together, ``||B||_F^2 sens(C)^2``, is

    L(c) = ||c||^2 * sum_t (n - t) s_t^2

when participations are at least ``b`` steps apart (then ``sens(C)^2 = k ||c||^2``: a record's
columns do not overlap, and the first columns have the full norm). ``L`` does not change when ``c``
is scaled, so ``c_0 = 1`` is fixed and the other ``b - 1`` coefficients are found by L-BFGS with
the exact gradient (below), from the truncated square root of ``A`` (``c_j = binom(2j, j) / 4^j``,
the optimal infinite-band factorisation's coefficients).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from gaussdp._validate import check_counts
from gaussdp.errors import InvalidParameter

__all__ = ["banded_toeplitz_coefficients", "prefix_sum_loss", "toeplitz_matrix"]

# n * b per evaluation of the loss and its gradient, about 200 evaluations per optimisation.
_WORK_LIMIT = 20_000_000


def sqrt_coefficients(bands: int) -> np.ndarray:
    """``binom(2j, j) / 4^j`` for ``j < bands``: the Taylor coefficients of ``(1 - x)^(-1/2)``."""
    out = np.ones(bands)
    for j in range(1, bands):
        out[j] = out[j - 1] * (2 * j - 1) / (2 * j)
    return out


def _inverse_series(c: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of ``1 / c(x)``: the first column of ``C^{-1}``."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return np.asarray(lfilter([1.0], c, impulse))


def prefix_sum_loss(coefficients: np.ndarray, steps: int) -> float:
    """``||c||^2 sum_t (n - t) s_t^2``: the total squared error of the prefix sums (per unit noise).

    ``s`` are the running sums of the coefficients of ``1 / c(x)``, the coefficients of
    ``A C^{-1}``; ``||c||^2`` is ``sens(C)^2 / k`` for participations at least ``b`` steps apart.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    s = np.cumsum(_inverse_series(c, steps))
    w = np.arange(steps, 0, -1, dtype=np.float64)
    return float(np.dot(c, c) * np.dot(w, s * s))


def _loss_and_grad(free: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """log L and its gradient in ``c_1 .. c_{b-1}`` (``c_0 = 1``).

    With ``r = 1 / c(x)``, ``dr / dc_j = -x^j r^2`` (differentiate ``c r = 1``), so the running sums
    move by ``ds_t / dc_j = -Q_{t - j}`` where ``Q`` are the running sums of the coefficients of
    ``r^2 = r / c(x)``.
    """
    c = np.concatenate(([1.0], free))
    n = steps
    r = _inverse_series(c, n)
    s = np.cumsum(r)
    q = np.cumsum(np.asarray(lfilter([1.0], c, r)))
    w = np.arange(n, 0, -1, dtype=np.float64)
    f = float(np.dot(w, s * s))
    norm2 = float(np.dot(c, c))
    loss = norm2 * f
    if not math.isfinite(loss) or loss <= 0.0:
        return math.inf, np.zeros_like(free)
    ws = w * s
    df = np.array([-2.0 * np.dot(ws[j:], q[: n - j]) for j in range(1, c.size)])
    grad = 2.0 * free / norm2 + df / f  # d log L = d log ||c||^2 + d log f
    return math.log(loss), grad


def _stable(c: np.ndarray) -> bool:
    """All roots of ``c(x)`` outside the unit circle: ``C^{-1}``'s coefficients decay, so the
    noise recurrence does not amplify rounding over many steps."""
    if c.size == 1:
        return True
    roots = np.roots(c[::-1])
    return bool(np.all(np.abs(roots) > 1.0 + 1e-9))


@functools.lru_cache(maxsize=64)
def _optimised(steps: int, bands: int) -> tuple[float, ...]:
    start = sqrt_coefficients(bands)
    if bands == 1:
        return (1.0,)
    res = minimize(
        _loss_and_grad, start[1:], args=(steps,), jac=True, method="L-BFGS-B", options={"maxiter": 500}
    )
    best = np.concatenate(([1.0], res.x))
    # Keep the optimum only if it is an improvement and its inverse is stable; the start always is.
    if not (_stable(best) and prefix_sum_loss(best, steps) < prefix_sum_loss(start, steps)):
        best = start
    return tuple(float(v) for v in best)


def banded_toeplitz_coefficients(*, steps: int, bands: int) -> np.ndarray:
    """The coefficients ``c_0 = 1, c_1, .., c_{b-1}`` of the optimised ``b``-banded Toeplitz strategy.

    Minimises the total squared error of the ``steps`` prefix sums (SGD's iterates) under
    participations at least ``bands`` steps apart (see the module docstring); the result is cached
    per ``(steps, bands)`` (64 entries). It is at least as good as the truncated square root of the
    prefix-sum matrix and its inverse series decays (all roots of ``c(x)`` outside the unit circle).
    The optimisation only chooses the matrix: the privacy of any matrix is computed by
    :func:`gaussdp.mf.strategy_sensitivity`, never assumed from it.

    >>> c = banded_toeplitz_coefficients(steps=100, bands=4)
    >>> float(c[0]), bool(prefix_sum_loss(c, 100) <= prefix_sum_loss(sqrt_coefficients(4), 100))
    (1.0, True)

    Accepted domain: ``steps`` and ``bands`` ints, ``1 <= bands <= steps``, ``steps * bands`` at most
    2 * 10^7 (bounded work).

    Raises:
        InvalidParameter: a count that is not an int >= 1, ``bands`` above ``steps``, or work past
            the limit.

    References:
        Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded
        Matrix Factorizations: A unified approach to private training" (arXiv 2306.08153),
        Section 4 (banded strategies, the b-min-separated sensitivity); McKenna 2024, "Scaling up
        the Banded Matrix Factorization Mechanism for Differentially Private ML" (arXiv
        2405.15913), Section 3 (banded Toeplitz strategies, the loss of Toeplitz factorisations);
        Fichtenberger, Henzinger & Upadhyay 2023, "Constant matters: Fine-grained error bound on
        differentially private continual observation" (the square-root factorisation).
    """
    check_counts(steps=steps, bands=bands)
    if bands > steps:
        raise InvalidParameter(f"bands must be <= steps, got bands={bands}, steps={steps}")
    if steps * bands > _WORK_LIMIT:
        raise InvalidParameter(
            f"steps * bands = {steps * bands} is past the optimisation's work limit ({_WORK_LIMIT}); "
            f"give fewer bands (bands={bands}) or fewer steps (steps={steps})"
        )
    return np.array(_optimised(int(steps), int(bands)))


def toeplitz_matrix(coefficients: np.ndarray, steps: int) -> np.ndarray:
    """The ``steps x steps`` lower-triangular banded Toeplitz matrix ``C[i, j] = c_{i - j}``."""
    c = np.asarray(coefficients, dtype=np.float64)
    out = np.zeros((steps, steps))
    for d in range(min(c.size, steps)):
        out[np.arange(d, steps), np.arange(steps - d)] = c[d]
    return out
