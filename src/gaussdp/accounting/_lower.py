"""Certified lower bounds on a composition's privacy profile: the accountants' fault detector.

Composing more releases never makes a mechanism more private: dropping the outputs of all but one
release is post-processing of the composition, so for every leaf event ``e`` composed,

    epsilon_composition(delta) >= epsilon_e(delta)   and   delta_composition(eps) >= delta_e(eps),

with ``epsilon_e`` / ``delta_e`` the *exact* profile of one release of ``e`` (and of the exact
composition of all plain Gaussian releases, which is ``mu``-GDP with ``mu = sqrt(sum 1 / sigma^2)``,
Dong, Roth & Su 2019, Corollary 3.3). Every accountant's answer is an upper bound on the true profile,
so an answer below one of these values can only come from a numerical fault (an overflow turned into
a plausible small number, a failed inversion): :class:`gaussdp.accounting.base.Accountant` then raises
:class:`~gaussdp.errors.NumericalFault` instead of returning it.

Only events whose one-release profile has a closed form contribute (``_EXACT``), and at most
:data:`_MAX_LEAVES` of them per query (any
subset gives a valid lower bound), so the check costs a few profile evaluations.
"""

from __future__ import annotations

import functools
import math

from gaussdp.accounting._mechanisms import leaf_log_delta, leaf_mu2
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.events import (
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    ReplaceOneSubsampledGaussianEvent,
    SubsampledGaussianEvent,
)
from gaussdp.calibration import log_delta_for_mu
from gaussdp.errors import InvalidParameter

__all__ = ["lower_delta", "lower_epsilon"]

_MAX_LEAVES = 4
# Leaves whose one-release profile gaussdp computes exactly (closed forms). Not here: the discrete
# Gaussian (its histogram moves the atoms beyond 9.7 sigma to +inf, an upper bound), loss histograms
# (their profile is capped at e^700) and profiles (a hull): their values are upper bounds, not exact.
_EXACT = (SubsampledGaussianEvent, ReplaceOneSubsampledGaussianEvent, FixedBatchGaussianEvent, LaplaceEvent)
# Relative slack for the floating-point error of the exact profiles themselves (within 3e-8 of
# 50-digit mpmath where delta > 1e-30; 3e-5 below that: gaussdp.accounting.pld._ONE_STEP_REL).
_REL = 1e-4


def _log_delta_one(leaf: Event | float, epsilon: float) -> float:
    """log delta(epsilon) of one release of ``leaf`` (a float: the Gaussian part's mu), exactly."""
    if isinstance(leaf, float):
        return log_delta_for_mu(leaf, epsilon)
    if isinstance(leaf, SubsampledGaussianEvent):
        s, q = leaf.noise_multiplier, leaf.sample_rate
        return max(
            float(subsampled_log_delta(s, q, epsilon, "remove")[0]),
            float(subsampled_log_delta(s, q, epsilon, "add")[0]),
        )
    return float(leaf_log_delta(leaf, epsilon)[0])


def _leaves(counts: dict[Event, int]) -> list[Event | float]:
    """The plain Gaussian part (as its mu) and the few largest-loss leaves with an exact profile."""
    out: list[Event | float] = []
    mu2 = math.fsum(c / e.noise_multiplier**2 for e, c in counts.items() if isinstance(e, GaussianEvent))
    if mu2 > 0.0:
        out.append(math.sqrt(mu2))

    def scale(e: Event) -> float:
        if isinstance(e, SubsampledGaussianEvent):
            return e.sample_rate**2 * math.expm1(min(1.0 / e.noise_multiplier**2, 700.0))
        return leaf_mu2(e)

    exact = [e for e in counts if isinstance(e, _EXACT)]
    exact.sort(key=scale, reverse=True)
    out.extend(exact[: _MAX_LEAVES - len(out)])
    return out


@functools.lru_cache(maxsize=1024)
def _epsilon_one(leaf: Event | float, delta: float) -> float:
    """Smallest epsilon in [0, 1e6] whose exact one-release delta is at most ``delta`` (bisection on
    the exact profile, rounded *down*: a lower bound); past 1e6 the last point known to be below it."""
    log_target = math.log(delta) + math.log1p(_REL)
    if _log_delta_one(leaf, 0.0) <= log_target:
        return 0.0
    lo, hi = 0.0, 1.0
    while _log_delta_one(leaf, hi) > log_target:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            return lo
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _log_delta_one(leaf, mid) > log_target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(1.0, lo):
            break
    return lo


def lower_epsilon(counts: dict[Event, int], delta: float) -> float:
    """A certified lower bound on the true epsilon(delta) of the composition ``counts`` (0 if none)."""
    best = 0.0
    for leaf in _leaves(counts):
        try:
            best = max(best, _epsilon_one(leaf, delta))
        except (InvalidParameter, ArithmeticError):
            continue  # no exact value here: no contribution (the check only ever refuses)
    return best


def lower_delta(counts: dict[Event, int], epsilon: float) -> float:
    """A certified lower bound on the true delta(epsilon) of the composition ``counts`` (0 if none)."""
    best = -math.inf
    for leaf in _leaves(counts):
        try:
            best = max(best, _log_delta_one(leaf, epsilon))
        except (InvalidParameter, ArithmeticError):
            continue
    return 0.0 if best == -math.inf else math.exp(best) / (1.0 + _REL)
