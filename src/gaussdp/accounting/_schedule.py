"""Noise calibration for multi-phase schedules, and the events of tree aggregation and banded MF.

* :func:`noise_scale_for_schedule`: a training run of several phases (different sample rates, noise
  multipliers, step counts, even batch sampling schemes) is one event tree; the smallest factor by
  which *all* its noise parameters can be multiplied so that it meets a target (epsilon, delta),
  with an accountant that gives upper bounds. Events whose cost does not depend on a noise parameter
  ((epsilon, delta) spends, loss histograms, profiles) are kept as they are.
* :func:`tree_aggregation_event`: DP-FTRL with tree aggregation restarted every epoch (each record
  in one leaf of one tree): a record touches ``ceil(log2(steps + 1))`` nodes, each a Gaussian of
  noise multiplier ``noise_multiplier``, so the whole run is one Gaussian with noise multiplier
  ``noise_multiplier / sqrt(depth)`` (Kairouz et al. 2021, "Practical and Private (Deep) Learning
  without Sampling or Shuffling", Appendix D; dp_accounting's ``SingleEpochTreeAggregationDpEvent``).
* :func:`banded_matrix_factorization_event`: DP-SGD / DP-FTRL with a ``b``-banded lower-triangular
  strategy matrix ``C`` and ``b``-min-separated participation (a record takes part at most ``k``
  times, at steps at least ``b`` apart): the columns a record touches have disjoint row supports, so
  the L2 sensitivity of ``C x`` is ``max over patterns sqrt(sum ||C[:, t]||^2)`` (Choquette-Choo,
  Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded Matrix Factorizations: A
  unified approach to private training", the sensitivity of b-banded strategies), computed exactly
  by dynamic programming; the release ``C x + N(0, (noise_multiplier
  * clip_norm)^2)`` is one Gaussian of noise multiplier ``noise_multiplier / sensitivity``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

from gaussdp._lazy import lazy_module
from gaussdp._validate import check_delta, check_epsilon, check_positive
from gaussdp.accounting.base import upper_bound_accountant
from gaussdp.accounting.events import (
    ComposedEvent,
    DiscreteGaussianEvent,
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    check_count,
)
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = [
    "banded_matrix_factorization_event",
    "noise_scale_for_schedule",
    "scale_noise",
    "tree_aggregation_event",
]

_SCALE_MIN, _SCALE_MAX = 1e-6, 1e6


def scale_noise(event: Event, factor: float) -> Event:
    """``event`` with every noise parameter multiplied by ``factor`` (fixed-cost events unchanged)."""
    factor = check_positive("factor", factor)
    if isinstance(event, SelfComposedEvent):
        return SelfComposedEvent(scale_noise(event.event, factor), event.count)
    if isinstance(event, ComposedEvent):
        return ComposedEvent(tuple(scale_noise(e, factor) for e in event.events))
    if isinstance(
        event,
        GaussianEvent | SubsampledGaussianEvent | ReplaceOneSubsampledGaussianEvent | FixedBatchGaussianEvent,
    ):
        return dataclasses.replace(event, noise_multiplier=event.noise_multiplier * factor)
    if isinstance(event, LaplaceEvent):
        return dataclasses.replace(event, scale=event.scale * factor)
    if isinstance(event, DiscreteGaussianEvent):
        return dataclasses.replace(event, sigma=event.sigma * factor)
    return event


def noise_scale_for_schedule(
    *, target_epsilon: float, delta: float, schedule: Event, accountant: str = "pld", **options: Any
) -> float:
    """Smallest factor ``c`` such that ``scale_noise(schedule, c)`` is ``(target_epsilon, delta)``-DP.

    Epsilon is non-increasing in ``c``, so Brent's method on ``log c`` finds the crossing; the answer
    is then checked with the same accountant and nudged up until the target holds (never below).

    >>> from gaussdp.accounting import SubsampledGaussianEvent, SelfComposedEvent, ComposedEvent
    >>> run = ComposedEvent((SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 1000),
    ...                      SelfComposedEvent(SubsampledGaussianEvent(2.0, 0.1), 100)))
    >>> c = noise_scale_for_schedule(target_epsilon=3.0, delta=1e-5, schedule=run)
    >>> 0.5 < c < 2.0
    True

    Raises:
        InvalidParameter: an approximate accountant (e.g. "gdp"), bad arguments, or no factor in
            [1e-6, 1e6] meets the target (e.g. fixed-cost events alone exceed it).
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    upper_bound_accountant(accountant, **options).compose(schedule)  # validates name, options, tree

    def eps_of(c: float) -> float:
        try:
            return (
                upper_bound_accountant(accountant, **options).compose(scale_noise(schedule, c)).epsilon(delta)
            )
        except InvalidParameter:
            return math.inf

    def f(log_c: float) -> float:
        e = eps_of(math.exp(log_c))
        if not math.isfinite(e):
            return 700.0
        return (math.log(e) if e > 0.0 else -700.0) - math.log(target)

    hi = 1.0
    while f(math.log(hi)) > 0.0:
        hi *= 4.0
        if hi > _SCALE_MAX:
            raise InvalidParameter(
                f"no noise scale up to {_SCALE_MAX:g} gives epsilon={target:g} at delta={delta:g}"
            )
    lo = hi / 4.0
    while f(math.log(lo)) <= 0.0:
        lo /= 4.0
        if lo < _SCALE_MIN:
            return _SCALE_MIN
    c = math.exp(optimize.brentq(f, math.log(lo), math.log(hi), xtol=1e-6, rtol=1e-8, maxiter=100))
    bump = 1e-9
    for _ in range(200):
        if eps_of(c) <= target:
            return c
        c *= 1.0 + bump
        bump *= 2.0
    raise InvalidParameter(f"could not verify a noise scale for epsilon={target:g}, delta={delta:g}")


def tree_aggregation_event(noise_multiplier: float, steps_per_epoch: int | Sequence[int]) -> GaussianEvent:
    """The Gaussian equivalent to single-epoch tree aggregation (DP-FTRL), restarted every epoch.

    ``steps_per_epoch``: the number of leaves of each tree (one per step; several trees when the
    epochs differ in length); each record sits in exactly one leaf of one tree.
    """
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    steps = [steps_per_epoch] if isinstance(steps_per_epoch, int) else list(steps_per_epoch)
    if not steps:
        raise InvalidParameter("steps_per_epoch must not be empty")
    depth = math.ceil(math.log2(max(check_count(s, "steps_per_epoch") for s in steps) + 1))
    return GaussianEvent(noise_multiplier / math.sqrt(depth))


def banded_matrix_factorization_event(
    noise_multiplier: float, strategy: ArrayLike, *, bands: int, max_participations: int
) -> GaussianEvent:
    """The Gaussian equivalent to a banded matrix-factorisation mechanism over a whole run.

    Args:
        noise_multiplier: noise standard deviation / clip norm of the noise added to ``C x``.
        strategy: the lower-triangular ``n x n`` strategy matrix ``C``; ``C[i, j] = 0`` for
            ``i - j >= bands`` (checked).
        bands: the number of bands ``b``; participation must be ``b``-min-separated.
        max_participations: the most steps one record takes part in (``k``), at least ``b`` apart.
    """
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    c = np.asarray(strategy, dtype=np.float64)
    b = check_count(bands, "bands")
    k = check_count(max_participations, "max_participations")
    if c.ndim != 2 or c.shape[0] != c.shape[1] or not np.all(np.isfinite(c)):
        raise InvalidParameter(f"strategy must be a finite square matrix, got shape {c.shape}")
    n = c.shape[0]
    i, j = np.indices(c.shape)
    if np.any(c[(i < j) | (i - j >= b)] != 0.0):
        raise InvalidParameter(
            f"strategy must be lower triangular with {b} bands (C[i, j] = 0 for i - j >= {b})"
        )
    col2 = np.sum(c * c, axis=0)
    # best[m][t]: the largest sum of squared column norms over m participations at steps >= t, each
    # at least b after the previous (disjoint row supports: the squared norms add up).
    best = np.zeros((k + 1, n + b + 1))
    for m in range(1, k + 1):
        for t in range(n - 1, -1, -1):
            best[m, t] = max(best[m, t + 1], col2[t] + best[m - 1, t + b])
    sens = math.sqrt(float(best[k, 0]))
    if sens == 0.0:
        raise InvalidParameter("the strategy matrix is zero: nothing is released")
    return GaussianEvent(noise_multiplier / sens)
