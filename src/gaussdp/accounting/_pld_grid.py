"""The PLD accountant's grid: the spacing ``h`` for a composition and each event's discrete PLD on it.

Each distinct event is discretised once per grid (and per power-of-16 bucket of its count, which
sizes its truncation) by connect-the-dots on its exact privacy profile, pessimistically, so the
discrete PLD belongs to a dominating pair (:mod:`gaussdp.accounting._pld_values`). The default
spacing follows the per-step spread of the privacy loss (:func:`loss_mu2`) so that the
discretisation adds about 0.04% to epsilon at most; any spacing gives an upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from scipy import special

from gaussdp.accounting._mechanisms import (
    PROFILE_LEAVES,
    leaf_atom_scale,
    leaf_log_delta,
    leaf_loss_range,
    leaf_mu2,
)
from gaussdp.accounting._pld_values import (
    MAX_FFT,
    Direction,
    FloatArray,
    LeafPMF,
    connect_dots,
    make_leaf,
    profile_points,
)
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.events import (
    EpsilonDeltaEvent,
    Event,
    GaussianEvent,
    PrivacyLossDistributionEvent,
    SubsampledGaussianEvent,
)
from gaussdp.errors import InvalidParameter

# Discretisation error the default grid aims at, relative to epsilon (results stay upper bounds; this
# is how far above the exact epsilon they may be).
TARGET_REL = 4e-4


def count_bucket(count: int) -> int:
    """The count rounded up to a power of 16: per-step truncation is sized for it, so the cached
    discretisation of an event changes only a few times while a training loop adds steps."""
    return 1 << (4 * math.ceil(max(0, (count - 1).bit_length()) / 4))


def loss_mu2(counts: Mapping[Event, int]) -> float:
    """``sum count * s^2`` over the composition, ``s^2`` each event's per-step privacy loss variance.

    Subsampled Gaussian: ``q^2 (e^{1/sigma^2} - 1)``, the CLT mu^2 of Bu et al. 2020; Gaussian:
    ``1 / sigma^2`` (its loss is N(mu^2/2, mu^2)); (epsilon, delta): ``epsilon^2`` (its losses are
    +-epsilon: the variance is at most epsilon^2); profile leaves: their own
    (:func:`~gaussdp.accounting._mechanisms.leaf_mu2`). Divided by the number of steps it is the mean
    per-step spread that both the choice of grid and the coarse-grid check compare ``h`` with.
    """
    mu2 = 0.0
    for e, c in counts.items():
        if isinstance(e, GaussianEvent):
            mu2 += c / e.noise_multiplier**2
        elif isinstance(e, SubsampledGaussianEvent):
            mu2 += c * e.sample_rate**2 * math.expm1(min(1.0 / e.noise_multiplier**2, 700.0))
        elif isinstance(e, EpsilonDeltaEvent):
            mu2 += c * e.epsilon**2
        elif isinstance(e, PROFILE_LEAVES):
            mu2 += c * leaf_mu2(e)
    return mu2


class Discretisation:
    """The grid spacing of a composition and the (cached) discrete PLD of each event on it.

    Args:
        fixed_h: a fixed grid spacing, or ``None`` to choose it per composition (:meth:`grid_h`).
        tail_mass: probability mass the truncation of each composition may move to +infinity.
    """

    def __init__(self, *, fixed_h: float | None, tail_mass: float) -> None:
        self.fixed_h = fixed_h
        self.tail_mass = tail_mass
        self._leaf_cache: dict[tuple[object, ...], LeafPMF] = {}

    def is_coarse(self, counts: Mapping[Event, int]) -> bool:
        """Whether h exceeds a tenth of the per-step loss spread (very long runs with tiny losses).

        There the discretisation, though still an upper bound, can be looser than RDP; both are
        upper bounds, so the caller reports the smaller.
        """
        return self.grid_h(counts) > 0.1 * math.sqrt(loss_mu2(counts) / max(1, sum(counts.values())))

    def parts(self, counts: Mapping[Event, int], direction: Direction, h: float) -> list[tuple[LeafPMF, int]]:
        """The discrete PLD of each distinct event with its count; the Gaussian events as one leaf.

        Plain Gaussian events compose exactly into one Gaussian of ``mu = sqrt(sum count /
        sigma^2)``, which enters as one leaf of noise multiplier ``1 / mu``.
        """
        parts: list[tuple[LeafPMF, int]] = []
        mu = math.sqrt(
            math.fsum(c / e.noise_multiplier**2 for e, c in counts.items() if isinstance(e, GaussianEvent))
        )
        if mu > 0.0:
            parts.append((self.leaf_pmf(1.0 / mu, 1, direction, h), 1))
        for e, c in counts.items():
            if not isinstance(e, GaussianEvent):
                parts.append((self.leaf_pmf(e, c, direction, h), c))
        return parts

    def grid_h(self, counts: Mapping[Event, int]) -> float:
        """The grid spacing for this composition: the fixed one, or one chosen from the loss spread."""
        if self.fixed_h is not None:
            return float(self.fixed_h)
        mu2 = loss_mu2(counts)
        steps = max(1, sum(counts.values()))
        # Connect-the-dots moves each step's mass to neighbouring grid points, which widens the
        # composed loss by a variance of at most about h^2/4 per step: relative to s^2 that moves
        # epsilon by at most about h^2 / (8 s^2) (measured: 0.14-0.74 of that on DP-SGD settings with
        # 2 .. 1e5 steps, against grids 16x finer). h keeps it at TARGET_REL, whatever the count.
        s_step = math.sqrt(mu2 / steps)
        h = min(1e-2, max(1e-9, s_step * math.sqrt(8.0 * TARGET_REL)))
        # Each event's own loss range must fit in a modest grid too (its tail mass is tiny, but it
        # sets the array length): at most 2^16 points per event.
        width = max((self._leaf_range(e, c) for e, c in counts.items()), default=0.0)
        h = max(h, width / 65536.0)
        # An (epsilon, delta) event's losses +-epsilon are rounded up to the grid: keep that rounding
        # below 0.05% of epsilon.
        eps_min = min(
            (e.epsilon for e in counts if isinstance(e, EpsilonDeltaEvent) and e.epsilon > 0),
            default=math.inf,
        )
        h = min(h, eps_min / 2000.0)
        # Likewise for the atoms of user-supplied loss histograms and profiles (connect the dots
        # splits an atom between its two grid neighbours).
        atom_min = min((leaf_atom_scale(e) for e in counts), default=math.inf)
        h = min(h, atom_min / 2000.0)
        # On a ladder of quarter powers of two, so that h (and the cached per-event discretisations)
        # change only when the composition changes scale: online use recomputes almost nothing.
        # (Whole powers of two where (epsilon, delta) events or user-supplied atoms are present: their
        # losses are rounded to the grid, and the tests of their exact composition were calibrated there.)
        rungs_per_octave = 1.0 if min(eps_min, atom_min) < math.inf else 4.0
        h = float(2.0 ** (math.floor(rungs_per_octave * math.log2(h)) / rungs_per_octave))
        # Too fine a grid for the profile's floating-point accuracy: connect-the-dots takes second
        # differences of delta, whose rounding grows like 1/h and shows as mass above 1 in the
        # discrete PLD; raised to a large count it swamps the answer (q = 1e-6, sigma = 100, 1e7 steps:
        # excess 25 at h = 2^-28, 2e-5 at 2^-26). Coarsen while the count times the excess exceeds 1
        # (answers still agree with 16x finer grids at an excess of 1: q = 1e-6, sigma = 1, 1e5 steps);
        # the answer stays an upper bound either way: this keeps it tight.
        for _ in range(16):
            if h >= 1e-2 or self._mass_excess(counts, h) <= 1.0:
                break
            h *= 2.0
        return h

    def _mass_excess(self, counts: Mapping[Event, int], h: float) -> float:
        # Every discretised leaf (profile leaves have one symmetric pair for both directions).
        excess = 0.0
        for e, c in counts.items():
            if isinstance(e, SubsampledGaussianEvent):
                for direction in ("remove", "add"):
                    excess += c * abs(self.leaf_pmf(e, c, direction, h).mass_excess)
            elif isinstance(e, PROFILE_LEAVES):
                excess += c * abs(self.leaf_pmf(e, c, "remove", h).mass_excess)
        return excess

    def _leaf_range(self, leaf: Event, count: int) -> float:
        if isinstance(leaf, SubsampledGaussianEvent):
            lo, hi = self.support(leaf.noise_multiplier, leaf.sample_rate, count, "remove")
            return hi - lo
        if isinstance(leaf, PROFILE_LEAVES):
            lo, hi = leaf_loss_range(leaf, self.leaf_tail(count))
            return hi - lo
        return 0.0

    def leaf_tail(self, count: int) -> float:
        # The per-step truncation mass of _support, on the same buckets of the count.
        return self.tail_mass / (4.0 * count_bucket(count))

    def support(self, sigma: float, q: float, count: int, direction: Direction) -> tuple[float, float]:
        bucket = count_bucket(count)
        z = float(-special.ndtri(self.tail_mass / (4.0 * bucket)))
        if q >= 1.0:
            mu = 1.0 / sigma
            return mu * mu / 2.0 - z * mu, mu * mu / 2.0 + z * mu
        log1mq, log_q = math.log1p(-q), math.log(q)
        if direction == "remove":
            return log1mq, float(np.logaddexp(log1mq, log_q + (2 * (1 + z * sigma) - 1) / (2 * sigma**2)))
        return -float(np.logaddexp(log1mq, log_q + (2 * z * sigma - 1) / (2 * sigma**2))), -log1mq

    def leaf_pmf(self, leaf: Event | float, count: int, direction: Direction, h: float) -> LeafPMF:
        # Per-step truncation mass shrinks with the count, on powers of 16 (_bucket) so that the cache is
        # reused while a training loop composes one step at a time.
        bucket = count_bucket(count)
        if isinstance(leaf, PROFILE_LEAVES):
            direction = "remove"  # one symmetric dominating pair serves both compositions
        key = (leaf, direction, h, bucket)
        hit = self._leaf_cache.get(key)
        if hit is not None:
            return hit
        if isinstance(leaf, EpsilonDeltaEvent):
            # Exact PLD of an (eps, delta)-DP mechanism: losses +-eps and +inf (Kairouz et al. 2015).
            e = leaf.epsilon
            lo_i, hi_i = math.ceil(-e / h), math.ceil(e / h)
            if hi_i - lo_i > MAX_FFT:
                raise InvalidParameter(f"{leaf!r} is too wide for the PLD grid h={h:g}")
            pmf = np.zeros(hi_i - lo_i + 1)
            w = 1.0 - leaf.delta
            pmf[0] += w * float(special.expit(-e))
            pmf[-1] += w * float(special.expit(e))
            out = make_leaf(lo_i, pmf, math.log(w) if w > 0 else -math.inf, h)
        elif isinstance(leaf, PROFILE_LEAVES):
            # Connect the dots on the exact (symmetric) profile of the event, as for the Gaussian.
            lo, hi = leaf_loss_range(leaf, self.leaf_tail(count))
            lo_i, hi_i = math.floor(lo / h), math.ceil(hi / h)
            if hi_i - lo_i > MAX_FFT:
                raise InvalidParameter(
                    f"the privacy loss of {leaf!r} spans {hi - lo:.3g} nats: too wide for the PLD grid "
                    f"h={h:g}; use a coarser value_discretization_interval"
                )
            grid_p: FloatArray = np.arange(lo_i, hi_i + 1, dtype=np.float64) * h
            # Symmetric pairs (all but user histograms, which may not be): the reversed profile at
            # -x is the profile itself at |x|, for the accurate differences at negative losses.
            rev = None
            if not isinstance(leaf, PrivacyLossDistributionEvent):
                rev = leaf_log_delta(leaf, np.abs(grid_p))
            pmf, inf_mass = connect_dots(grid_p, leaf_log_delta(leaf, grid_p), rev)
            out = make_leaf(lo_i, pmf, math.log1p(-inf_mass) if inf_mass < 1 else -math.inf, h)
        else:
            if isinstance(leaf, SubsampledGaussianEvent):
                sigma, q = leaf.noise_multiplier, leaf.sample_rate
            elif isinstance(leaf, float):
                sigma, q = leaf, 1.0  # the combined Gaussian part, as a noise multiplier
            if q >= 1.0:
                direction = "remove"  # a Gaussian's PLD is the same in both directions
            lo, hi = self.support(sigma, q, count, direction)
            lo_i, hi_i = math.floor(lo / h), math.ceil(hi / h)
            if hi_i - lo_i > MAX_FFT:
                raise InvalidParameter(
                    f"the privacy loss of {leaf!r} spans {hi - lo:.3g} nats: too wide for the PLD grid "
                    f"h={h:g}; use a coarser value_discretization_interval or the 'rdp' accountant"
                )
            idx = profile_points(lo_i, hi_i, h, lambda e: subsampled_log_delta(sigma, q, e, direction))
            grid: FloatArray = idx.astype(np.float64) * h
            log_d = subsampled_log_delta(sigma, q, grid, direction)
            # The reversed pair (remove <-> add; a Gaussian is symmetric) at -x for negative x.
            other: Direction = direction if q >= 1.0 else ("add" if direction == "remove" else "remove")
            log_rev = subsampled_log_delta(sigma, q, np.abs(grid), other)
            pmf = np.zeros(hi_i - lo_i + 1)
            pmf[idx - lo_i], inf_mass = connect_dots(grid, log_d, log_rev)
            # Masses below 1e-200 go to +inf (pessimistic: a larger loss), which keeps subnormal
            # numbers, a hundred times slower to compute with, out of every later step.
            tiny = pmf < 1e-200
            if np.any(tiny):
                inf_mass += float(pmf[tiny].sum())
                pmf[tiny] = 0.0
            out = make_leaf(lo_i, pmf, math.log1p(-inf_mass) if inf_mass < 1 else -math.inf, h)
        self._leaf_cache[key] = out
        return out
