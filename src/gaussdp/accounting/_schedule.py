"""Noise calibration for multi-phase schedules, and the events of tree aggregation and banded MF.

* :func:`noise_scale_for_schedule`: a training run of several phases (different sample rates, noise
  multipliers, step counts, even batch sampling schemes) is one event tree; the smallest factor by
  which *all* its noise parameters can be multiplied so that it meets a target (epsilon, delta),
  with an accountant that gives upper bounds. Events whose cost does not depend on a noise parameter
  ((epsilon, delta) spends, loss histograms, profiles) are kept as they are.
* :func:`tree_aggregation_event`: DP-FTRL with tree aggregation, one tree per pass over the data;
  the caller says in how many trees a record takes part (epochs over the same data compose; one
  pass over disjoint data is parallel).
* :func:`banded_matrix_factorization_event`: DP-SGD / DP-FTRL with a banded lower-triangular
  strategy matrix; the caller says how often a record takes part and how far apart, and the
  sensitivity under that participation is computed from the matrix.

Both return the :class:`GaussianEvent` equivalent to the whole run, whose noise multiplier is the
noise multiplier of the mechanism divided by the L2 sensitivity of what it releases.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from gaussdp._validate import check_delta, check_epsilon, check_positive
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
from gaussdp.accounting.inverse import smallest_noise
from gaussdp.accounting.registry import accountant as make_accountant
from gaussdp.errors import InvalidParameter

__all__ = [
    "banded_matrix_factorization_event",
    "noise_scale_for_schedule",
    "scale_noise",
    "tree_aggregation_event",
]

_SCALE_MIN, _SCALE_MAX = 1e-6, 1e6


def scale_noise(event: Event, factor: float) -> Event:
    """``event`` with every noise parameter multiplied by ``factor`` (fixed-cost events unchanged).

    Accepted domain: any event tree and ``factor`` finite and > 0 (else InvalidParameter; TypeError
    for a non-number); a scaled noise parameter outside its event's domain is refused by that event.
    """
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

    Accepted domain: ``target_epsilon`` finite and > 0, ``delta`` in (0, 1), a schedule the named
    upper-bound accountant accepts, and a factor in [1e-6, 1e6].

    Raises:
        InvalidParameter: an approximate accountant (e.g. "gdp"), bad arguments, or no factor in
            [1e-6, 1e6] meets the target (e.g. fixed-cost events alone exceed it).
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    make_accountant(accountant, **options).compose(schedule)  # validates name, options, tree

    def eps_of(c: float) -> float:
        try:
            return make_accountant(accountant, **options).compose(scale_noise(schedule, c)).epsilon(delta)
        except InvalidParameter:
            return math.inf

    return smallest_noise(eps_of, target, delta, lo_bound=_SCALE_MIN, hi_bound=_SCALE_MAX, what="noise scale")


def tree_aggregation_event(
    noise_multiplier: float, steps_per_tree: int | Sequence[int], *, trees_per_record: int
) -> GaussianEvent:
    """The Gaussian equivalent to DP-FTRL's tree aggregation, one tree per pass over the data.

    Participation: each record is in at most one leaf of a tree and in at most ``trees_per_record``
    trees (epochs over the same data: one tree per epoch, so ``trees_per_record = epochs``; one pass
    over disjoint data: ``1``).

    A tree over ``T`` steps releases every dyadic node ``[k 2^j + 1, (k + 1) 2^j]`` that is complete
    by step ``T``, each with Gaussian noise of standard deviation ``noise_multiplier * clip_norm``;
    a leaf lies in ``T.bit_length()`` (``= ceil(log2(T + 1))``) of them. Nodes of different trees
    are different releases with independent noise, so a record in the trees ``S`` moves the released
    vector by at most ``clip_norm * sqrt(sum over S of depth)`` in L2 (the rows it touches are
    disjoint), and the whole run is one Gaussian of noise multiplier ``noise_multiplier /
    sqrt(sum of the trees_per_record largest depths)``: exactly the composition of those trees
    (Gaussian compositions are exact in mu-GDP; Dong, Roth & Su 2019, Corollary 2.13). With
    ``trees_per_record=1`` this is Kairouz et al. 2021, Appendix D (dp_accounting's
    ``SingleEpochTreeAggregationDpEvent``).

    Accepted domain: ``noise_multiplier`` finite and > 0; ``steps_per_tree`` an int >= 1 (every
    tree has that many steps) or a non-empty sequence of ints >= 1 (one per tree); ``trees_per_record``
    an int >= 1, at most the number of trees when they are listed. The returned noise multiplier is
    rounded down (a larger epsilon) by two ulps over the float division and square root.

    >>> round(tree_aggregation_event(5.0, [1000] * 10, trees_per_record=10).noise_multiplier, 6)
    0.5
    >>> round(tree_aggregation_event(5.0, [1000] * 10, trees_per_record=1).noise_multiplier, 6)
    1.581139

    Raises:
        TypeError: a count that is not an int (bools refused).
        InvalidParameter: ``noise_multiplier`` not finite or <= 0, a count < 1, an empty
            ``steps_per_tree``, ``trees_per_record`` above the number of listed trees, or a noise
            multiplier below the smallest a :class:`GaussianEvent` accepts.

    References:
        Kairouz, McMahan, Song, Thakkar, Thakurta & Xu 2021, "Practical and Private (Deep) Learning
        without Sampling or Shuffling", Appendix D; Dong, Roth & Su 2019, "Gaussian Differential
        Privacy", Corollary 2.13.
    """
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    m = check_count(trees_per_record, "trees_per_record")
    if isinstance(steps_per_tree, numbers.Integral) and not isinstance(steps_per_tree, bool):
        depth2 = m * check_count(steps_per_tree, "steps_per_tree").bit_length()
    else:
        if isinstance(steps_per_tree, str | bytes) or not isinstance(steps_per_tree, Sequence):
            raise TypeError(
                f"steps_per_tree must be an int or a sequence of ints, got steps_per_tree={steps_per_tree!r}"
            )
        if not steps_per_tree:
            raise InvalidParameter("steps_per_tree must not be empty")
        depths = sorted((check_count(s, "steps_per_tree").bit_length() for s in steps_per_tree), reverse=True)
        if m > len(depths):
            raise InvalidParameter(
                f"trees_per_record must be <= the number of trees ({len(depths)}), got trees_per_record={m}"
            )
        depth2 = sum(depths[:m])
    return _gaussian_for_sensitivity(noise_multiplier, float(depth2))


def banded_matrix_factorization_event(
    noise_multiplier: float,
    strategy: ArrayLike,
    *,
    bands: int,
    min_separation: int,
    max_participations: int,
) -> GaussianEvent:
    """The Gaussian equivalent to a banded matrix-factorisation mechanism (DP-FTRL / DP-SGD) over a run.

    Participation: each record takes part in at most ``max_participations`` of the ``n`` steps, any
    two of them at least ``min_separation`` steps apart (``k`` epochs over the same data, one step
    per record per epoch: ``max_participations=k`` and ``min_separation=1`` when the data are
    reshuffled each epoch, the epoch length when every epoch visits them in the same order).

    The mechanism releases ``C x + Z`` with ``Z ~ N(0, (noise_multiplier * clip_norm)^2)`` per
    entry, where row ``t`` of ``x`` is step ``t``'s sum of clipped gradients. A record that takes
    part in the steps ``S`` with gradients ``g_t`` (``||g_t|| <= clip_norm``) moves ``C x`` by
    ``sum over S of C[:, t] g_t^T``, whose squared Frobenius norm is ``sum over t, s in S of
    G[t, s] <g_t, g_s>`` with ``G = C^T C``. Its worst case is bounded by ``clip_norm^2 *
    sum over t, s in S of |G[t, s]|``, with equality when those ``G[t, s]`` are >= 0 (e.g. a
    non-negative ``C``: all ``g_t`` equal) and in particular when the columns of ``S`` do not
    overlap (``min_separation >= bands``: ``G`` is diagonal on ``S``, the b-min-separated case of
    Choquette-Choo et al. 2023). The sensitivity charged is the largest of these bounds over every
    allowed pattern ``S``, computed by dynamic programming, never assumed: exactly when
    ``min_separation >= bands`` or when the search over the last ``bands - 1`` steps fits about
    10^6 state updates, else the two-stage upper bound of arXiv 2306.08153, Algorithm 4 (larger or
    equal). The run is then one Gaussian of noise multiplier ``noise_multiplier / sensitivity``.
    Float rounding of ``G`` and of the sums is bounded and added, and the noise multiplier rounded
    down (a larger epsilon).

    Args:
        noise_multiplier: noise standard deviation / clip norm of the noise added to ``C x``.
        strategy: the lower-triangular ``n x n`` strategy matrix ``C``; ``C[i, j] = 0`` for
            ``i - j >= bands`` (checked).
        bands: the number of bands ``b`` of ``C``.
        min_separation: the fewest steps between two participations of one record (>= 1).
        max_participations: the most steps one record takes part in (``k`` >= 1).

    Accepted domain: ``noise_multiplier`` finite and > 0; ``strategy`` a finite, non-zero, square,
    lower-triangular ``b``-banded matrix; ``bands``, ``min_separation``, ``max_participations`` ints
    >= 1; a search of at most about 5 * 10^7 array updates (``n^2 * k`` when ``min_separation <
    bands`` and the exact search is too large, ``n * k`` otherwise).

    >>> import numpy as np
    >>> banded_matrix_factorization_event(
    ...     3.0, np.eye(10), bands=1, min_separation=1, max_participations=4
    ... ).noise_multiplier  # doctest: +ELLIPSIS
    1.4999999999...

    Raises:
        TypeError: a count that is not an int.
        InvalidParameter: a bad ``noise_multiplier`` or count, a strategy that is not finite, square,
            lower triangular with ``bands`` bands, or is zero; a search above the work limit (the
            message names ``min_separation`` and ``bands``).

    References:
        Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded
        Matrix Factorizations: A unified approach to private training" (arXiv 2306.08153), Eq. (5)
        (the bound by ``|C^T C|``), Algorithm 3 (VecSens) and Algorithm 4 (the upper bound);
        Choquette-Choo, McMahan, Rush & Thakurta 2023, "Multi-Epoch Matrix Factorization Mechanisms
        for Private Machine Learning" (arXiv 2211.06530), Section 2 (sensitivity under multiple
        participations).
    """
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
    c = np.asarray(strategy, dtype=np.float64)
    b = check_count(bands, "bands")
    sep = check_count(min_separation, "min_separation")
    k = check_count(max_participations, "max_participations")
    if c.ndim != 2 or c.shape[0] != c.shape[1] or not np.all(np.isfinite(c)):
        raise InvalidParameter(f"strategy must be a finite square matrix, got shape {c.shape}")
    n = c.shape[0]
    i, j = np.indices(c.shape)
    if np.any(c[(i < j) | (i - j >= b)] != 0.0):
        raise InvalidParameter(
            f"strategy must be lower triangular with {b} bands (C[i, j] = 0 for i - j >= {b})"
        )
    b = min(b, n)
    k = min(k, (n - 1) // sep + 1)  # no more participations fit in n steps
    # gram[d][t] bounds |G[t, t + d]| from above: the computed dot product plus its rounding error
    # (at most n * u * (|C|^T |C|)[t, t + d] in any summation order, Higham 2002, Eq. (3.5), with
    # margin). Only the diagonal matters when participations are at least `bands` apart.
    gamma = 1.01 * (n + 2) * _U
    a = np.abs(c)
    if sep >= b:
        gram = [np.abs(np.einsum("ij,ij->j", c, c)) + gamma * np.einsum("ij,ij->j", a, a)]
    else:
        w = np.abs(c.T @ c) + gamma * (a.T @ a)
        gram = [np.diagonal(w, d).copy() for d in range(b)]
    sens2 = _pattern_max(gram, sep, k)
    if sens2 == 0.0:
        raise InvalidParameter("the strategy matrix is zero: nothing is released")
    # The sums above add at most k * (2 * bands + 1) non-negative terms: bound their rounding.
    sens2 *= 1.0 + 1.01 * (k * (2 * b + 1) + 2) * _U
    return _gaussian_for_sensitivity(noise_multiplier, sens2)


_U = 2.0**-53  # unit roundoff of float64
_WORK_LIMIT = 1_000_000  # state updates of the windowed search (bounded work per call)


def _gaussian_for_sensitivity(noise_multiplier: float, sens2: float) -> GaussianEvent:
    """``GaussianEvent(noise_multiplier / sqrt(sens2))``, rounded down over the sqrt and division."""
    nm = noise_multiplier / math.sqrt(sens2)
    for _ in range(2):  # each of sqrt and / is correctly rounded (half an ulp): two ulps cover both
        nm = math.nextafter(nm, 0.0)
    return GaussianEvent(nm)


def _pattern_max(gram: list[np.ndarray], sep: int, k: int) -> float:
    """Largest ``sum over t, s in S of W[t, s]`` over the patterns ``S`` (``|S| <= k``, ``sep`` apart).

    ``W[t, t + d] = W[t + d, t] = gram[d][t]`` (>= 0) and zero for ``d >= len(gram)``. Exact when
    ``len(gram) == 1`` (only the diagonal: arXiv 2306.08153, Algorithm 3) or the windowed search
    fits the work limit; otherwise the two-stage upper bound of the same paper's Algorithm 4 (each
    row's best pattern, then the best pattern of those row values); refused past that.
    """
    n = gram[0].shape[0]
    if len(gram) == 1:
        return float(_vec_sens(gram[0][None, :], sep, k)[0])
    w = len(gram) - 1  # the window: the bands - 1 previous steps
    # Valid masks: strings of w bits whose ones are at least sep apart (counted to bound the work).
    count = [1] * (w + 1)
    for length in range(1, w + 1):
        count[length] = count[length - 1] + (count[length - sep] if length >= sep else 1)
    if n * count[w] * min(k, w // sep + 2) <= _WORK_LIMIT:
        return _windowed_max(gram, sep, k)
    if n * n * k > 50 * _WORK_LIMIT:
        raise InvalidParameter(
            f"the sensitivity of {n} steps with min_separation={sep} < bands={w + 1} and "
            f"max_participations={k} is past this search's work limit; give min_separation >= bands "
            "(b-min-separated participation), fewer bands, fewer steps or fewer participations"
        )
    full = np.zeros((n, n))
    for d, g in enumerate(gram):
        full[np.arange(n - d), np.arange(d, n)] = g
        full[np.arange(d, n), np.arange(n - d)] = g
    return float(_vec_sens(_vec_sens(full, sep, k)[None, :], sep, k)[0])


def _vec_sens(x: np.ndarray, sep: int, k: int) -> np.ndarray:
    """Per row of ``x`` (>= 0), the largest ``sum of x[r, t] over S`` with ``|S| <= k``, ``sep`` apart.

    ``f[t]`` holds the best sum over steps >= t; each pass allows one more participation: take step
    ``t`` (then steps from ``t + sep``) or skip it (the suffix maximum). arXiv 2306.08153,
    Algorithm 3 (VecSens), vectorised over rows.
    """
    rows, n = x.shape
    if rows * n * k > 50 * _WORK_LIMIT:
        raise InvalidParameter(
            f"max_participations={k} over {n} steps is past the work limit of this search; "
            "give a smaller max_participations or a larger min_separation"
        )
    f = np.zeros((rows, n + sep))
    for _ in range(k):
        take = x + f[:, sep : sep + n]
        nxt = np.zeros_like(f)
        nxt[:, :n] = np.maximum.accumulate(take[:, ::-1], axis=1)[:, ::-1]
        f = np.maximum(f, nxt)
    return f[:, 0]


def _windowed_max(gram: list[np.ndarray], sep: int, k: int) -> float:
    """The exact maximum of :func:`_pattern_max` by dynamic programming over a sliding window.

    Adding step ``t`` adds ``gram[0][t]`` plus twice ``gram[d][t - d]`` for every earlier
    participation ``t - d`` with ``d < len(gram)``: the state is the participations in that window
    (a bit mask, bit ``d - 1`` for step ``t - d``) and how many participations were used.
    """
    n = gram[0].shape[0]
    w = len(gram) - 1
    full = (1 << w) - 1
    near = (1 << (sep - 1)) - 1  # bits of the steps closer than sep (sep <= w here)
    states: dict[tuple[int, int], float] = {(0, 0): 0.0}
    for t in range(n):
        pair = [2.0 * float(gram[d][t - d]) if t - d >= 0 else 0.0 for d in range(1, w + 1)]
        nxt: dict[tuple[int, int], float] = {}
        for (mask, used), value in states.items():
            skip = ((mask << 1) & full, used)
            if nxt.get(skip, -1.0) < value:
                nxt[skip] = value
            if used < k and not mask & near:
                gain = float(gram[0][t])
                bits, d = mask, 0
                while bits:
                    if bits & 1:
                        gain += pair[d]
                    bits >>= 1
                    d += 1
                take = (((mask << 1) | 1) & full, used + 1)
                if nxt.get(take, -1.0) < value + gain:
                    nxt[take] = value + gain
        states = nxt
    return max(states.values())
