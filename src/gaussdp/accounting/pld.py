"""Privacy loss distribution (PLD) accountant: the tightest upper bound gaussdp computes.

How it bounds (add/remove of one record; both directions composed separately, the larger delta
reported, as in Zhu, Dong & Wang 2022):

1. Each distinct event's privacy loss distribution is discretised on a grid of spacing ``h`` by
   "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022, Section 3): the exact
   privacy profile is evaluated at the grid points and the discrete PLD whose profile, as a function
   of e^epsilon, is the piecewise-linear interpolation of those values is built. The true profile is
   convex in e^epsilon, so the interpolation lies above it: the discrete PLD belongs to a *dominating*
   pair and every answer is an upper bound. Mass beyond the truncation point is moved to +infinity.
   (epsilon, delta) events use their exact PLD with losses rounded up to the grid.
2. The PLDs of dominating pairs compose by convolution, computed in the Fourier domain: ``count``
   repetitions of an event are one complex power of its spectrum (exponentiation, not ``count``
   convolutions), distinct events multiply (heterogeneous composition).
3. The FFT is circular: the window [lo, hi] is chosen from Chernoff bounds on the discrete PLD's
   moment generating function, and the bound on the mass above ``hi`` is *added* to delta (mass that
   wraps around only increases delta), so truncation never makes the answer optimistic.

Plain Gaussian compositions never go through the discretisation: they are exactly
``mu``-GDP with ``mu = sqrt(sum count / sigma^2)`` and use the closed form; mixed with subsampled
steps, the whole Gaussian part enters the FFT as one Gaussian with that mu.

Floating point: the FFT computes the composed PLD with an absolute error around 1e-16 per entry. To
stay an upper bound, a noise allowance ``fft_floor`` is added to every delta. A delta below
``rdp_below`` (down to 1e-20 and beyond) is answered from an exponentially tilted composition
(``p_i e^{lam x_i}``, which commutes with convolution and moves the relevant tail to where the FFT is
accurate), with a per-entry rounding allowance untilted the same way and a truncation far below
delta; the RDP bound is computed too and the smaller of the two upper bounds is returned.

Online use costs O(1) per ``compose`` (a dict increment); the profile is recomputed lazily when
asked, from the distinct events and their counts, with per-event discretisations cached on doubling
grids of the count: a query costs a few FFTs of the window, independent of the number of steps.

References:
    Koskela, A., Jalko, J. & Honkela, A. (2020). Computing Tight Differential Privacy Guarantees
    Using FFT. AISTATS.
    Gopi, S., Lee, Y. T. & Wutschitz, L. (2021). Numerical Composition of Differential Privacy.
    Doroshenko, V., Ghazi, B., Kamath, P., Kumar, R. & Manurangsi, P. (2022). Connect the Dots:
    Tighter Discrete Approximations of Privacy Loss Distributions. PETS.
    Zhu, Y., Dong, J. & Wang, Y.-X. (2022). Optimal Accounting of Differential Privacy via
    Characteristic Function. AISTATS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from numpy.typing import NDArray
from scipy import special

from gaussdp._lazy import lazy_module
from gaussdp.accounting._mechanisms import (
    PROFILE_LEAVES,
    leaf_atom_scale,
    leaf_log_delta,
    leaf_loss_range,
    leaf_mu2,
)
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.base import Accountant
from gaussdp.accounting.events import EpsilonDeltaEvent, Event, GaussianEvent, SubsampledGaussianEvent
from gaussdp.accounting.rdp import RDPAccountant
from gaussdp.calibration import delta_for_mu, epsilon_for_mu
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import fft
else:
    fft = lazy_module("scipy.fft")  # imported on first use: keeps `import gaussdp` cheap

__all__ = ["PLDAccountant"]


def _lfilter(b: list[float], a: list[float], x: FloatArray) -> FloatArray:
    # scipy.signal costs about half a second to import: only pay it when a profile is computed.
    from scipy import signal

    out: FloatArray = signal.lfilter(b, a, x)
    return out


FloatArray = NDArray[np.float64]
Direction = Literal["remove", "add"]

_MAX_FFT = 1 << 24


@dataclass(frozen=True)
class _LeafPMF:
    """A discrete PLD: mass ``pmf[j]`` at loss ``(start + j) * h``; the rest of the mass is at +inf."""

    start: int
    pmf: FloatArray
    log_finite_mass: float
    mean: float  # of the normalised finite part, in nats
    var: float
    log_mgf: FloatArray  # log E[e^{lam L}] of the normalised finite part at _LAMBDAS
    log_mgf_neg: FloatArray  # log E[e^{-lam L}] at _LAMBDAS


# Chernoff exponents for the window (absolute, so that each event's MGF is computed once and cached).
_LAMBDAS = np.geomspace(1e-2, 1e7, 60)


def _make_leaf(start: int, pmf: FloatArray, log_finite_mass: float, h: float) -> _LeafPMF:
    nz = np.nonzero(pmf > 0.0)[0]
    x = (start + nz) * h
    w = pmf[nz] / pmf[nz].sum()
    m = float(np.dot(w, x))
    v = float(np.dot(w, (x - m) ** 2))
    lw = np.log(w)
    log_mgfs = []
    for sign in (1.0, -1.0):
        a = lw[None, :] + sign * _LAMBDAS[:, None] * x[None, :]
        amax = a.max(axis=1)
        log_mgfs.append(np.log(np.exp(a - amax[:, None]).sum(axis=1)) + amax)
    return _LeafPMF(start, pmf, log_finite_mass, m, v, log_mgfs[0], log_mgfs[1])


@dataclass(frozen=True)
class _Composed:
    """A composed PLD on a window of the grid, with the mass at +inf and the Chernoff tail bound."""

    h: float
    start: int
    pmf: FloatArray
    inf_mass: float
    tail: float
    delta_grid: FloatArray  # delta at each grid point of the window, allowances included

    def delta(self, epsilon: float) -> float:
        j = math.ceil(epsilon / self.h - 1e-12) - self.start  # first index with loss >= epsilon
        extra = self.inf_mass + self.tail
        if j >= len(self.pmf):
            return extra
        if j < 0:
            return 1.0  # below the window, where wrapped-around mass is not accounted for

        losses = (self.start + np.arange(j, len(self.pmf))) * self.h
        with np.errstate(over="ignore"):
            w = -np.expm1(np.minimum(epsilon - losses, 0.0))
        return extra + float(np.dot(self.pmf[j:], w))

    def epsilon(self, delta: float) -> float:
        d = self.delta_grid
        ok = np.nonzero(d <= delta)[0]
        if len(ok) == 0:
            raise _BelowFloor
        j = int(ok[0])
        eps_j = (self.start + j) * self.h
        if j == 0:
            return eps_j
        # Between grid points the profile is A - e^eps G (exact for this discrete PLD): solve it.
        tail = self.pmf[j:]
        losses = (self.start + np.arange(j, len(self.pmf))) * self.h
        a = self.inf_mass + self.tail + float(tail.sum())
        g = float(np.dot(tail, np.exp(eps_j - losses)))
        if g > 0.0 and a - delta > 0.0:
            eps = eps_j + math.log((a - delta) / g)
            eps = min(eps_j, max(eps_j - self.h, eps))
            return eps + 1e-12 * max(1.0, abs(eps))
        return eps_j


class _BelowFloor(Exception):
    """The asked delta is below what this discrete PLD can resolve."""


def _connect_dots(eps_grid: FloatArray, log_delta: FloatArray) -> tuple[FloatArray, float]:
    # Discrete PLD whose profile, as a function of y = e^eps, interpolates the exact profile linearly
    # between grid points, is the line from (0, 1) to the first point below it, and is flat (= the
    # delta at the last point: that mass goes to +inf) above it. Mass at grid point i is
    # y_i * (slope_{i+1} - slope_i) (Doroshenko et al. 2022, Section 3).
    y = np.exp(eps_grid)
    d = np.exp(log_delta)
    slopes = np.empty(len(y) + 1)
    slopes[0] = (d[0] - 1.0) / y[0]
    slopes[1:-1] = np.diff(d) / np.diff(y)
    slopes[-1] = 0.0
    pmf = y * np.diff(slopes)
    return np.maximum(pmf, 0.0), float(d[-1])


class PLDAccountant(Accountant):
    """Privacy loss distribution accountant with a dominating (upper-bound) discretisation.

    Args:
        value_discretization_interval: grid spacing ``h`` of the privacy loss; ``None`` picks it
            from the composition so that the discretisation adds about 0.1% to epsilon.
        tail_mass: probability mass the truncation may move to +infinity (added to delta).
        fft_floor: allowance for FFT rounding, added to every delta.
        rdp_below: deltas smaller than this are answered with the smaller of an exponentially
            tilted PLD (with its own truncation and rounding allowances) and the RDP bound.
    """

    name = "pld"

    def __init__(
        self,
        *,
        value_discretization_interval: float | None = None,
        tail_mass: float = 1e-14,
        fft_floor: float = 1e-13,
        rdp_below: float = 1e-10,
    ) -> None:
        super().__init__()
        if value_discretization_interval is not None:
            h = float(value_discretization_interval)
            if not 0.0 < h <= 1.0:
                raise InvalidParameter(
                    "value_discretization_interval must be in (0, 1], got "
                    f"value_discretization_interval={value_discretization_interval!r}"
                )
        self._h = value_discretization_interval
        self._tail_mass = float(tail_mass)
        self._fft_floor = float(fft_floor)
        self._rdp_below = float(rdp_below)
        self._composed: dict[Direction, _Composed] | None = None
        self._leaf_cache: dict[tuple[object, ...], _LeafPMF] = {}
        self._spec_cache: dict[tuple[int, int], NDArray[np.complex128]] = {}
        self._fft_state: dict[Direction, tuple[float, int, int, dict[int, int], NDArray[np.complex128]]] = {}

    def _supports_leaf(self, leaf: Event) -> bool:
        return isinstance(leaf, (GaussianEvent, SubsampledGaussianEvent, EpsilonDeltaEvent, *PROFILE_LEAVES))

    def _on_compose(self) -> None:
        self._composed = None

    # ----- answers -----------------------------------------------------------------------------
    def _epsilon(self, delta: float) -> float:
        if self._only_gaussian():
            return epsilon_for_mu(mu=self._gaussian_mu(), delta=delta)
        if delta < self._rdp_below:
            return self._small_delta_epsilon(delta)
        try:
            eps = max(0.0, max(c.epsilon(delta) for c in self._compose_all().values()))
        except _BelowFloor:
            return self._small_delta_epsilon(delta)
        if self._grid_is_coarse():
            try:
                eps = min(eps, self._rdp_fallback().epsilon(delta))
            except InvalidParameter:
                pass
        if any(isinstance(e, EpsilonDeltaEvent) for e in self._counts):
            eps = min(eps, self._basic_fallback_epsilon(delta))  # both are upper bounds
        return eps

    def _grid_is_coarse(self) -> bool:
        """Whether h exceeds a tenth of the per-step loss spread (very long runs with tiny losses).

        There the discretisation, though still an upper bound, can be looser than RDP; both are
        upper bounds, so the smaller is reported.
        """
        mu2 = 0.0
        for e, c in self._counts.items():
            if isinstance(e, SubsampledGaussianEvent):
                mu2 += c * e.sample_rate**2 * math.expm1(min(1.0 / e.noise_multiplier**2, 700.0))
            elif isinstance(e, GaussianEvent):
                mu2 += c / e.noise_multiplier**2
            elif isinstance(e, PROFILE_LEAVES):
                mu2 += c * leaf_mu2(e)
        return self._grid_h() > 0.1 * math.sqrt(mu2 / max(1, self.steps))

    def _small_delta_epsilon(self, delta: float) -> float:
        """Epsilon at a delta below the plain FFT's resolution: exponentially tilted PLD or RDP.

        Both are upper bounds, so the smaller is returned. The tilted computation composes
        ``p_i e^{lam x_i}`` instead of ``p_i`` (tilting commutes with convolution), which puts the
        mass that matters for ``delta(epsilon)`` near the peak where the FFT is accurate; the result
        is untilted, and an FFT rounding allowance of ``1e-14`` per tilted entry, untilted the same
        way, is added to delta.
        """
        rdp_eps = math.inf
        try:
            rdp_eps = self._rdp_fallback().epsilon(delta)
        except InvalidParameter:
            pass
        h = self._grid_h()
        # A fresh accountant on the same grid whose truncation moves far less than delta to +inf.
        fine_tail = PLDAccountant(
            value_discretization_interval=h, tail_mass=min(self._tail_mass, delta * 1e-4)
        )
        for e, c in self._counts.items():
            fine_tail.compose(e, c)
        try:
            pld_eps = max(fine_tail._tilted_epsilon(d, h, delta, rdp_eps) for d in ("remove", "add"))
        except (_BelowFloor, InvalidParameter, FloatingPointError, OverflowError):
            pld_eps = math.inf
        best = min(rdp_eps, pld_eps, self._basic_fallback_epsilon(delta))
        if not math.isfinite(best):
            raise InvalidParameter(f"no finite epsilon at delta={delta:g} for this composition")
        return max(0.0, best)

    def _tilted_epsilon(self, direction: Direction, h: float, delta: float, eps_guess: float) -> float:
        parts = self._parts(direction, h)
        inf_mass = -math.expm1(math.fsum(c * p.log_finite_mass for p, c in parts))
        lo, hi, tail = self._window(parts, h)
        extra = inf_mass + tail  # FFT rounding is covered by the untilted per-entry allowance below
        if extra >= delta:
            raise _BelowFloor
        # Tilt exponent: the Chernoff-optimal lam for the tail at the guessed epsilon.
        total_mgf = np.zeros(len(_LAMBDAS))
        for p, c in parts:
            total_mgf += c * p.log_mgf
        guess = eps_guess if math.isfinite(eps_guess) else hi
        lam = float(_LAMBDAS[int(np.argmin(total_mgf - _LAMBDAS * guess))])
        start = math.floor(lo / h)
        n = int(fft.next_fast_len(math.ceil(hi / h) - start + 1, real=True))
        if n > _MAX_FFT:
            raise _BelowFloor
        spec = np.ones(n // 2 + 1, dtype=np.complex128)
        log_m = 0.0
        for p, c in parts:
            x = (p.start + np.arange(len(p.pmf))) * h
            with np.errstate(divide="ignore"):
                lw = np.log(p.pmf) + lam * x
            lm = float(special.logsumexp(lw))
            buf = np.zeros(n)
            np.add.at(buf, (p.start + np.arange(len(p.pmf))) % n, np.exp(lw - lm))
            ls = fft.rfft(buf)
            spec *= ls if c == 1 else np.power(ls, c)
            log_m += c * lm
        tilted = np.maximum(np.roll(fft.irfft(spec, n=n), -(start % n)), 0.0)
        x_win = (start + np.arange(n)) * h
        # untilt: p_j = exp(log_m - lam x_j) * tilted_j; entries far below epsilon may overflow and
        # are garbage, but the search below runs from the top and never reads past the crossing.
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.exp(np.minimum(log_m - lam * x_win, 700.0)) * (tilted + 1e-14)
        rev = v[::-1]
        a_suf = np.cumsum(rev)[::-1]
        g_suf = _lfilter([1.0], [1.0, -math.exp(-h)], rev)[::-1]
        d = np.empty(n)
        d[:-1] = a_suf[1:] - math.exp(-h) * g_suf[1:]
        d[-1] = 0.0
        d = np.maximum(d, 0.0) + extra
        above = np.nonzero(~(d <= delta))[0]  # NaN counts as "above": never trusted
        if len(above) == 0:
            return float(x_win[0])
        j = int(above[-1])
        if j == n - 1:
            raise _BelowFloor
        a = extra + float(a_suf[j + 1])
        g = float(g_suf[j + 1])
        eps_next = float(x_win[j + 1])
        if g > 0.0 and a > delta and math.isfinite(a) and math.isfinite(g):
            eps = eps_next + math.log((a - delta) / g)
            eps = min(eps_next, max(float(x_win[j]), eps))
            return eps + 1e-12 * max(1.0, abs(eps))
        return eps_next

    def _parts(self, direction: Direction, h: float) -> list[tuple[_LeafPMF, int]]:
        parts: list[tuple[_LeafPMF, int]] = []
        mu = self._gaussian_mu()
        if mu > 0.0:
            parts.append((self._leaf_pmf(1.0 / mu, 1, direction, h), 1))
        for e, c in self._counts.items():
            if not isinstance(e, GaussianEvent):
                parts.append((self._leaf_pmf(e, c, direction, h), c))
        return parts

    def _delta(self, epsilon: float) -> float:
        if self._only_gaussian():
            return delta_for_mu(mu=self._gaussian_mu(), epsilon=epsilon)
        d = max(c.delta(epsilon) for c in self._compose_all().values())
        if d < self._rdp_below or self._grid_is_coarse():
            # Near the FFT noise allowance: the RDP bound (also valid) may be smaller.
            try:
                d = min(d, self._rdp_fallback().delta(epsilon))
            except InvalidParameter:
                pass
        return d

    def _basic_fallback_epsilon(self, delta: float) -> float:
        # Basic composition holds for every mix of events; it answers where the discretised PLD
        # cannot, e.g. one (epsilon, delta) event asked at exactly its own delta.
        from gaussdp.accounting.basic import BasicComposition

        acc = BasicComposition()
        for e, c in self._counts.items():
            acc.compose(e, c)
        try:
            return acc.epsilon(delta)
        except InvalidParameter:
            return math.inf

    def _rdp_fallback(self) -> Accountant:
        if any(isinstance(e, EpsilonDeltaEvent) and e.delta > 0 for e in self._counts):
            raise InvalidParameter(
                f"delta below {self._rdp_below:g} is out of the PLD's numerical range for "
                "compositions that include (epsilon, delta>0) events"
            )
        acc = RDPAccountant()
        for e, c in self._counts.items():
            acc.compose(e, c)
        return acc

    # ----- discretisation ----------------------------------------------------------------------
    def _grid_h(self) -> float:
        if self._h is not None:
            return float(self._h)
        # Spread of the composed loss, from the RDP-free second moment proxy: sum of count * q^2 *
        # (e^{1/sigma^2} - 1) is the CLT mu^2 (Bu et al. 2020); mu^2 + mu is a safe scale of the range.
        mu2 = 0.0
        for e, c in self._counts.items():
            if isinstance(e, GaussianEvent):
                mu2 += c / e.noise_multiplier**2
            elif isinstance(e, SubsampledGaussianEvent):
                mu2 += c * e.sample_rate**2 * math.expm1(min(1.0 / e.noise_multiplier**2, 700.0))
            elif isinstance(e, EpsilonDeltaEvent):
                mu2 += c * e.epsilon**2
            elif isinstance(e, PROFILE_LEAVES):
                mu2 += c * leaf_mu2(e)
        scale = mu2 + math.sqrt(mu2)
        # Connect-the-dots error grows like steps * h^2 (measured: 0.15% at 1e5 steps and
        # h = scale/4000); this keeps it near 0.1% (tests check <= 0.5% against a 4x finer grid).
        steps = max(1, self.steps)
        factor = min(20.0, 4.0 * math.sqrt(1e5 / steps))
        h = min(1e-2, max(1e-6, scale * factor / 2e4))
        # Each event's own loss range must fit in a modest grid too (its tail mass is tiny, but it
        # sets the array length): at most 2^16 points per event.
        width = max((self._leaf_range(e, c) for e, c in self._counts.items()), default=0.0)
        h = max(h, width / 65536.0)
        # An (epsilon, delta) event's losses +-epsilon are rounded up to the grid: keep that rounding
        # below 0.05% of epsilon.
        eps_min = min(
            (e.epsilon for e in self._counts if isinstance(e, EpsilonDeltaEvent) and e.epsilon > 0),
            default=math.inf,
        )
        h = min(h, eps_min / 2000.0)
        # Likewise for the atoms of user-supplied loss histograms and profiles (connect the dots
        # splits an atom between its two grid neighbours).
        h = min(h, min((leaf_atom_scale(e) for e in self._counts), default=math.inf) / 2000.0)
        # A power of two, so that h (and the cached per-event discretisations) change only when the
        # composition doubles or halves in scale: online use recomputes almost nothing.
        return float(2.0 ** math.floor(math.log2(h)))

    def _leaf_range(self, leaf: Event, count: int) -> float:
        if isinstance(leaf, SubsampledGaussianEvent):
            lo, hi = self._support(leaf.noise_multiplier, leaf.sample_rate, count, "remove")
            return hi - lo
        if isinstance(leaf, PROFILE_LEAVES):
            lo, hi = leaf_loss_range(leaf, self._leaf_tail(count))
            return hi - lo
        return 0.0

    def _leaf_tail(self, count: int) -> float:
        # The per-step truncation mass of _support, on the same doubling grid of the count.
        return self._tail_mass / (4.0 * (1 << max(0, (count - 1).bit_length())))

    def _support(self, sigma: float, q: float, count: int, direction: Direction) -> tuple[float, float]:
        bucket = 1 << max(0, (count - 1).bit_length())
        z = float(-special.ndtri(self._tail_mass / (4.0 * bucket)))
        if q >= 1.0:
            mu = 1.0 / sigma
            return mu * mu / 2.0 - z * mu, mu * mu / 2.0 + z * mu
        log1mq, log_q = math.log1p(-q), math.log(q)
        if direction == "remove":
            return log1mq, float(np.logaddexp(log1mq, log_q + (2 * (1 + z * sigma) - 1) / (2 * sigma**2)))
        return -float(np.logaddexp(log1mq, log_q + (2 * z * sigma - 1) / (2 * sigma**2))), -log1mq

    def _leaf_pmf(self, leaf: Event | float, count: int, direction: Direction, h: float) -> _LeafPMF:
        # Per-step truncation mass shrinks with the count, on a doubling grid so that the cache is
        # reused while a training loop composes one step at a time.
        bucket = 1 << max(0, (count - 1).bit_length())
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
            if hi_i - lo_i > _MAX_FFT:
                raise InvalidParameter(f"{leaf!r} is too wide for the PLD grid h={h:g}")
            pmf = np.zeros(hi_i - lo_i + 1)
            w = 1.0 - leaf.delta
            pmf[0] += w * float(special.expit(-e))
            pmf[-1] += w * float(special.expit(e))
            out = _make_leaf(lo_i, pmf, math.log(w) if w > 0 else -math.inf, h)
        elif isinstance(leaf, PROFILE_LEAVES):
            # Connect the dots on the exact (symmetric) profile of the event, as for the Gaussian.
            lo, hi = leaf_loss_range(leaf, self._leaf_tail(count))
            lo_i, hi_i = math.floor(lo / h), math.ceil(hi / h)
            if hi_i - lo_i > _MAX_FFT:
                raise InvalidParameter(
                    f"the privacy loss of {leaf!r} spans {hi - lo:.3g} nats: too wide for the PLD grid "
                    f"h={h:g}; use a coarser value_discretization_interval"
                )
            grid_p: FloatArray = np.arange(lo_i, hi_i + 1, dtype=np.float64) * h
            pmf, inf_mass = _connect_dots(grid_p, leaf_log_delta(leaf, grid_p))
            out = _make_leaf(lo_i, pmf, math.log1p(-inf_mass) if inf_mass < 1 else -math.inf, h)
        else:
            if isinstance(leaf, SubsampledGaussianEvent):
                sigma, q = leaf.noise_multiplier, leaf.sample_rate
            elif isinstance(leaf, float):
                sigma, q = leaf, 1.0  # the combined Gaussian part, as a noise multiplier
            if q >= 1.0:
                direction = "remove"  # a Gaussian's PLD is the same in both directions
            lo, hi = self._support(sigma, q, count, direction)
            lo_i, hi_i = math.floor(lo / h), math.ceil(hi / h)
            if hi_i - lo_i > _MAX_FFT:
                raise InvalidParameter(
                    f"the privacy loss of {leaf!r} spans {hi - lo:.3g} nats: too wide for the PLD grid "
                    f"h={h:g}; use a coarser value_discretization_interval or the 'rdp' accountant"
                )
            grid: FloatArray = np.arange(lo_i, hi_i + 1, dtype=np.float64) * h
            log_d = subsampled_log_delta(sigma, q, grid, direction)
            pmf, inf_mass = _connect_dots(grid, log_d)
            out = _make_leaf(lo_i, pmf, math.log1p(-inf_mass) if inf_mass < 1 else -math.inf, h)
        self._leaf_cache[key] = out
        return out

    def _compose_all(self) -> dict[Direction, _Composed]:
        if self._composed is not None:
            return self._composed
        h = self._grid_h()
        directions: tuple[Direction, ...] = ("remove", "add")
        fresh: dict[Direction, _Composed] = {d: self._compose_direction(d, h) for d in directions}
        self._composed = fresh
        return fresh

    def _compose_direction(self, direction: Direction, h: float) -> _Composed:
        parts = self._parts(direction, h)
        log_finite = math.fsum(c * p.log_finite_mass for p, c in parts)
        inf_mass = -math.expm1(log_finite)
        lo, hi, tail = self._window(parts, h)
        n, start, spec = self._spectrum(direction, h, parts, lo, hi)
        circ = fft.irfft(spec, n=n)
        pmf = np.maximum(np.roll(circ, -(start % n)), 0.0)
        extra = inf_mass + tail + self._fft_floor
        # delta at each grid point j: sum_{i>j} p_i (1 - e^{-(i-j)h}) = A_{j+1} - e^{-h} G_{j+1},
        # with suffix sums A and G_j = sum_{i>=j} p_i e^{-(i-j)h} (a first-order recurrence).
        rev = pmf[::-1]
        a_suf = np.cumsum(rev)[::-1]
        g_suf = _lfilter([1.0], [1.0, -math.exp(-h)], rev)[::-1]
        d = np.empty(n)
        d[:-1] = a_suf[1:] - math.exp(-h) * g_suf[1:]
        d[-1] = 0.0
        delta_grid = np.maximum(d, 0.0) + extra
        return _Composed(h, start, pmf, inf_mass, tail + self._fft_floor, delta_grid)

    def _spectrum(
        self, direction: Direction, h: float, parts: list[tuple[_LeafPMF, int]], lo: float, hi: float
    ) -> tuple[int, int, NDArray[np.complex128]]:
        """Spectrum of the composed PLD on a window containing [lo, hi], updated incrementally.

        The last spectrum is kept with its window and per-part counts: while the grid, the window
        and the discretisations stay the same (they change only on doubling grids), one more step
        of an event multiplies the spectrum by that event's spectrum, O(n) instead of O(n log n).
        """
        st = self._fft_state.get(direction)
        if st is not None:
            s_h, s_n, s_start, s_counts, s_spec = st
            ids = {id(p): c for p, c in parts}
            if (
                s_h == h
                and s_start * h <= lo
                and (s_start + s_n - 1) * h >= hi
                and all(k in ids and ids[k] >= c for k, c in s_counts.items())
            ):
                spec = s_spec.copy()
                for p, c in parts:
                    extra = c - s_counts.get(id(p), 0)
                    if extra > 0:
                        ls = self._leaf_spectrum(p, s_n)
                        spec *= ls if extra == 1 else np.power(ls, extra)
                self._fft_state[direction] = (h, s_n, s_start, ids, spec)
                return s_n, s_start, spec
        # Rebuild with a margin of a quarter of the width on each side, so that the window stays valid
        # while the composition grows (the mean drifts, the spread widens).
        width = hi - lo
        start = math.floor((lo - 0.25 * width) / h)
        n = int(fft.next_fast_len(math.ceil((hi + 0.25 * width) / h) - start + 1, real=True))
        if n > _MAX_FFT:
            raise InvalidParameter(
                f"the composed privacy loss spans {hi - lo:.3g} nats: too wide for the PLD grid h={h:g}; "
                "use a coarser value_discretization_interval or the 'rdp' accountant"
            )
        self._spec_cache.clear()
        spec = np.ones(n // 2 + 1, dtype=np.complex128)
        for p, c in parts:
            ls = self._leaf_spectrum(p, n)
            spec *= ls if c == 1 else np.power(ls, c)
        self._fft_state[direction] = (h, n, start, {id(p): c for p, c in parts}, spec)
        return n, start, spec

    def _leaf_spectrum(self, p: _LeafPMF, n: int) -> NDArray[np.complex128]:
        key = (id(p), n)
        hit = self._spec_cache.get(key)
        if hit is None:
            a = np.zeros(n)
            idx = (p.start + np.arange(len(p.pmf))) % n
            np.add.at(a, idx, p.pmf)
            hit = fft.rfft(a)
            self._spec_cache[key] = hit
        return hit

    def _window(self, parts: list[tuple[_LeafPMF, int]], h: float) -> tuple[float, float, float]:
        """The FFT window [lo, hi] and the bound on the composed mass above hi (added to delta).

        Upper end: Chernoff, P(S > t) <= exp(-lam t + sum_k c_k log M_k(lam)) with the exact moment
        generating function of each discrete PLD (normalised finite part), minimised over lam.
        Lower end: the same bound on P(S < lo); mass below lo wraps around to the top of the window,
        where it can only *increase* delta, so this keeps that increase below ``tail_mass``.
        """
        mean = math.fsum(c * p.mean for p, c in parts)
        log_mgf = np.zeros(len(_LAMBDAS))
        log_mgf_neg = np.zeros(len(_LAMBDAS))
        for p, c in parts:
            log_mgf += c * p.log_mgf
            log_mgf_neg += c * p.log_mgf_neg
        log_tau = math.log(self._tail_mass)
        hi = float(np.min((log_mgf - log_tau) / _LAMBDAS))
        lo = float(np.max((log_tau - log_mgf_neg) / _LAMBDAS))
        hi = max(hi, mean + h)
        lo = min(lo, mean - h)
        return lo, hi, self._tail_mass
