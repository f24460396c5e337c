"""The PLD accountant's FFT engine: compositions of discrete PLDs by convolution in the Fourier domain.

The PLDs of dominating pairs compose by convolution, computed as products of spectra: ``count``
repetitions of an event are one complex power of its spectrum, distinct events multiply. The FFT is
circular: the window [lo, hi] comes from Chernoff bounds on the discrete PLD's moment generating
function (:func:`window`), and the bound on the mass above ``hi`` is *added* to delta (mass that
wraps around only increases delta), as is an allowance ``fft_floor`` for the FFT's rounding: the
composed profile stays an upper bound.

Online use: the last full composition is kept as a checkpoint; up to :data:`ONLINE_STEPS` more steps
of one event are convolved with it at the few grid points a query needs (:class:`Stepped`). The add
direction is composed only where a Chernoff bound on its delta does not already lie below the
remove direction's answer (:meth:`FFTEngine.add_delta_bound`).

References:
    Koskela, A., Jalko, J. & Honkela, A. (2020). Computing Tight Differential Privacy Guarantees
    Using FFT. AISTATS.
    Gopi, S., Lee, Y. T. & Wutschitz, L. (2021). Numerical Composition of Differential Privacy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gaussdp._lazy import lazy_module
from gaussdp.accounting._pld_grid import Discretisation
from gaussdp.accounting._pld_values import (
    LAMBDAS,
    MAX_FFT,
    Composed,
    Direction,
    FloatArray,
    LeafPMF,
    MFold,
    PerDirection,
    Stepped,
    chernoff_end,
    delta_profile,
    discounted_suffix,
    rung_search,
)
from gaussdp.accounting.events import Event, SubsampledGaussianEvent
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import fft
else:
    fft = lazy_module("scipy.fft")  # imported on first use: keeps `import gaussdp` cheap

# Online: at most this many steps of one event are added to the last full composition by direct
# convolution at the queried points before a new full (FFT) composition is made.
ONLINE_STEPS = 64


def spectrum_power(spec: NDArray[np.complex128], c: int) -> NDArray[np.complex128]:
    """``spec ** c``, computed only where it does not underflow.

    A coefficient of modulus below e^{-700 / c} has a c-th power below 1e-304 (set to zero: far
    below the FFT allowance, and no subnormal numbers); a composed PLD's spectrum is concentrated
    on a few low frequencies, so the complex power, the costliest step of a long composition
    (a quarter of it at 1e5 steps), runs on few entries.
    """
    out = np.zeros_like(spec)
    floor = math.exp(-700.0 / c)
    keep = np.nonzero(spec.real * spec.real + spec.imag * spec.imag > floor * floor)[0]
    out[keep] = np.power(spec[keep], c)
    return out


def circular_spectrum(start: int, values: FloatArray, n: int) -> NDArray[np.complex128]:
    """The real FFT of ``values`` placed at grid indices ``start, start + 1, ...`` modulo ``n``."""
    buf = np.zeros(n)
    np.add.at(buf, (start + np.arange(len(values))) % n, values)
    spec: NDArray[np.complex128] = fft.rfft(buf)
    return spec


def window_pmf(spec: NDArray[np.complex128], n: int, start: int) -> FloatArray:
    """The composed PMF from its spectrum, rotated so that index 0 is grid index ``start``.

    Negative entries (FFT rounding, covered by the allowances) are set to 0.
    """
    pmf: FloatArray = np.maximum(np.roll(fft.irfft(spec, n=n), -(start % n)), 0.0)
    return pmf


def window(parts: list[tuple[LeafPMF, int]], h: float, tail_mass: float) -> tuple[float, float, float]:
    """The FFT window [lo, hi] and the bound on the composed mass above hi (added to delta).

    Upper end: Chernoff, P(S > t) <= exp(-lam t + sum_k c_k log M_k(lam)) with the exact moment
    generating function of each discrete PLD (normalised finite part), minimised over lam.
    Lower end: the same bound on P(S < lo); mass below lo wraps around to the top of the window,
    where it can only *increase* delta, so this keeps that increase below ``tail_mass``.
    """
    mean = math.fsum(c * p.mean for p, c in parts)
    log_tau = math.log(tail_mass)
    var = math.fsum(c * p.var for p, c in parts)
    hi = chernoff_end(parts, 1, log_tau, var)
    lo = -chernoff_end(parts, -1, log_tau, var)
    hi = max(hi, mean + h)
    lo = min(lo, mean - h)
    return lo, hi, tail_mass


class FFTEngine:
    """Composes the discrete PLDs of a :class:`Discretisation` and answers from the composition.

    It keeps what makes repeated queries cheap: the last full composition (per direction, each
    computed on first use), the last spectrum per direction with its window, the spectra of the
    leaves, the online checkpoint and the PMFs of a few more steps. :meth:`reset` after a compose.

    Args:
        grid: the grid and per-event discretisations to compose.
        fft_floor: allowance for the FFT's rounding, added to every delta.
    """

    def __init__(self, grid: Discretisation, *, fft_floor: float) -> None:
        self.grid = grid
        self.fft_floor = fft_floor
        self._composed: PerDirection | None = None
        self._spec_cache: dict[tuple[int, int], NDArray[np.complex128]] = {}
        self._fft_state: dict[Direction, tuple[float, int, int, dict[int, int], NDArray[np.complex128]]] = {}
        # Online use: the last full composition (grid, counts, per-direction PLD) and the PMFs of a few
        # more steps of one event, so that a query after each step costs dot products, not FFTs.
        self._checkpoint: tuple[float, dict[Event, int], PerDirection] | None = None
        self._mfold_cache: dict[tuple[object, ...], MFold] = {}
        self._last_eps: dict[tuple[Direction, float], float] = {}
        self._add_needed = False  # the add direction could not be certified negligible once already

    def reset(self) -> None:
        """Forget the full composition (the composition changed); the checkpoint stays usable."""
        self._composed = None

    def delta(self, counts: dict[Event, int], epsilon: float) -> float:
        """Delta at ``epsilon`` of the composed discrete PLD (max over the directions not certified)."""
        cur = self.current(counts)
        d: float = cur["remove"].delta(epsilon)
        if self._add_needed or self.add_delta_bound(counts, epsilon) > d:
            d = max(d, cur["add"].delta(epsilon))
        return d

    def epsilon(self, counts: dict[Event, int], delta: float) -> float:
        """Epsilon at ``delta`` of the composed discrete PLD (max over the directions not certified).

        Raises:
            BelowFloor: ``delta`` is below what the composed PLD resolves.
        """
        cur = self.current(counts)

        def eps_of(direction: Direction) -> float:
            c = cur[direction]
            if isinstance(c, Stepped):
                # start the search from this direction's previous answer (online: a grid step away)
                guess = self._last_eps.get((direction, delta))
                out = c.epsilon(delta, c.base.epsilon(delta) if guess is None else guess)
            else:
                out = c.epsilon(delta)
            self._last_eps[(direction, delta)] = out
            return out

        eps = eps_of("remove")
        if self._add_needed or self.add_delta_bound(counts, eps) > delta:  # not certified: compose add too
            self._add_needed = True  # certificates fail for long runs and stay failing: stop trying
            eps = max(eps, eps_of("add"))
        return eps

    def add_delta_bound(self, counts: dict[Event, int], epsilon: float) -> float:
        """An upper bound on the add direction's delta at ``epsilon``, without composing it.

        For the discrete add-direction PLD of the composition (a dominating pair),
        ``delta(eps) <= P(L = inf) + P(eps < L < inf) <= P(L = inf) + finite mass * min_lam
        exp(sum_k c_k log M_k(lam) - lam eps)`` (Chernoff; the MGF of a sum of independent losses is
        the product). Where this is already at most the remove direction's answer, the add direction
        cannot raise the maximum, and its FFT is skipped (the usual case for short runs and large
        epsilon, where the remove direction dominates by orders of magnitude).
        """
        if any(not isinstance(e, SubsampledGaussianEvent) for e in counts):
            return math.inf
        h = self.grid.grid_h(counts)
        parts = self.grid.parts(counts, "add", h)
        log_finite = math.fsum(c * p.log_finite_mass for p, c in parts)
        var = math.fsum(c * p.var for p, c in parts)

        def f(i: int) -> float:
            idx = np.array([i])
            total = math.fsum(c * float(p.log_mgf(idx, 1)[0]) for p, c in parts)
            return total - float(LAMBDAS[i]) * epsilon

        log_bound = rung_search(f, var, math.log(1e5))
        return -math.expm1(log_finite) + math.exp(min(0.0, log_finite + log_bound))

    def current(self, counts: dict[Event, int]) -> PerDirection:
        """The composed PLD per direction: the last full composition plus, online, a few more steps.

        A full composition (FFT) is made when nothing usable is kept; it becomes the checkpoint. While
        the composition differs from the checkpoint only by ``m <= ONLINE_STEPS`` more steps of one
        subsampled event, those steps' PMF (cached per ``m``) is convolved with the checkpoint at the
        grid points a query needs (:class:`Stepped`): the same discrete PLD, without an FFT. Each
        direction is computed only when asked for.
        """
        h = self.grid.grid_h(counts)
        ck = self._checkpoint
        if ck is not None and ck[0] == h:
            base_counts, base = ck[1], ck[2]
            more = {e: c - base_counts.get(e, 0) for e, c in counts.items() if c != base_counts.get(e, 0)}
            if all(counts.get(e, 0) >= c for e, c in base_counts.items()):
                if not more:
                    return base
                if len(more) == 1:
                    ((e, m),) = more.items()
                    if isinstance(e, SubsampledGaussianEvent) and m <= ONLINE_STEPS:
                        count = counts[e]
                        return PerDirection(lambda d: Stepped(base[d], self.mfold(e, m, count, d, h)))
        full = self.composition(counts)
        self._checkpoint = (h, dict(counts), full)
        self._mfold_cache = {k: v for k, v in self._mfold_cache.items() if k[2] == h}
        return full

    def mfold(self, event: Event, m: int, count: int, direction: Direction, h: float) -> MFold:
        """The discrete PLD of ``m`` steps of ``event`` on its own window (Chernoff ends, as always)."""
        leaf = self.grid.leaf_pmf(event, count, direction, h)
        key = (id(leaf), direction, h, m)
        hit = self._mfold_cache.get(key)
        if hit is not None:
            return hit
        lo, hi, tail = window([(leaf, m)], h, self.grid.tail_mass)
        start = math.floor(lo / h)
        n = int(fft.next_fast_len(math.ceil(hi / h) - start + 1, real=True))
        spec = circular_spectrum(leaf.start, leaf.pmf, n)
        pmf = window_pmf(spec if m == 1 else spectrum_power(spec, m), n, start)
        nz = np.nonzero(pmf)[0]
        if len(nz) == 0:
            nz = np.array([0])
        pmf = pmf[nz[0] : nz[-1] + 1]
        inf_mass = -math.expm1(m * leaf.log_finite_mass)
        cum = np.concatenate(([0.0], np.cumsum(pmf)))
        extra = inf_mass + tail + self.fft_floor
        out = MFold(start + int(nz[0]), pmf, cum, discounted_suffix(pmf, h), extra, pmf[::-1].copy())
        self._mfold_cache[key] = out
        return out

    def composition(self, counts: dict[Event, int]) -> PerDirection:
        """The full composition (FFT) per direction, each direction computed on first use."""
        if self._composed is None:
            h = self.grid.grid_h(counts)
            snapshot = dict(counts)  # a direction composed later must see these counts
            self._composed = PerDirection(lambda d: self.compose_direction(d, h, snapshot))
        return self._composed

    def compose_direction(self, direction: Direction, h: float, counts: dict[Event, int]) -> Composed:
        """One direction's composition on grid ``h``, by the FFT, with its delta profile."""
        parts = self.grid.parts(counts, direction, h)
        log_finite = math.fsum(c * p.log_finite_mass for p, c in parts)
        inf_mass = -math.expm1(log_finite)
        lo, hi, tail = window(parts, h, self.grid.tail_mass)
        n, start, spec = self.spectrum(direction, h, parts, lo, hi)
        pmf = window_pmf(spec, n, start)
        a_suf, g_suf, delta_grid = delta_profile(pmf, h, inf_mass + tail + self.fft_floor)
        return Composed(h, start, pmf, inf_mass, tail + self.fft_floor, delta_grid, a_suf, g_suf)

    def spectrum(
        self, direction: Direction, h: float, parts: list[tuple[LeafPMF, int]], lo: float, hi: float
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
                        ls = self.leaf_spectrum(p, s_n)
                        spec *= ls if extra == 1 else spectrum_power(ls, extra)
                self._fft_state[direction] = (h, s_n, s_start, ids, spec)
                return s_n, s_start, spec
        # A first query gets the window it needs. Rebuilds (online use) get a margin of a quarter of the
        # width on each side, so that the window stays valid while the composition grows.
        margin = 0.25 * (hi - lo) if st is not None else 0.0
        start = math.floor((lo - margin) / h)
        n = int(fft.next_fast_len(math.ceil((hi + margin) / h) - start + 1, real=True))
        if n > MAX_FFT:
            raise InvalidParameter(
                f"the composed privacy loss spans {hi - lo:.3g} nats: too wide for the PLD grid h={h:g}; "
                "use a coarser value_discretization_interval or the 'rdp' accountant"
            )
        self._spec_cache.clear()
        spec = np.ones(n // 2 + 1, dtype=np.complex128)
        for p, c in parts:
            ls = self.leaf_spectrum(p, n)
            spec *= ls if c == 1 else spectrum_power(ls, c)
        self._fft_state[direction] = (h, n, start, {id(p): c for p, c in parts}, spec)
        return n, start, spec

    def leaf_spectrum(self, p: LeafPMF, n: int) -> NDArray[np.complex128]:
        key = (id(p), n)
        hit = self._spec_cache.get(key)
        if hit is None:
            hit = circular_spectrum(p.start, p.pmf, n)
            self._spec_cache[key] = hit
        return hit
