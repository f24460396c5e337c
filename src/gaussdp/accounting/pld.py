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

One step of a subsampled Gaussian is answered from its exact profile (Zhu, Dong & Wang 2022, Thm
11), with a relative floating-point allowance on delta; the add direction is composed only where a
Chernoff bound on its delta (from the cached per-event moment generating functions) does not already
lie below the remove direction's answer.

Online use costs O(1) per ``compose`` (a dict increment). A query makes a full composition (the
checkpoint) when nothing usable is kept; after up to ``_ONLINE_STEPS`` more steps of one event it
convolves the checkpoint's delta profile with the cached PMF of those steps at the few grid points
its search needs (:class:`_Stepped`): the same discrete PLD, at dot-product cost.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from scipy import special

from gaussdp._lazy import lazy_module
from gaussdp._validate import check_positive, real_number
from gaussdp.accounting._mechanisms import (
    PROFILE_LEAVES,
    leaf_atom_scale,
    leaf_log_delta,
    leaf_loss_range,
    leaf_mu2,
)
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.base import Accountant, invert_delta
from gaussdp.accounting.events import (
    EpsilonDeltaEvent,
    Event,
    GaussianEvent,
    PrivacyLossDistributionEvent,
    SubsampledGaussianEvent,
)
from gaussdp.accounting.rdp import RDPAccountant
from gaussdp.calibration import delta_for_mu, epsilon_for_mu
from gaussdp.errors import InvalidParameter, NumericalFault

if TYPE_CHECKING:
    from scipy import fft
else:
    fft = lazy_module("scipy.fft")  # imported on first use: keeps `import gaussdp` cheap

__all__ = ["PLDAccountant"]

FloatArray = NDArray[np.float64]


def _discounted_suffix(p: FloatArray, h: float) -> FloatArray:
    """``G_j = sum_{i >= j} p_i e^{-(i - j) h}`` for ``p >= 0``, by reversed cumulative sums.

    Within chunks of at most 500 nats the weights ``e^{-(i - a) h}`` stay far from under- and
    overflow; chunks are joined by ``G_j += e^{-(b - j) h} G_b``. All terms are non-negative, so the
    sums have small relative error (no cancellation).
    """
    n = len(p)
    out = np.empty(n)
    chunk = max(1, min(n, int(500.0 / h)))
    carry = 0.0
    for b in range(n, 0, -chunk):
        a = max(0, b - chunk)
        k = np.arange(b - a, dtype=np.float64) * h
        seg = np.cumsum((p[a:b] * np.exp(-k))[::-1])[::-1]
        out[a:b] = seg * np.exp(k) + carry * np.exp(-(b - a) * h + k)
        carry = float(out[a])
    return out


Direction = Literal["remove", "add"]

_MAX_FFT = 1 << 24
# Discretisation error the default grid aims at, relative to epsilon (results stay upper bounds; this
# is how far above the exact epsilon they may be).
_TARGET_REL = 4e-4
# Online: at most this many steps of one event are added to the last full composition by direct
# convolution at the queried points before a new full (FFT) composition is made.
_ONLINE_STEPS = 64


@dataclass(frozen=True)
class _LeafPMF:
    """A discrete PLD: mass ``pmf[j]`` at loss ``(start + j) * h``; the rest of the mass is at +inf."""

    start: int
    pmf: FloatArray
    log_finite_mass: float
    mean: float  # of the normalised finite part, in nats
    var: float
    x: FloatArray  # losses (nats) of the entries with positive mass
    log_w: FloatArray  # log of their normalised mass
    mass_excess: float  # total mass minus 1: floating-point rounding of the discretisation
    # log E[e^{+-lam L}] of the normalised finite part at _LAMBDAS[i], computed only where asked
    # (a window needs a few exponents near its Chernoff optimum, not all of them).
    mgf_memo: dict[tuple[int, int], float] = field(default_factory=dict, compare=False)

    def log_mgf(self, idx: NDArray[np.intp], sign: int) -> FloatArray:
        """log E[e^{sign lam L}] at ``lam = _LAMBDAS[idx]``, exact for this discrete PLD."""
        missing = [int(i) for i in idx if (int(i), sign) not in self.mgf_memo]
        if missing:
            lam = _LAMBDAS[missing]
            a = self.log_w[None, :] + sign * lam[:, None] * self.x[None, :]
            amax = a.max(axis=1)
            vals = np.log(np.exp(a - amax[:, None]).sum(axis=1)) + amax
            for i, v in zip(missing, vals, strict=True):
                self.mgf_memo[(i, sign)] = float(v)
        return np.array([self.mgf_memo[(int(i), sign)] for i in idx])


# Chernoff exponents for the window: a fixed ladder, so that each event's MGF values are cached and
# shared across queries; each window evaluates only the rungs near its optimum (_lambda_rungs).
_LAMBDAS = np.geomspace(1e-2, 1e7, 60)


def _lambda_rungs(var_total: float, log_inv_tau: float) -> NDArray[np.intp]:
    # For a Gaussian of variance V the Chernoff optimum for a tail of mass tau is sqrt(2 log(1/tau)/V);
    # heavier (subsampled) tails have their optimum below it. Any rung gives a valid bound: the range
    # only decides how tight the window is.
    lam_star = math.sqrt(2.0 * log_inv_tau / max(var_total, 1e-300))
    ok = np.nonzero((_LAMBDAS >= lam_star / 1000.0) & (_LAMBDAS <= lam_star * 4.0))[0]
    if len(ok) < 4:
        near = int(np.argmin(np.abs(np.log(_LAMBDAS / lam_star))))
        ok = np.arange(max(0, near - 3), min(len(_LAMBDAS), near + 4))
    return ok


def _chernoff_end(parts: list[tuple[_LeafPMF, int]], sign: int, log_tau: float, var: float) -> float:
    """min over the rungs lam of (sum_k c_k log M_k(sign lam) - log tau) / lam: a Chernoff end point.

    Every rung gives a valid bound (P(sign S > t) <= tau at that t), so a local search from the
    Gaussian optimum, which evaluates the moment generating functions at a few rungs only, is safe.
    """

    def f(i: int) -> float:
        idx = np.array([i])
        total = math.fsum(c * float(p.log_mgf(idx, sign)[0]) for p, c in parts)
        return (total - log_tau) / float(_LAMBDAS[i])

    return _rung_search(f, var, -log_tau)


def _rung_search(f: Callable[[int], float], var: float, log_inv_tau: float) -> float:
    """A local minimum over rung indices of ``f``, from the Gaussian-optimal rung for a tail of mass
    tau and variance var: strides of 4 rungs while it improves (down first, else up), then a refine.
    Any rung's value is a valid bound; the search only makes it tight."""
    lam_star = math.sqrt(2.0 * log_inv_tau / max(var, 1e-300))
    last = len(_LAMBDAS) - 1
    memo: dict[int, float] = {}

    def g(j: int) -> float:
        j = min(last, max(0, j))
        if j not in memo:
            memo[j] = f(j)
        return memo[j]

    best_i = int(np.clip(np.searchsorted(_LAMBDAS, lam_star), 0, last))
    for step in (-4, 4):
        j, moved = best_i + step, False
        while 0 <= j <= last and g(j) < g(best_i):
            best_i, j, moved = j, j + step, True
        if moved:
            break
    for j in range(best_i - 3, best_i + 4):
        if g(j) < g(best_i):
            best_i = min(last, max(0, j))
    return g(best_i)


def _make_leaf(start: int, pmf: FloatArray, log_finite_mass: float, h: float) -> _LeafPMF:
    nz = np.nonzero(pmf > 0.0)[0]
    x = (start + nz).astype(np.float64) * h
    w = pmf[nz] / pmf[nz].sum()
    m = float(np.einsum("i,i->", w, x))  # einsum, not np.dot: no BLAS threads to wake (see _conv)
    v = float(np.einsum("i,i->", w, (x - m) ** 2))
    excess = float(np.sum(pmf)) - math.exp(log_finite_mass) if math.isfinite(log_finite_mass) else 0.0
    return _LeafPMF(start, pmf, log_finite_mass, m, v, x, np.log(w), excess)


@dataclass(frozen=True)
class _Composed:
    """A composed PLD on a window of the grid, with the mass at +inf and the Chernoff tail bound."""

    h: float
    start: int
    pmf: FloatArray
    inf_mass: float
    tail: float
    delta_grid: FloatArray  # delta at each grid point of the window, allowances included
    a_suf: FloatArray  # A_j = sum_{i >= j} p_i (window only)
    g_suf: FloatArray  # G_j = sum_{i >= j} p_i e^{-(i - j) h}

    def delta(self, epsilon: float) -> float:
        j = math.ceil(epsilon / self.h - 1e-12) - self.start  # first index with loss >= epsilon
        extra = self.inf_mass + self.tail
        if j >= len(self.pmf):
            return extra
        if j < 0:
            return 1.0  # below the window, where wrapped-around mass is not accounted for
        # sum_{i >= j} p_i (1 - e^{eps - x_i}) = A_j - e^{eps - x_j} G_j
        x_j = (self.start + j) * self.h
        return extra + max(0.0, float(self.a_suf[j]) - math.exp(epsilon - x_j) * float(self.g_suf[j]))

    def epsilon(self, delta: float) -> float:
        d = self.delta_grid
        ok = np.nonzero(d <= delta)[0]
        if len(ok) == 0:
            raise _BelowFloor
        j = int(ok[0])
        eps_j = (self.start + j) * self.h
        if j == 0:
            return eps_j
        a = self.inf_mass + self.tail + float(self.a_suf[j])
        return _solve_between(eps_j, self.h, a, float(self.g_suf[j]), delta)


def _solve_between(eps_j: float, h: float, a: float, g: float, delta: float) -> float:
    """Smallest eps in [eps_j - h, eps_j] with a - e^{eps - eps_j} g <= delta, rounded up.

    Between two grid points the profile of a discrete PLD is exactly ``A - e^eps G`` (the set of
    losses above eps does not change), so the crossing has a closed form.
    """
    if g > 0.0 and a - delta > 0.0 and math.isfinite(a) and math.isfinite(g):
        eps = eps_j + math.log((a - delta) / g)
        eps = min(eps_j, max(eps_j - h, eps))
        return eps + 1e-12 * max(1.0, abs(eps))
    return eps_j


@dataclass(frozen=True)
class _MFold:
    """``m`` steps of one event as a discrete PLD on its own window (for online composition)."""

    start: int
    pmf: FloatArray
    cum: FloatArray  # cum[t] = sum of pmf[:t]
    g: FloatArray  # g[t] = sum_{t' >= t} pmf[t'] e^{-(t' - t) h}
    extra: float
    rev: FloatArray  # pmf[::-1], contiguous  # mass at +inf, Chernoff tail above the window, FFT allowance


@dataclass(frozen=True)
class _Stepped:
    """A composed PLD (a checkpoint) followed by ``m`` more steps of one event, never materialised.

    Delta, the suffix mass A and the discounted suffix G of a composition are all convolutions of
    the checkpoint's with the added steps' PMF (``delta_{S+T}(x) = sum_t w_t delta_S(x - t)``), so a
    query evaluates them at a few grid points with dot products of the added steps' PMF against the
    checkpoint's arrays: O(width of m steps) per point instead of an FFT of the whole window. Outside
    the checkpoint's window the bounds used are pessimistic: delta and A are 1 (plus allowances)
    below it and the allowances above it; G (subtracted) is 0 outside.
    """

    base: _Composed
    more: _MFold

    def _conv(self, arr: FloatArray, j_abs: int, below: float, below_exp: float, above: float) -> float:
        """sum_t w_t f(j_abs - l_t) with f = arr in the checkpoint's window, ``above`` above it, and
        ``below + below_exp e^{(j - start) h}`` at grid index j below it."""
        w, cum = self.more.pmf, self.more.cum
        n0, length = len(arr), len(w)
        u = j_abs - self.more.start - self.base.start  # arr index paired with w[0]
        total = 0.0
        if u >= n0:  # w[t] with t <= u - n0 lands above the window
            total += above * float(cum[min(length, u - n0 + 1)])
        t_below = max(0, u + 1)  # w[t] with t > u lands below it
        if t_below < length:
            total += below * float(cum[length] - cum[t_below])
            if below_exp != 0.0:
                # sum_{t >= t_below} w_t e^{(u - t) h} = e^{(u - t_below) h} Gw[t_below]
                total += below_exp * math.exp((u - t_below) * self.base.h) * float(self.more.g[t_below])
        t_lo, t_hi = max(0, u - n0 + 1), min(length - 1, u)
        if t_lo <= t_hi:
            wr = self.more.rev  # w reversed and contiguous: w[t_hi], ..., w[t_lo] is one slice of it
            # einsum, not np.dot: BLAS's threaded dot costs milliseconds to wake its threads per call
            total += float(
                np.einsum("i,i->", wr[length - 1 - t_hi : length - t_lo], arr[u - t_hi : u - t_lo + 1])
            )
        return total

    def _extra0(self) -> float:
        return (self.base.inf_mass + self.base.tail) * max(1.0, float(self.more.cum[-1]))

    def _delta_at(self, j_abs: int) -> float:
        # Below the window the checkpoint's delta is A_0 - e^{x - x_0} G_0 + allowances (the mass
        # below the window wrapped into it, where it counts pessimistically).
        b = self.base
        e0 = b.inf_mass + b.tail
        below = float(b.a_suf[0]) + e0
        return self._conv(b.delta_grid, j_abs, below, -float(b.g_suf[0]), e0) + self.more.extra

    def _a_g(self, j_abs: int) -> tuple[float, float]:
        b = self.base
        a = self._conv(b.a_suf, j_abs, float(b.a_suf[0]), 0.0, 0.0) + self._extra0() + self.more.extra
        return a, self._conv(b.g_suf, j_abs, 0.0, float(b.g_suf[0]), 0.0)

    def delta(self, epsilon: float) -> float:
        h = self.base.h
        j = math.ceil(epsilon / h - 1e-12)
        a, g = self._a_g(j)
        return max(self._extra0() + self.more.extra, a - math.exp(epsilon - j * h) * g)

    def epsilon(self, delta: float, guess: float) -> float:
        h = self.base.h
        top = self.base.start + len(self.base.pmf) + self.more.start + len(self.more.pmf) + 1
        bottom = self.base.start + self.more.start - 1
        if self._delta_at(top) > delta:
            raise _BelowFloor
        # smallest grid index j with delta(x_j) <= delta (delta is non-increasing): bracket from the
        # guess by doubling steps (delta(bottom) ~ 1 > delta and delta(top) <= delta), then bisect.
        j = min(top, max(bottom, math.ceil(guess / h)))
        step = 1
        if self._delta_at(j) <= delta:
            hi_j = j
            while True:
                lo_j = max(bottom, hi_j - step)
                if lo_j == bottom or self._delta_at(lo_j) > delta:
                    break
                hi_j, step = lo_j, step * 2
        else:
            lo_j = j
            while True:
                hi_j = min(top, lo_j + step)
                if hi_j == top or self._delta_at(hi_j) <= delta:
                    break
                lo_j, step = hi_j, step * 2
        while hi_j - lo_j > 1:
            mid = (lo_j + hi_j) // 2
            if self._delta_at(mid) <= delta:
                hi_j = mid
            else:
                lo_j = mid
        a, g = self._a_g(hi_j)
        return _solve_between(hi_j * h, h, a, g, delta)


class _PerDirection(dict[Direction, Any]):  # values: _Composed, or _Stepped on a checkpoint
    """direction -> composed PLD, each computed on first use (a certified direction never is)."""

    def __init__(self, make: Callable[[Direction], _Composed | _Stepped]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, direction: Direction) -> _Composed | _Stepped:
        value = self._make(direction)
        self[direction] = value
        return value


# Relative allowance on the exact one-step delta for floating-point error: against 50-digit mpmath
# (400 random points, sigma in [0.3, 1e3], q in [1e-9, 1], epsilon in [1e-9, 30]) subsampled_log_delta
# was within 3e-8 of the true delta wherever delta > 1e-30 and within 3e-5 below that (cancellation
# between the two terms); tests/accounting check it at DP-SGD settings.
_ONE_STEP_REL = 1e-6
_ONE_STEP_REL_TINY = 1e-3  # for delta < 1e-30


def _one_step_delta(event: SubsampledGaussianEvent, epsilon: float) -> float:
    """The exact delta(epsilon) of one subsampled Gaussian step (max over both directions), rounded up.

    Exact by Zhu, Dong & Wang 2022, Theorem 11 (the pair in :mod:`gaussdp.accounting._profiles`).
    """
    sigma, q = event.noise_multiplier, event.sample_rate
    log_d = max(
        float(subsampled_log_delta(sigma, q, epsilon, "remove")[0]),
        float(subsampled_log_delta(sigma, q, epsilon, "add")[0]),
    )
    rel = _ONE_STEP_REL if log_d > -69.0 else _ONE_STEP_REL_TINY
    return min(1.0, math.exp(log_d) * (1.0 + rel))


_COARSE = 32  # stride of the first, coarse pass over a wide leaf
_NEGLIGIBLE = 1e-30  # per-step mass left on the coarse points


def _profile_points(
    lo_i: int, hi_i: int, h: float, log_delta: Callable[[FloatArray], FloatArray]
) -> NDArray[np.int64]:
    """Grid indices at which to evaluate the exact profile for connect-the-dots.

    Connect-the-dots dominates the true PLD with *any* increasing set of points (chords of the convex
    profile lie above it; Doroshenko et al. 2022), so far tails, where a step's loss lands with
    probability below 1e-30, keep only every 32nd grid point: their mass is moved up by at most 32
    grid steps (pessimistic, and negligible), and the profile is evaluated at a fraction of the points.
    Every other coarse interval, found from a coarse connect-the-dots pass, keeps every point.
    """
    n = hi_i - lo_i + 1
    if n <= 8 * _COARSE:
        return np.arange(lo_i, hi_i + 1)
    coarse = np.arange(lo_i, hi_i + 1, _COARSE)
    if coarse[-1] != hi_i:
        coarse = np.append(coarse, hi_i)
    eps_c = coarse.astype(np.float64) * h
    pmf_c, _ = _connect_dots(eps_c, log_delta(eps_c))
    heavy = pmf_c > _NEGLIGIBLE
    # coarse interval i = [coarse[i], coarse[i + 1]] is refined when either end carries mass
    dense = heavy[:-1] | heavy[1:]
    interval = np.minimum(np.arange(n) // _COARSE, len(dense) - 1)
    keep = dense[interval]
    keep[coarse - lo_i] = True
    return np.nonzero(keep)[0] + lo_i


def _spectrum_power(spec: NDArray[np.complex128], c: int) -> NDArray[np.complex128]:
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


def _bucket(count: int) -> int:
    """The count rounded up to a power of 16: per-step truncation is sized for it, so the cached
    discretisation of an event changes only a few times while a training loop adds steps."""
    return 1 << (4 * math.ceil(max(0, (count - 1).bit_length()) / 4))


class _BelowFloor(Exception):
    """The asked delta is below what this discrete PLD can resolve."""


def _connect_dots(
    eps_grid: FloatArray, log_delta: FloatArray, log_delta_rev: FloatArray | None = None
) -> tuple[FloatArray, float]:
    """The discrete PLD on ``eps_grid`` whose profile, as a function of ``y = e^eps``, interpolates the
    exact profile linearly between grid points (Doroshenko et al. 2022, Section 3), and its mass at +inf.

    The profile is the line from (0, 1) to the first point below it, the chords between points, and
    flat (= the delta at the last point: that mass goes to +inf) above it. Mass at point i is
    ``y_i (s_{i+1} - s_i)`` with ``s_i`` the slope of the chord ending at point i; with ``y = e^eps``,
    ``y_i s_{i+1} = (d_{i+1} - d_i) / expm1(eps_{i+1} - eps_i)`` and ``y_i s_i = (d_i - d_{i-1}) /
    -expm1(-(eps_i - eps_{i-1}))`` involve only grid *differences*, so no e^eps is formed: losses far
    above 709 nats (noise multipliers of a few hundredths) do not overflow.

    The differences themselves are where precision is lost: at negative epsilon the profile is close
    to 1, and ``d_{i+1} - d_i`` formed from two numbers near 1 keeps only ``1e-16`` of absolute
    accuracy, which the division by ``expm1(h)`` amplifies by ``1 / h`` (a grid of 1e-8: masses wrong
    by 1e-8 per point, composed a million times). ``log_delta_rev`` removes that: at each negative
    grid point ``x`` it holds ``log delta'(-x)`` of the *reversed* pair (the add direction for the
    remove one, the pair itself for symmetric pairs), and ``d(x) = 1 - e^x (1 - delta'(-x))``
    (``H_a(P||Q) = 1 - a + a H_{1/a}(Q||P)``), so every difference is formed from small quantities:
    between two negative points ``e^a ((delta'_b - delta'_a) - expm1(b - a)(1 - delta'_b))``, across
    zero ``delta(b) + expm1(a) - e^a delta'_a``.
    """
    n = len(eps_grid)
    de = np.diff(eps_grid)
    if log_delta_rev is None:
        d = np.exp(log_delta)
        dd = np.diff(d)  # <= 0: the profile is non-increasing
        first_minus_1 = d[0] - 1.0
        last = float(d[-1])
    else:
        neg = eps_grid < 0.0
        dpos = np.where(neg, 0.0, np.exp(np.where(neg, 0.0, log_delta)))  # delta(x), x >= 0
        drev = np.where(neg, np.exp(np.where(neg, log_delta_rev, 0.0)), 0.0)  # delta'(-x), x < 0
        ex = np.exp(np.minimum(eps_grid, 0.0))  # e^x on the negative side
        a, b = eps_grid[:-1], eps_grid[1:]
        na, nb = neg[:-1], neg[1:]
        # e^a expm1(b - a) = e^b - e^a: the expm1 form where the two are close (no cancellation), the
        # difference where they are far apart (expm1 would overflow past 709 nats)
        with np.errstate(over="ignore"):
            rise = np.where(b - a < 1.0, ex[:-1] * np.expm1(np.minimum(b - a, 1.0)), ex[1:] - ex[:-1])
        both_neg = ex[:-1] * (drev[1:] - drev[:-1]) - rise * (1.0 - drev[1:])
        across = dpos[1:] + np.expm1(np.minimum(a, 0.0)) - ex[:-1] * drev[:-1]
        dd = np.where(na & nb, both_neg, np.where(na, across, dpos[1:] - dpos[:-1]))
        first_minus_1 = -ex[0] * (1.0 - drev[0]) if neg[0] else dpos[0] - 1.0
        last = float(1.0 - ex[-1] * (1.0 - drev[-1])) if neg[-1] else float(dpos[-1])
    up = np.zeros(n)  # y_i s_{i+1}; 0 at the last point (flat beyond it)
    with np.errstate(over="ignore"):  # points ~710 nats apart: y_i / (y_{i+1} - y_i) is 0 exactly
        up[:-1] = dd / np.expm1(de)
    down = np.empty(n)  # y_i s_i
    down[0] = first_minus_1  # the chord from (0, 1)
    down[1:] = dd / -np.expm1(-de)
    pmf = up - down
    if not np.all(np.isfinite(pmf)):
        raise NumericalFault("connect-the-dots produced a non-finite probability mass")
    return np.maximum(pmf, 0.0), last


class PLDAccountant(Accountant):
    """Privacy loss distribution accountant with a dominating (upper-bound) discretisation.

    Args:
        value_discretization_interval: grid spacing ``h`` of the privacy loss, > 0 (any spacing gives
            an upper bound; a coarse one a loose bound); ``None`` picks it from the per-step loss
            spread so that the discretisation adds at most about 0.04% to epsilon (0.01-0.03%
            measured on DP-SGD settings of 2 to 1e5 steps).
        tail_mass: probability mass the truncation may move to +infinity (added to delta), in
            (0, 1e-3].
        fft_floor: allowance for FFT rounding, added to every delta; >= 1e-13 (smaller would not
            cover the rounding, and the answers would no longer be upper bounds).
        rdp_below: deltas smaller than this, in (0, 1), are answered with the smaller of an
            exponentially tilted PLD (with its own truncation and rounding allowances) and the RDP
            bound.

    Accepted domain: every event the base class accepts (Gaussian, Poisson- and replace-one
    subsampled Gaussian, fixed-size batches, Laplace, discrete Gaussian, privacy loss histograms and
    profiles, (epsilon, delta)); every delta in (0, 1) and epsilon >= 0. Where the grid cannot hold
    a composition (a loss spanning more than 2^24 grid points) or the answer exceeds 1e6, it refuses
    with :class:`~gaussdp.errors.InvalidParameter`; a numerical fault raises
    :class:`~gaussdp.errors.NumericalFault`.
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
            value_discretization_interval = check_positive(
                "value_discretization_interval", value_discretization_interval
            )
        tail = check_positive("tail_mass", tail_mass)
        if tail > 1e-3:
            raise InvalidParameter(f"tail_mass must be in (0, 1e-3], got tail_mass={tail_mass!r}")
        floor = real_number("fft_floor", fft_floor)
        if floor < 1e-13:
            # the allowance covers the FFT's rounding (about 1e-16 per entry): less is no upper bound
            raise InvalidParameter(
                f"fft_floor must be >= 1e-13 (the FFT's rounding), got fft_floor={fft_floor!r}"
            )
        below = check_positive("rdp_below", rdp_below)
        if below >= 1.0:
            raise InvalidParameter(f"rdp_below must be in (0, 1), got rdp_below={rdp_below!r}")
        self._h = value_discretization_interval
        self._tail_mass = tail
        self._fft_floor = floor
        self._rdp_below = below
        self._composed: _PerDirection | None = None
        self._leaf_cache: dict[tuple[object, ...], _LeafPMF] = {}
        self._spec_cache: dict[tuple[int, int], NDArray[np.complex128]] = {}
        self._fft_state: dict[Direction, tuple[float, int, int, dict[int, int], NDArray[np.complex128]]] = {}
        # Online use: the last full composition (grid, counts, per-direction PLD) and the PMFs of a few
        # more steps of one event, so that a query after each step costs dot products, not FFTs.
        self._checkpoint: tuple[float, dict[Event, int], _PerDirection] | None = None
        self._mfold_cache: dict[tuple[object, ...], _MFold] = {}
        self._last_eps: dict[tuple[Direction, float], float] = {}
        self._add_needed = False  # the add direction could not be certified negligible once already

    def _supports_leaf(self, leaf: Event) -> bool:
        return isinstance(leaf, (GaussianEvent, SubsampledGaussianEvent, EpsilonDeltaEvent, *PROFILE_LEAVES))

    def _on_compose(self) -> None:
        self._composed = None

    # ----- answers -----------------------------------------------------------------------------
    def _single_step(self) -> SubsampledGaussianEvent | None:
        """The event when the composition is one subsampled Gaussian step, else None."""
        if len(self._counts) == 1:
            ((e, c),) = self._counts.items()
            if c == 1 and isinstance(e, SubsampledGaussianEvent):
                return e
        return None

    def _epsilon(self, delta: float) -> float:
        if self._only_gaussian():
            return epsilon_for_mu(mu=self._gaussian_mu(), delta=delta)
        one = self._single_step()
        if one is not None:
            # One step: its exact profile, inverted (tighter and faster than any discretisation).
            return invert_delta(lambda e: _one_step_delta(one, e), delta)
        if delta < self._rdp_below:
            return self._small_delta_epsilon(delta)
        try:
            eps = max(0.0, self._plain_epsilon(delta))
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

    def _plain_epsilon(self, delta: float) -> float:
        cur = self._current()

        def eps_of(direction: Direction) -> float:
            c = cur[direction]
            if isinstance(c, _Stepped):
                # start the search from this direction's previous answer (online: a grid step away)
                guess = self._last_eps.get((direction, delta))
                out = c.epsilon(delta, c.base.epsilon(delta) if guess is None else guess)
            else:
                out = c.epsilon(delta)
            self._last_eps[(direction, delta)] = out
            return out

        eps = eps_of("remove")
        if self._add_needed or self._add_delta_bound(eps) > delta:  # not certified: compose add too
            self._add_needed = True  # certificates fail for long runs and stay failing: stop trying
            eps = max(eps, eps_of("add"))
        return eps

    def _add_delta_bound(self, epsilon: float) -> float:
        """An upper bound on the add direction's delta at ``epsilon``, without composing it.

        For the discrete add-direction PLD of the composition (a dominating pair),
        ``delta(eps) <= P(L = inf) + P(eps < L < inf) <= P(L = inf) + finite mass * min_lam
        exp(sum_k c_k log M_k(lam) - lam eps)`` (Chernoff; the MGF of a sum of independent losses is
        the product). Where this is already at most the remove direction's answer, the add direction
        cannot raise the maximum, and its FFT is skipped (the usual case for short runs and large
        epsilon, where the remove direction dominates by orders of magnitude).
        """
        if any(not isinstance(e, SubsampledGaussianEvent) for e in self._counts):
            return math.inf
        h = self._grid_h()
        parts = self._parts("add", h)
        log_finite = math.fsum(c * p.log_finite_mass for p, c in parts)
        var = math.fsum(c * p.var for p, c in parts)

        def f(i: int) -> float:
            idx = np.array([i])
            total = math.fsum(c * float(p.log_mgf(idx, 1)[0]) for p, c in parts)
            return total - float(_LAMBDAS[i]) * epsilon

        log_bound = _rung_search(f, var, math.log(1e5))
        return -math.expm1(log_finite) + math.exp(min(0.0, log_finite + log_bound))

    def _current(self) -> _PerDirection:
        """The composed PLD per direction: the last full composition plus, online, a few more steps.

        A full composition (FFT) is made when nothing usable is kept; it becomes the checkpoint. While
        the composition differs from the checkpoint only by ``m <= _ONLINE_STEPS`` more steps of one
        subsampled event, those steps' PMF (cached per ``m``) is convolved with the checkpoint at the
        grid points a query needs (:class:`_Stepped`): the same discrete PLD, without an FFT. Each
        direction is computed only when asked for.
        """
        h = self._grid_h()
        ck = self._checkpoint
        if ck is not None and ck[0] == h:
            base_counts, base = ck[1], ck[2]
            more = {
                e: c - base_counts.get(e, 0) for e, c in self._counts.items() if c != base_counts.get(e, 0)
            }
            if all(self._counts.get(e, 0) >= c for e, c in base_counts.items()):
                if not more:
                    return base
                if len(more) == 1:
                    ((e, m),) = more.items()
                    if isinstance(e, SubsampledGaussianEvent) and m <= _ONLINE_STEPS:
                        count = self._counts[e]
                        return _PerDirection(lambda d: _Stepped(base[d], self._mfold(e, m, count, d, h)))
        full = self._compose_lazy()
        self._checkpoint = (h, dict(self._counts), full)
        self._mfold_cache = {k: v for k, v in self._mfold_cache.items() if k[2] == h}
        return full

    def _mfold(self, event: Event, m: int, count: int, direction: Direction, h: float) -> _MFold:
        """The discrete PLD of ``m`` steps of ``event`` on its own window (Chernoff ends, as always)."""
        leaf = self._leaf_pmf(event, count, direction, h)
        key = (id(leaf), direction, h, m)
        hit = self._mfold_cache.get(key)
        if hit is not None:
            return hit
        lo, hi, tail = self._window([(leaf, m)], h)
        start = math.floor(lo / h)
        n = int(fft.next_fast_len(math.ceil(hi / h) - start + 1, real=True))
        buf = np.zeros(n)
        np.add.at(buf, (leaf.start + np.arange(len(leaf.pmf))) % n, leaf.pmf)
        spec = fft.rfft(buf)
        pmf = np.maximum(
            np.roll(fft.irfft(spec if m == 1 else _spectrum_power(spec, m), n=n), -(start % n)), 0.0
        )
        nz = np.nonzero(pmf)[0]
        if len(nz) == 0:
            nz = np.array([0])
        pmf = pmf[nz[0] : nz[-1] + 1]
        inf_mass = -math.expm1(m * leaf.log_finite_mass)
        cum = np.concatenate(([0.0], np.cumsum(pmf)))
        extra = inf_mass + tail + self._fft_floor
        out = _MFold(start + int(nz[0]), pmf, cum, _discounted_suffix(pmf, h), extra, pmf[::-1].copy())
        self._mfold_cache[key] = out
        return out

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
        if self._h is None:
            # The tilted composition's rounding allowance grows like 1/h: it keeps the default grid on
            # whole powers of two (never coarser than the plain path's), where it was calibrated.
            h = float(2.0 ** math.floor(math.log2(h)))
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
        rungs = _lambda_rungs(math.fsum(c * p.var for p, c in parts), -math.log(self._tail_mass))
        total_mgf = np.zeros(len(rungs))
        for p, c in parts:
            total_mgf += c * p.log_mgf(rungs, 1)
        guess = eps_guess if math.isfinite(eps_guess) else hi
        lam = float(_LAMBDAS[rungs[int(np.argmin(total_mgf - _LAMBDAS[rungs] * guess))]])
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
            spec *= ls if c == 1 else _spectrum_power(ls, c)
            log_m += c * lm
        tilted = np.maximum(np.roll(fft.irfft(spec, n=n), -(start % n)), 0.0)
        x_win = (start + np.arange(n)) * h
        # untilt: p_j = exp(log_m - lam x_j) * tilted_j; entries far below epsilon may overflow and
        # are garbage, but the search below runs from the top and never reads past the crossing.
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.exp(np.minimum(log_m - lam * x_win, 700.0)) * (tilted + 1e-14)
        rev = v[::-1]
        a_suf = np.cumsum(rev)[::-1]
        g_suf = _discounted_suffix(v, h)
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

    def _parts(
        self, direction: Direction, h: float, counts: dict[Event, int] | None = None
    ) -> list[tuple[_LeafPMF, int]]:
        counts = self._counts if counts is None else counts
        parts: list[tuple[_LeafPMF, int]] = []
        mu = math.sqrt(
            math.fsum(c / e.noise_multiplier**2 for e, c in counts.items() if isinstance(e, GaussianEvent))
        )
        if mu > 0.0:
            parts.append((self._leaf_pmf(1.0 / mu, 1, direction, h), 1))
        for e, c in counts.items():
            if not isinstance(e, GaussianEvent):
                parts.append((self._leaf_pmf(e, c, direction, h), c))
        return parts

    def _delta(self, epsilon: float) -> float:
        if self._only_gaussian():
            return delta_for_mu(mu=self._gaussian_mu(), epsilon=epsilon)
        one = self._single_step()
        if one is not None:
            return _one_step_delta(one, epsilon)
        cur = self._current()
        d: float = cur["remove"].delta(epsilon)
        if self._add_needed or self._add_delta_bound(epsilon) > d:
            d = max(d, cur["add"].delta(epsilon))
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
        # Per-step spread of the loss: sum of count * q^2 * (e^{1/sigma^2} - 1) is the CLT mu^2 (Bu
        # et al. 2020), mu^2 / steps the mean per-step variance s^2.
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
        steps = max(1, self.steps)
        # Connect-the-dots moves each step's mass to neighbouring grid points, which widens the
        # composed loss by a variance of at most about h^2/4 per step: relative to s^2 that moves
        # epsilon by at most about h^2 / (8 s^2) (measured: 0.14-0.74 of that on DP-SGD settings with
        # 2 .. 1e5 steps, against grids 16x finer). h keeps it at _TARGET_REL, whatever the count.
        s_step = math.sqrt(mu2 / steps)
        h = min(1e-2, max(1e-9, s_step * math.sqrt(8.0 * _TARGET_REL)))
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
        atom_min = min((leaf_atom_scale(e) for e in self._counts), default=math.inf)
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
            if h >= 1e-2 or self._mass_excess(h) <= 1.0:
                break
            h *= 2.0
        return h

    def _mass_excess(self, h: float) -> float:
        # Every discretised leaf (profile leaves have one symmetric pair for both directions).
        excess = 0.0
        for e, c in self._counts.items():
            if isinstance(e, SubsampledGaussianEvent):
                for direction in ("remove", "add"):
                    excess += c * abs(self._leaf_pmf(e, c, direction, h).mass_excess)
            elif isinstance(e, PROFILE_LEAVES):
                excess += c * abs(self._leaf_pmf(e, c, "remove", h).mass_excess)
        return excess

    def _leaf_range(self, leaf: Event, count: int) -> float:
        if isinstance(leaf, SubsampledGaussianEvent):
            lo, hi = self._support(leaf.noise_multiplier, leaf.sample_rate, count, "remove")
            return hi - lo
        if isinstance(leaf, PROFILE_LEAVES):
            lo, hi = leaf_loss_range(leaf, self._leaf_tail(count))
            return hi - lo
        return 0.0

    def _leaf_tail(self, count: int) -> float:
        # The per-step truncation mass of _support, on the same buckets of the count.
        return self._tail_mass / (4.0 * _bucket(count))

    def _support(self, sigma: float, q: float, count: int, direction: Direction) -> tuple[float, float]:
        bucket = _bucket(count)
        z = float(-special.ndtri(self._tail_mass / (4.0 * bucket)))
        if q >= 1.0:
            mu = 1.0 / sigma
            return mu * mu / 2.0 - z * mu, mu * mu / 2.0 + z * mu
        log1mq, log_q = math.log1p(-q), math.log(q)
        if direction == "remove":
            return log1mq, float(np.logaddexp(log1mq, log_q + (2 * (1 + z * sigma) - 1) / (2 * sigma**2)))
        return -float(np.logaddexp(log1mq, log_q + (2 * z * sigma - 1) / (2 * sigma**2))), -log1mq

    def _leaf_pmf(self, leaf: Event | float, count: int, direction: Direction, h: float) -> _LeafPMF:
        # Per-step truncation mass shrinks with the count, on powers of 16 (_bucket) so that the cache is
        # reused while a training loop composes one step at a time.
        bucket = _bucket(count)
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
            # Symmetric pairs (all but user histograms, which may not be): the reversed profile at
            # -x is the profile itself at |x|, for the accurate differences at negative losses.
            rev = None
            if not isinstance(leaf, PrivacyLossDistributionEvent):
                rev = leaf_log_delta(leaf, np.abs(grid_p))
            pmf, inf_mass = _connect_dots(grid_p, leaf_log_delta(leaf, grid_p), rev)
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
            idx = _profile_points(lo_i, hi_i, h, lambda e: subsampled_log_delta(sigma, q, e, direction))
            grid: FloatArray = idx.astype(np.float64) * h
            log_d = subsampled_log_delta(sigma, q, grid, direction)
            # The reversed pair (remove <-> add; a Gaussian is symmetric) at -x for negative x.
            other: Direction = direction if q >= 1.0 else ("add" if direction == "remove" else "remove")
            log_rev = subsampled_log_delta(sigma, q, np.abs(grid), other)
            pmf = np.zeros(hi_i - lo_i + 1)
            pmf[idx - lo_i], inf_mass = _connect_dots(grid, log_d, log_rev)
            # Masses below 1e-200 go to +inf (pessimistic: a larger loss), which keeps subnormal
            # numbers, a hundred times slower to compute with, out of every later step.
            tiny = pmf < 1e-200
            if np.any(tiny):
                inf_mass += float(pmf[tiny].sum())
                pmf[tiny] = 0.0
            out = _make_leaf(lo_i, pmf, math.log1p(-inf_mass) if inf_mass < 1 else -math.inf, h)
        self._leaf_cache[key] = out
        return out

    def _compose_all(self) -> dict[Direction, _Composed]:
        """Both directions composed (FFT), as a plain dict."""
        lazy = self._compose_lazy()
        return {d: lazy[d] for d in ("remove", "add")}

    def _compose_lazy(self) -> _PerDirection:
        if self._composed is None:
            h = self._grid_h()
            counts = dict(self._counts)  # a direction composed later must see these counts
            self._composed = _PerDirection(lambda d: self._compose_direction(d, h, counts))
        return self._composed

    def _compose_direction(
        self, direction: Direction, h: float, counts: dict[Event, int] | None = None
    ) -> _Composed:
        parts = self._parts(direction, h, counts)
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
        g_suf = _discounted_suffix(pmf, h)
        d = np.empty(n)
        d[:-1] = a_suf[1:] - math.exp(-h) * g_suf[1:]
        d[-1] = 0.0
        delta_grid = np.maximum(d, 0.0) + extra
        return _Composed(h, start, pmf, inf_mass, tail + self._fft_floor, delta_grid, a_suf, g_suf)

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
                        spec *= ls if extra == 1 else _spectrum_power(ls, extra)
                self._fft_state[direction] = (h, s_n, s_start, ids, spec)
                return s_n, s_start, spec
        # A first query gets the window it needs. Rebuilds (online use) get a margin of a quarter of the
        # width on each side, so that the window stays valid while the composition grows.
        margin = 0.25 * (hi - lo) if st is not None else 0.0
        start = math.floor((lo - margin) / h)
        n = int(fft.next_fast_len(math.ceil((hi + margin) / h) - start + 1, real=True))
        if n > _MAX_FFT:
            raise InvalidParameter(
                f"the composed privacy loss spans {hi - lo:.3g} nats: too wide for the PLD grid h={h:g}; "
                "use a coarser value_discretization_interval or the 'rdp' accountant"
            )
        self._spec_cache.clear()
        spec = np.ones(n // 2 + 1, dtype=np.complex128)
        for p, c in parts:
            ls = self._leaf_spectrum(p, n)
            spec *= ls if c == 1 else _spectrum_power(ls, c)
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
        log_tau = math.log(self._tail_mass)
        var = math.fsum(c * p.var for p, c in parts)
        hi = _chernoff_end(parts, 1, log_tau, var)
        lo = -_chernoff_end(parts, -1, log_tau, var)
        hi = max(hi, mean + h)
        lo = min(lo, mean - h)
        return lo, hi, self._tail_mass
