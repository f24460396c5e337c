"""Byzantine-robust aggregation of clipped client updates: Krum, multi-Krum, median, trimmed mean.

Each aggregator takes the stacked, already clipped updates ``U`` (a ``[clients, params]`` matrix,
every row of L2 norm ``<= clip_norm``) and returns one vector. Used alone they resist ``f`` malicious
clients (``f < n/3`` for the guarantees cited below); used inside
:class:`gaussdp.federated.DPFedAvg` (``robust=...``) their output is noised once, with the noise
calibrated to the L2 sensitivity bound stated by :meth:`RobustAggregator.output_radius`:

**Sensitivity we use.** A robust aggregate depends on *which* clients survive the filter, so adding
or removing one client can change the selection of all the others: the textbook sensitivity ``C`` of
a clipped sum does not hold for "filter then sum". What does hold, for every input, is a bound on
the *range* of the aggregate: every aggregator here returns a vector of norm ``<= R`` (below), so
under add/remove (or replacement) of one client the output moves by at most ``2 R`` in L2. We add
``N(0, (z * 2R)^2 I)`` to the aggregate; the accounting event is a Gaussian with noise multiplier
``z`` (on a Poisson sample of clients: ``SubsampledGaussianEvent(z, q)``).

* Krum / multi-Krum output one clipped update or the mean of ``m`` of them: ``R = C``.
* Coordinate-wise median: for each coordinate at least ``ceil(n/2)`` rows have an entry at least as
  large in absolute value as the median, so ``ceil(n/2) * ||med||^2 <= sum_i ||u_i||^2 <= n C^2``
  and ``R = C * sqrt(n / ceil(n/2)) <= sqrt(2) C``; we use ``sqrt(2) C`` for every ``n``.
* Coordinate-wise trimmed mean dropping ``b = floor(beta n)`` values at each end: by Cauchy-Schwarz
  each kept mean satisfies ``t_j^2 <= (1/(n-2b)) sum_i u_ij^2``, so ``||t||^2 <= n C^2 / (n - 2b)``
  and ``R = C / sqrt(1 - 2 beta)`` for every ``n``.

This is the honest price of robustness under DP: the noise is ``2R`` on an *average*, where plain
DP-FedAvg adds ``C`` on a *sum* that is then divided by the expected number of clients.

References:
    Blanchard, El Mhamdi, Guerraoui & Stainer 2017, "Machine Learning with Adversaries: Byzantine
    Tolerant Gradient Descent" (Krum, multi-Krum; Proposition 1 needs ``2f + 2 < n``).
    Yin, Chen, Ramchandran & Bartlett 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates" (coordinate-wise median and trimmed mean, Theorems 1 and 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from gaussdp._validate import real_number
from gaussdp.errors import InvalidParameter, UnsafeInput

__all__ = [
    "CoordinateMedian",
    "Krum",
    "RobustAggregator",
    "TrimmedMean",
    "coordinate_median",
    "krum",
    "robust_aggregator",
    "trimmed_mean",
]


def _check_matrix(updates: object) -> np.ndarray:
    u = np.asarray(updates)
    if u.ndim != 2:
        raise UnsafeInput(f"updates must be a 2-D [clients, params] array, got updates.shape={u.shape}")
    if u.shape[0] == 0:
        raise UnsafeInput("updates must hold at least one client's update, got 0 rows")
    if not np.issubdtype(u.dtype, np.floating):
        u = u.astype(np.float64)
    if not np.isfinite(u).all():
        raise UnsafeInput("updates contain NaN or Inf; nothing was aggregated")
    return u


def _check_f(num_byzantine: object) -> int:
    if isinstance(num_byzantine, bool) or not isinstance(num_byzantine, int | np.integer):
        raise TypeError(f"num_byzantine must be an int, got num_byzantine={num_byzantine!r}")
    if num_byzantine < 0:
        raise InvalidParameter(f"num_byzantine must be >= 0, got num_byzantine={num_byzantine}")
    return int(num_byzantine)


def _pairwise_sq_dists(u: np.ndarray) -> np.ndarray:
    # ||a-b||^2 = ||a||^2 + ||b||^2 - 2 a.b, in float64 so that ties are decided consistently.
    g = u.astype(np.float64, copy=False)
    sq = np.einsum("ij,ij->i", g, g)
    d = sq[:, None] + sq[None, :] - 2.0 * (g @ g.T)
    np.maximum(d, 0.0, out=d)
    np.fill_diagonal(d, 0.0)
    return d


def krum_scores(updates: np.ndarray, num_byzantine: int) -> np.ndarray:
    """Krum score of every row: the sum of squared distances to its ``n - f - 2`` nearest neighbours."""
    u = _check_matrix(updates)
    f = _check_f(num_byzantine)
    n = u.shape[0]
    k = n - f - 2
    if k < 1:
        raise InvalidParameter(
            f"Krum needs n > f + 2 clients (n - f - 2 >= 1 neighbours), got n={n}, num_byzantine={f}"
        )
    d = _pairwise_sq_dists(u)
    np.fill_diagonal(d, np.inf)
    nearest = np.partition(d, k - 1, axis=1)[:, :k]
    return nearest.sum(axis=1)


def krum(updates: np.ndarray, *, num_byzantine: int, multi: int = 1) -> np.ndarray:
    """Krum (``multi=1``) or multi-Krum (mean of the ``multi`` rows of lowest Krum score).

    Blanchard et al. 2017, Section 4: the score of row ``i`` sums the squared distances to its
    ``n - f - 2`` nearest rows; an outlier far from the honest cluster gets a large score.
    """
    u = _check_matrix(updates)
    scores = krum_scores(u, num_byzantine)
    m = int(multi)
    if not 1 <= m <= u.shape[0]:
        raise InvalidParameter(f"multi must be in [1, n={u.shape[0]}], got multi={multi}")
    chosen = np.argsort(scores, kind="stable")[:m]
    return u[chosen].mean(axis=0)


def coordinate_median(updates: np.ndarray) -> np.ndarray:
    """Coordinate-wise median (Yin et al. 2018, Algorithm 1 with option I)."""
    u = _check_matrix(updates)
    return np.median(u, axis=0).astype(u.dtype, copy=False)


def trimmed_mean(updates: np.ndarray, *, beta: float) -> np.ndarray:
    """Coordinate-wise ``beta``-trimmed mean: drop the ``floor(beta n)`` largest and smallest values of
    each coordinate, average the rest (Yin et al. 2018, option II). Needs ``beta < 1/2``."""
    u = _check_matrix(updates)
    b_frac = _check_beta(beta)
    n = u.shape[0]
    b = math.floor(b_frac * n)
    if n - 2 * b < 1:
        raise InvalidParameter(f"trimmed mean with beta={beta} leaves no value of n={n} clients")
    if b == 0:
        return u.mean(axis=0)
    s = np.sort(u, axis=0)
    return s[b : n - b].mean(axis=0)


def _check_beta(beta: object) -> float:
    v = real_number("beta", beta)
    if not 0.0 <= v < 0.5:
        raise InvalidParameter(f"beta must be in [0, 0.5), got beta={beta!r}")
    return v


class RobustAggregator:
    """A robust aggregation rule with the norm bound of its output (see the module docstring)."""

    name: ClassVar[str] = "robust"

    def __call__(self, updates: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def output_radius(self, clip_norm: float) -> float:
        """``R``: every output of this rule on rows of norm ``<= clip_norm`` has norm ``<= R``."""
        raise NotImplementedError

    def sensitivity(self, clip_norm: float) -> float:
        """L2 sensitivity under add/remove or replacement of one client: ``2 R``."""
        return 2.0 * self.output_radius(clip_norm)


@dataclass(frozen=True)
class Krum(RobustAggregator):
    """Krum / multi-Krum with ``num_byzantine`` assumed attackers (``multi`` rows averaged)."""

    num_byzantine: int = 0
    multi: int = 1
    name: ClassVar[str] = "krum"

    def __call__(self, updates: np.ndarray) -> np.ndarray:
        u = _check_matrix(updates)
        # With fewer than f + 3 rows Krum is undefined; fall back to the rule's weakest safe form,
        # the single row closest to all others (f = n - 3 would be meaningless), i.e. medoid.
        f = min(self.num_byzantine, max(u.shape[0] - 3, 0))
        if u.shape[0] < 3:
            return coordinate_median(u) if u.shape[0] > 1 else u[0].copy()
        return krum(u, num_byzantine=f, multi=min(self.multi, u.shape[0]))

    def output_radius(self, clip_norm: float) -> float:
        # A (mean of) clipped row(s); the n < 3 fallback (median of <= 2 rows = their mean) too.
        return float(clip_norm)


@dataclass(frozen=True)
class CoordinateMedian(RobustAggregator):
    """Coordinate-wise median."""

    name: ClassVar[str] = "median"

    def __call__(self, updates: np.ndarray) -> np.ndarray:
        return coordinate_median(updates)

    def output_radius(self, clip_norm: float) -> float:
        return math.sqrt(2.0) * float(clip_norm)


@dataclass(frozen=True)
class TrimmedMean(RobustAggregator):
    """Coordinate-wise trimmed mean dropping a ``beta`` fraction at each end."""

    beta: float = 0.1
    name: ClassVar[str] = "trimmed_mean"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", _check_beta(self.beta))

    def __call__(self, updates: np.ndarray) -> np.ndarray:
        return trimmed_mean(updates, beta=self.beta)

    def output_radius(self, clip_norm: float) -> float:
        return float(clip_norm) / math.sqrt(1.0 - 2.0 * self.beta)


def robust_aggregator(name: str, **kwargs: object) -> RobustAggregator:
    """``"krum"``, ``"multi_krum"``, ``"median"`` or ``"trimmed_mean"`` by name."""
    if name == "krum":
        return Krum(**kwargs)  # type: ignore[arg-type]
    if name == "multi_krum":
        kwargs.setdefault("multi", 2)
        return Krum(**kwargs)  # type: ignore[arg-type]
    if name == "median":
        return CoordinateMedian()
    if name == "trimmed_mean":
        return TrimmedMean(**kwargs)  # type: ignore[arg-type]
    raise InvalidParameter(
        f"robust aggregator must be 'krum', 'multi_krum', 'median' or 'trimmed_mean', got {name!r}"
    )
