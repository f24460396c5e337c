"""Calibrate the Gaussian mechanism: sigma <-> (epsilon, delta, sensitivity).

One Gaussian release ``x + N(0, sigma^2 I)`` of a query with L2 sensitivity ``Delta`` is exactly
``mu``-GDP with ``mu = Delta / sigma`` (Dong, Roth & Su 2019), and its privacy profile is

    delta(epsilon) = Phi(mu/2 - epsilon/mu) - exp(epsilon) * Phi(-mu/2 - epsilon/mu)

(Balle & Wang 2018, Theorem 8). The guarantee holds for neighbouring datasets whose query values
differ by at most ``Delta`` in L2 norm (add/remove or replace, whichever the sensitivity was
computed for). ``method="analytic"`` (the default) inverts that formula numerically and is exact for
every epsilon. ``method="classical"`` is Dwork & Roth's ``sigma = Delta sqrt(2 ln(1.25/delta)) /
epsilon`` (Theorem A.1), a theorem only for epsilon < 1: above it, it either adds more noise than
needed or, above epsilon of about 8.4 at delta=1e-5, less than the promised guarantee needs. gaussdp
checks every classical sigma against the exact profile and refuses one that does not deliver.

Every returned value errs on the private side: a returned sigma is never below the exact one, a
returned epsilon or delta is never below the exact one.

References:
    Balle, B. & Wang, Y.-X. (2018). Improving the Gaussian Mechanism for Differential Privacy:
    Analytical Calibration and Optimal Denoising. ICML. Theorem 8 and Algorithm 1.
    Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy, Theorem A.1.
    Dong, J., Roth, A. & Su, W. (2019). Gaussian Differential Privacy. arXiv:1905.02383, Cor. 2.13.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import numpy as np
from scipy import special

from gaussdp._format import format_exact, format_upper
from gaussdp._lazy import lazy_module
from gaussdp._validate import check_delta, check_epsilon, check_positive, real_number
from gaussdp._worklimit import check_work_limit
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = [
    "classical_sigma",
    "delta_for",
    "delta_for_mu",
    "epsilon_for",
    "epsilon_for_mu",
    "log_delta_for_mu",
    "mu_for",
    "sigma_for",
]

Method = Literal["analytic", "classical"]

# Beyond these mu the profile is 1 - (something below double precision) or needs epsilon > 1e7:
# the search brackets stay inside them.
_MU_MIN = 1e-12
_MU_MAX = 1e7
_EPS_MAX = 1e8
_NORMAL_MIN = 2.2250738585072014e-308  # sys.float_info.min: below it floats lose relative precision
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(20)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT2 = math.sqrt(2.0)


def log_delta_for_mu(mu: float, epsilon: float) -> float:
    """Natural log of the exact delta(epsilon) of a mu-GDP mechanism (one Gaussian release).

    Computed as ``log Phi(a) + log(1 - exp(epsilon + log Phi(b) - log Phi(a)))`` with
    ``a = mu/2 - epsilon/mu`` and ``b = -mu/2 - epsilon/mu``, both terms in log space
    (``scipy.special.log_ndtr``), so that it stays accurate for delta down to 1e-300 and epsilon up
    to 1e4 and beyond, where the direct difference underflows or cancels.
    """
    check_work_limit()  # the innermost evaluation of every Gaussian accountant: a cancellation point
    if mu <= 0.0:
        return -math.inf
    a = mu / 2.0 - epsilon / mu
    b = -mu / 2.0 - epsilon / mu
    log_pa = float(special.log_ndtr(a))
    if log_pa == -math.inf:
        return -math.inf  # delta underflows to 0 (epsilon far beyond mu^2)
    # Identity: Phi(a) - e^eps Phi(b) = Phi(a) * (1 - exp(eps - D)), D = log Phi(a) - log Phi(b).
    if mu < 1.0:
        # For small mu the two logs nearly cancel; D = integral over [b, a] of phi/Phi (the inverse
        # Mills ratio, analytic and slowly varying there), by Gauss-Legendre to full precision.
        t = (a + b) / 2.0 + (mu / 2.0) * _GL_NODES
        # phi(t) / Phi(t) = sqrt(2/pi) / erfcx(-t/sqrt(2)): no cancellation for any t.
        d = (mu / 2.0) * float(np.dot(_GL_WEIGHTS, _SQRT_2_OVER_PI / special.erfcx(-t / _SQRT2)))
    else:
        d = log_pa - float(special.log_ndtr(b))
    x = epsilon - d
    if x >= 0.0:
        # Only reachable through rounding when delta is far below double precision.
        return -math.inf
    # Rounded up: log_ndtr and the quadrature err by about 2e-13 * |log delta| relative (8e-11 at
    # delta = 1e-200, checked against 60-digit mpmath), so every delta reported is an upper bound.
    log_delta = log_pa + math.log(-math.expm1(x))
    return log_delta + 1e-14 - 4e-13 * log_delta


def delta_for_mu(*, mu: float, epsilon: float) -> float:
    """Exact delta(epsilon) of a mu-GDP mechanism (Dong, Roth & Su 2019, Corollary 2.13)."""
    mu = check_positive("mu", mu)
    epsilon = _check_epsilon_allow_zero(epsilon)
    return math.exp(log_delta_for_mu(mu, epsilon))


def epsilon_for_mu(*, mu: float, delta: float) -> float:
    """Smallest epsilon with delta(epsilon) <= delta for a mu-GDP mechanism, rounded up."""
    mu = check_positive("mu", mu)
    delta = check_delta(delta)
    return _epsilon_for_mu(mu, delta)


def mu_for(*, sigma: float, sensitivity: float = 1.0) -> float:
    """The GDP parameter mu = sensitivity / sigma of one Gaussian release."""
    sensitivity = check_positive("sensitivity", sensitivity)
    sigma = check_positive("sigma", sigma)
    mu = sensitivity / sigma
    if not mu <= _MU_MAX:
        raise InvalidParameter(
            f"sensitivity / sigma must be <= {_MU_MAX:g}, got sigma={sigma!r}, sensitivity={sensitivity!r}"
        )
    if not mu >= _NORMAL_MIN:
        # An underflowed ratio (0 or subnormal) has lost its precision: its epsilon would be no bound.
        raise InvalidParameter(
            f"sensitivity / sigma underflows (below {_NORMAL_MIN:g}), got sigma={sigma!r}, "
            f"sensitivity={sensitivity!r}"
        )
    return mu


def delta_for(*, sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """Exact delta at ``epsilon`` of one Gaussian release with noise ``sigma`` and L2 ``sensitivity``.

    Args:
        sigma: standard deviation of the noise added to each coordinate, > 0.
        epsilon: the epsilon at which delta is wanted, >= 0.
        sensitivity: L2 sensitivity of the query, > 0.

    Returns:
        delta in [0, 1]: the mechanism is (epsilon, delta)-DP and no smaller delta holds.

    The classical sigma for (10, 1e-5) does not deliver delta=1e-5:

    >>> f"{delta_for(sigma=0.48448053, epsilon=10.0):.3g}"
    '2.27e-05'
    """
    return delta_for_mu(mu=mu_for(sigma=sigma, sensitivity=sensitivity), epsilon=epsilon)


def epsilon_for(*, sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """Exact epsilon (rounded up) of one Gaussian release at ``delta``.

    >>> round(epsilon_for(sigma=4.8448, delta=1e-5), 6)
    0.750978
    """
    mu = mu_for(sigma=sigma, sensitivity=sensitivity)
    return _epsilon_for_mu(mu, check_delta(delta))


def sigma_for(
    *,
    epsilon: float,
    delta: float,
    sensitivity: float = 1.0,
    method: Method = "analytic",
) -> float:
    """Noise standard deviation for one (epsilon, delta)-DP Gaussian release of L2 ``sensitivity``.

    Args:
        epsilon: target epsilon, > 0.
        delta: target delta, in (0, 1).
        sensitivity: L2 sensitivity of the query, > 0.
        method: ``"analytic"`` (exact for every epsilon, Balle & Wang 2018) or ``"classical"``
            (Dwork & Roth's formula; a theorem only for epsilon < 1, refused where it under-noises).

    Returns:
        sigma, never below the exact analytic value; re-verified so that delta_for(sigma) <= delta.

    Raises:
        InvalidParameter: a parameter is out of range, or the classical sigma does not deliver the
            promised (epsilon, delta); the message names the true delta.

    >>> round(sigma_for(epsilon=1.0, delta=1e-5), 6)
    3.730632
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    sensitivity = check_positive("sensitivity", sensitivity)
    if epsilon > _EPS_MAX:
        raise InvalidParameter(f"epsilon must be <= {_EPS_MAX:g}, got epsilon={epsilon!r}")
    if method == "classical":
        return classical_sigma(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
    if method != "analytic":
        raise InvalidParameter(f"method must be 'analytic' or 'classical', got method={method!r}")
    mu = _mu_for_epsilon_delta(epsilon, delta)
    log_target = math.log(delta)

    sigma = sensitivity / mu
    if not sigma >= _NORMAL_MIN:
        raise InvalidParameter(
            f"sigma underflows (below {_NORMAL_MIN:g}) for epsilon={epsilon!r}, delta={delta!r}, "
            f"sensitivity={sensitivity!r}"
        )

    def holds(sigma: float) -> bool:
        return log_delta_for_mu(sensitivity / sigma, epsilon) <= log_target

    # The division rounds: settle on the smallest float sigma at or above it whose profile holds.
    return _settle(holds, sigma, toward=math.inf, what=f"sigma for epsilon={epsilon:g}")


def classical_sigma(*, epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """Dwork & Roth's sigma = sensitivity * sqrt(2 ln(1.25/delta)) / epsilon, checked exactly.

    The formula is a theorem only for epsilon < 1 (Dwork & Roth 2014, Theorem A.1). For larger
    epsilon it is checked against the exact profile: between 1 and about 8.4 (at delta=1e-5) it is
    valid but adds more noise than needed; where it would not deliver (epsilon, delta) it is refused.

    >>> round(classical_sigma(epsilon=1.0, delta=1e-5), 7)
    4.8448053
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    sensitivity = check_positive("sensitivity", sensitivity)
    sigma = sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    true_delta = math.exp(log_delta_for_mu(sensitivity / sigma, epsilon))
    if true_delta > delta:
        exact = sensitivity / _mu_for_epsilon_delta(epsilon, delta)
        raise InvalidParameter(
            f"the classical formula is not valid at epsilon={format_exact(epsilon)}, delta="
            f"{format_exact(delta)}: its sigma={format_exact(sigma)} gives true delta="
            f"{format_upper(true_delta, 3)} > {format_exact(delta)}; use method='analytic' (sigma="
            f"{format_upper(exact)})"
        )
    return sigma


def _check_epsilon_allow_zero(epsilon: float) -> float:
    out = real_number("epsilon", epsilon)
    if out < 0.0:
        raise InvalidParameter(f"epsilon must be >= 0, got epsilon={epsilon!r}")
    return out


def _mu_for_epsilon_delta(epsilon: float, delta: float) -> float:
    """Largest mu whose profile satisfies delta(epsilon) <= delta (the profile grows with mu)."""
    log_target = math.log(delta)

    def f(log_mu: float) -> float:
        return log_delta_for_mu(math.exp(log_mu), epsilon) - log_target

    lo, hi = math.log(_MU_MIN), math.log(_MU_MAX)
    if f(lo) > 0.0 or f(hi) <= 0.0:
        raise InvalidParameter(
            f"no sigma in range gives epsilon={epsilon:g}, delta={delta:g} (mu outside "
            f"[{_MU_MIN:g}, {_MU_MAX:g}])"
        )
    log_mu = optimize.brentq(
        f, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=_BRENT_MAXITER, disp=False
    )

    def holds(mu: float) -> bool:
        return log_delta_for_mu(mu, epsilon) <= log_target

    # brentq's answer may sit on either side of the root: settle on the safe side (_MU_MIN holds).
    return _settle(
        holds,
        min(max(math.exp(log_mu), _MU_MIN), _MU_MAX),
        toward=_MU_MIN,
        what=f"mu for epsilon={epsilon:g}, delta={delta:g}",
    )


def _epsilon_for_mu(mu: float, delta: float) -> float:
    """Smallest epsilon with delta(epsilon) <= delta (the profile falls with epsilon), rounded up."""
    log_target = math.log(delta)
    if log_delta_for_mu(mu, 0.0) <= log_target:
        return 0.0

    def f(eps: float) -> float:
        return log_delta_for_mu(mu, eps) - log_target

    hi = max(1.0, mu * mu)
    while f(hi) > 0.0:  # at most log2(_EPS_MAX) doublings
        hi *= 2.0
        if hi > _EPS_MAX:
            raise InvalidParameter(f"epsilon exceeds {_EPS_MAX:g} for mu={mu:g}, delta={delta:g}")
    # xtol far below any epsilon of interest: rtol (relative) decides, also for epsilon ~ 1e-12.
    eps = optimize.brentq(
        f, 0.0, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=_BRENT_MAXITER, disp=False
    )

    def holds(e: float) -> bool:
        return f(e) <= 0.0

    # f(hi) <= 0 was checked above, so the settling search has a safe end to fall back on.
    return _settle(holds, min(max(eps, 0.0), hi), toward=hi, what=f"epsilon for mu={mu:g}, delta={delta:g}")


# Bounded work: Brent's method converges superlinearly (about 10-40 evaluations here); this caps it.
_BRENT_MAXITER = 200
# _settle widens by 1, 2, 4, ... float steps (at most 64 times, the span of the doubles) and then
# bisects the bit patterns (at most 64 halvings): under 130 profile evaluations in the worst case.
_SETTLE_STEPS = 64


def _float_bits(x: float) -> int:
    # For doubles >= 0 the IEEE-754 bit pattern, read as an integer, is monotone in the value.
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _bits_float(i: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", i))[0])


def _settle(holds: Callable[[float], bool], x: float, *, toward: float, what: str) -> float:
    """The float at or beyond ``x`` (in the direction of ``toward``) nearest to ``x`` where ``holds``.

    ``holds`` says that the guarantee is met (the profile is at or below the target); it is
    expected to hold at ``toward`` (a value the caller has checked, or one far on the safe side) and
    to be monotone, but the answer does not rely on either: it is returned only after ``holds`` was
    evaluated on that very float, and an error is raised otherwise (fail closed).

    Cost is bounded whatever the inputs: the distance from ``x`` is widened by 1, 2, 4, ... float
    steps until ``holds`` is met (at most 64 widenings, the whole range of doubles), then the last
    step is halved on the bit patterns (at most 64 halvings): float-exact, unlike a walk of one float
    step at a time, whose length grows with the error of the root finder.

    Args:
        holds: the guarantee check, evaluated on candidate floats (all >= 0).
        x: the root finder's estimate, >= 0.
        toward: the direction of the safe side (``math.inf`` for "larger is safer", or a smaller
            safe value), >= 0.
        what: what is computed, for the error message.

    Raises:
        InvalidParameter: no float between ``x`` and ``toward`` was found on which ``holds``.
    """
    if holds(x):
        return x
    bad, limit = _float_bits(x), _float_bits(toward)
    sign = 1 if limit > bad else -1
    good = None
    step = 1
    for _ in range(_SETTLE_STEPS):
        cand = bad + sign * step
        if sign * (cand - limit) >= 0:
            cand = limit
        if holds(_bits_float(cand)):
            good = cand
            break
        if cand == limit:
            break
        bad = cand
        step *= 2
    if good is None:
        raise InvalidParameter(
            f"could not verify the {what}: the guarantee check fails between {x!r} and {toward!r}"
        )
    while abs(good - bad) > 1:  # invariant: holds(good), not holds(bad); at most 64 halvings
        mid = (good + bad) // 2
        if holds(_bits_float(mid)):
            good = mid
        else:
            bad = mid
    return _bits_float(good)
