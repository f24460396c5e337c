"""Inverse problem: the smallest noise multiplier that meets a target (epsilon, delta)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gaussdp._lazy import lazy_module
from gaussdp._validate import check_delta, check_epsilon, check_probability
from gaussdp.accounting.events import Event, GaussianEvent, SubsampledGaussianEvent, check_count
from gaussdp.accounting.registry import accountant as make_accountant
from gaussdp.calibration import sigma_for
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = ["noise_for_epsilon", "smallest_noise"]

_SIGMA_MIN = 1e-3
_SIGMA_MAX = 1e6


def _event(sigma: float, sample_rate: float) -> Event:
    return GaussianEvent(sigma) if sample_rate >= 1.0 else SubsampledGaussianEvent(sigma, sample_rate)


def noise_for_epsilon(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float = 1.0,
    steps: int = 1,
    accountant: str = "pld",
    **options: Any,
) -> float:
    """Smallest noise multiplier (sigma / sensitivity) whose ``steps`` releases meet the target.

    Each step is a Gaussian release (``sample_rate=1``) or a Poisson-subsampled one (DP-SGD);
    neighbouring relation add/remove. The accountant's epsilon is non-increasing in the noise, so
    Brent's method on log(sigma) finds the crossing; the answer is then checked with the same
    accountant and nudged up until ``epsilon(delta) <= target_epsilon`` holds (never overshoots).
    Plain Gaussian compositions with an exact accountant use the closed form
    ``sigma = sqrt(steps) * sigma_1`` with ``sigma_1`` the analytic single-release sigma.

    Args:
        target_epsilon: epsilon to meet, > 0.
        delta: delta, in (0, 1).
        sample_rate: Poisson sampling rate q in (0, 1].
        steps: number of releases, >= 1.
        accountant: accountant name (``"pld"`` default; see :func:`gaussdp.accounting.accountant`);
            an approximation (``"gdp"``) is refused: the noise must provably meet the target.
        **options: passed to the accountant's constructor.

    Raises:
        InvalidParameter: bad arguments, or no noise multiplier in [1e-3, 1e6] meets the target.

    >>> round(noise_for_epsilon(target_epsilon=1.0, delta=1e-5), 4)   # one release: analytic sigma
    3.7306
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    q = check_probability("sample_rate", sample_rate)
    steps = check_count(steps, "steps")
    make_accountant(accountant, **options)  # validates the name and options; refuses approximations

    def eps_of(sigma: float) -> float:
        try:
            acc = make_accountant(accountant, **options).compose(_event(sigma, q), count=steps)
            return acc.epsilon(delta)
        except InvalidParameter:
            return math.inf  # too little noise for the accountant to bound: far above any target

    if q >= 1.0 and accountant in ("pld", "rdp"):
        sigma = math.sqrt(steps) * sigma_for(epsilon=target, delta=delta)
        return verified_noise(eps_of, sigma, target, delta, "noise multiplier")
    return smallest_noise(
        eps_of, target, delta, lo_bound=_SIGMA_MIN, hi_bound=_SIGMA_MAX, what="noise multiplier"
    )


def smallest_noise(
    eps_of: Callable[[float], float],
    target: float,
    delta: float,
    *,
    lo_bound: float,
    hi_bound: float,
    what: str,
) -> float:
    """Smallest noise level ``x`` in ``[lo_bound, hi_bound]`` with ``eps_of(x) <= target``, verified.

    ``eps_of`` is the epsilon (at ``delta``) of the composition at noise level ``x``: non-increasing
    in ``x``, ``inf`` where the accountant cannot bound it. Brackets the crossing by factors of 4,
    then Brent's method on ``log x``; the answer is checked with ``eps_of`` itself and nudged up
    until the target holds (never overshoots). Bounded work: at most ~30 + 100 + 200 calls.

    Raises:
        InvalidParameter: no level up to ``hi_bound`` meets the target, or none could be verified.
    """

    def f(log_x: float) -> float:
        e = eps_of(math.exp(log_x))
        return (math.log(e) if e > 0.0 else -700.0) - math.log(target) if math.isfinite(e) else 700.0

    hi = 1.0
    while f(math.log(hi)) > 0.0:
        hi *= 4.0
        if hi > hi_bound:
            raise InvalidParameter(
                f"no {what} up to {hi_bound:g} gives epsilon={target:g} at delta={delta:g}"
            )
    lo = hi / 4.0
    while f(math.log(lo)) <= 0.0:
        lo /= 4.0
        if lo < lo_bound:
            return verified_noise(eps_of, lo_bound, target, delta, what)
    log_x = optimize.brentq(f, math.log(lo), math.log(hi), xtol=1e-6, rtol=1e-8, maxiter=100)
    return verified_noise(eps_of, math.exp(log_x), target, delta, what)


def verified_noise(
    eps_of: Callable[[float], float], x: float, target: float, delta: float, what: str
) -> float:
    """``x``, or the least of ``x (1 + 1e-9 * (2^k - 1))`` whose ``eps_of`` meets the target."""
    # Brent's answer may sit on either side of the root: step the noise up until the target holds.
    bump = 1e-9
    for _ in range(200):
        if eps_of(x) <= target:
            return x
        x *= 1.0 + bump
        bump *= 2.0
    raise InvalidParameter(f"could not verify a {what} for epsilon={target:g}, delta={delta:g}")
