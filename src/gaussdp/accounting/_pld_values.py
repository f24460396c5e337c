"""The PLD accountant's value objects: discrete PLDs, their compositions, and connect-the-dots.

A :class:`LeafPMF` is one event's discrete privacy loss distribution on the grid ``h`` (built by
:func:`connect_dots` from the event's exact privacy profile, Doroshenko et al. 2022, Section 3); a
:class:`Composed` is a composition on a window of the grid with its delta profile; a :class:`Stepped`
is a composition followed by a few more steps of one event (:class:`MFold`), never materialised.
The ladder of Chernoff exponents (:data:`LAMBDAS`) lives here because each leaf caches its moment
generating function on it. Nothing here chooses a grid or runs an FFT (see
:mod:`gaussdp.accounting._pld_grid` and :mod:`gaussdp.accounting._pld_fft`).

References:
    Doroshenko, V., Ghazi, B., Kamath, P., Kumar, R. & Manurangsi, P. (2022). Connect the Dots:
    Tighter Discrete Approximations of Privacy Loss Distributions. PETS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from gaussdp.errors import NumericalFault

FloatArray = NDArray[np.float64]


def discounted_suffix(p: FloatArray, h: float) -> FloatArray:
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

#: The longest grid (points) any leaf or composition may span.
MAX_FFT = 1 << 24


@dataclass(frozen=True)
class LeafPMF:
    """A discrete PLD: mass ``pmf[j]`` at loss ``(start + j) * h``; the rest of the mass is at +inf."""

    start: int
    pmf: FloatArray
    log_finite_mass: float
    mean: float  # of the normalised finite part, in nats
    var: float
    x: FloatArray  # losses (nats) of the entries with positive mass
    log_w: FloatArray  # log of their normalised mass
    mass_excess: float  # total mass minus 1: floating-point rounding of the discretisation
    # log E[e^{+-lam L}] of the normalised finite part at LAMBDAS[i], computed only where asked
    # (a window needs a few exponents near its Chernoff optimum, not all of them).
    mgf_memo: dict[tuple[int, int], float] = field(default_factory=dict, compare=False)

    def log_mgf(self, idx: NDArray[np.intp], sign: int) -> FloatArray:
        """log E[e^{sign lam L}] at ``lam = LAMBDAS[idx]``, exact for this discrete PLD."""
        missing = [int(i) for i in idx if (int(i), sign) not in self.mgf_memo]
        if missing:
            lam = LAMBDAS[missing]
            a = self.log_w[None, :] + sign * lam[:, None] * self.x[None, :]
            amax = a.max(axis=1)
            vals = np.log(np.exp(a - amax[:, None]).sum(axis=1)) + amax
            for i, v in zip(missing, vals, strict=True):
                self.mgf_memo[(i, sign)] = float(v)
        return np.array([self.mgf_memo[(int(i), sign)] for i in idx])


# Chernoff exponents for the window: a fixed ladder, so that each event's MGF values are cached and
# shared across queries; each window evaluates only the rungs near its optimum (lambda_rungs).
LAMBDAS = np.geomspace(1e-2, 1e7, 60)


def lambda_rungs(var_total: float, log_inv_tau: float) -> NDArray[np.intp]:
    # For a Gaussian of variance V the Chernoff optimum for a tail of mass tau is sqrt(2 log(1/tau)/V);
    # heavier (subsampled) tails have their optimum below it. Any rung gives a valid bound: the range
    # only decides how tight the window is.
    lam_star = math.sqrt(2.0 * log_inv_tau / max(var_total, 1e-300))
    ok = np.nonzero((LAMBDAS >= lam_star / 1000.0) & (LAMBDAS <= lam_star * 4.0))[0]
    if len(ok) < 4:
        near = int(np.argmin(np.abs(np.log(LAMBDAS / lam_star))))
        ok = np.arange(max(0, near - 3), min(len(LAMBDAS), near + 4))
    return ok


def chernoff_end(parts: list[tuple[LeafPMF, int]], sign: int, log_tau: float, var: float) -> float:
    """min over the rungs lam of (sum_k c_k log M_k(sign lam) - log tau) / lam: a Chernoff end point.

    Every rung gives a valid bound (P(sign S > t) <= tau at that t), so a local search from the
    Gaussian optimum, which evaluates the moment generating functions at a few rungs only, is safe.
    """

    def f(i: int) -> float:
        idx = np.array([i])
        total = math.fsum(c * float(p.log_mgf(idx, sign)[0]) for p, c in parts)
        return (total - log_tau) / float(LAMBDAS[i])

    return rung_search(f, var, -log_tau)


def rung_search(f: Callable[[int], float], var: float, log_inv_tau: float) -> float:
    """A local minimum over rung indices of ``f``, from the Gaussian-optimal rung for a tail of mass
    tau and variance var: strides of 4 rungs while it improves (down first, else up), then a refine.
    Any rung's value is a valid bound; the search only makes it tight."""
    lam_star = math.sqrt(2.0 * log_inv_tau / max(var, 1e-300))
    last = len(LAMBDAS) - 1
    memo: dict[int, float] = {}

    def g(j: int) -> float:
        j = min(last, max(0, j))
        if j not in memo:
            memo[j] = f(j)
        return memo[j]

    best_i = int(np.clip(np.searchsorted(LAMBDAS, lam_star), 0, last))
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


def make_leaf(start: int, pmf: FloatArray, log_finite_mass: float, h: float) -> LeafPMF:
    nz = np.nonzero(pmf > 0.0)[0]
    x = (start + nz).astype(np.float64) * h
    w = pmf[nz] / pmf[nz].sum()
    m = float(np.einsum("i,i->", w, x))  # einsum, not np.dot: no BLAS threads to wake (see _conv)
    v = float(np.einsum("i,i->", w, (x - m) ** 2))
    excess = float(np.sum(pmf)) - math.exp(log_finite_mass) if math.isfinite(log_finite_mass) else 0.0
    return LeafPMF(start, pmf, log_finite_mass, m, v, x, np.log(w), excess)


@dataclass(frozen=True)
class Composed:
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
            raise BelowFloor
        j = int(ok[0])
        eps_j = (self.start + j) * self.h
        if j == 0:
            return eps_j
        a = self.inf_mass + self.tail + float(self.a_suf[j])
        return solve_between(eps_j - self.h, eps_j, a, float(self.g_suf[j]), delta)


def solve_between(eps_lo: float, eps_j: float, a: float, g: float, delta: float) -> float:
    """Smallest eps in [eps_lo, eps_j] with a - e^{eps - eps_j} g <= delta, rounded up.

    ``eps_lo`` and ``eps_j`` are consecutive grid points. Between two grid points the profile of a
    discrete PLD is exactly ``A - e^eps G`` (the set of losses above eps does not change), so the
    crossing has a closed form; ``a`` and ``g`` are the suffix sums A and G at ``eps_j`` (allowances
    included in ``a``).
    """
    if g > 0.0 and a - delta > 0.0 and math.isfinite(a) and math.isfinite(g):
        eps = eps_j + math.log((a - delta) / g)
        eps = min(eps_j, max(eps_lo, eps))
        return eps + 1e-12 * max(1.0, abs(eps))
    return eps_j


def delta_profile(pmf: FloatArray, h: float, extra: float) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The suffix sums ``A``, ``G`` of a discrete PLD on a window and its delta at each grid point.

    delta at grid point j is ``sum_{i>j} p_i (1 - e^{-(i-j)h}) = A_{j+1} - e^{-h} G_{j+1}`` with
    ``A_j = sum_{i>=j} p_i`` and ``G_j = sum_{i>=j} p_i e^{-(i-j)h}`` (a first-order recurrence);
    ``extra`` (mass at +inf and allowances) is added to every point. Returns ``(A, G, delta)``.
    """
    a_suf = np.cumsum(pmf[::-1])[::-1]
    g_suf = discounted_suffix(pmf, h)
    d = np.empty(len(pmf))
    d[:-1] = a_suf[1:] - math.exp(-h) * g_suf[1:]
    d[-1] = 0.0
    return a_suf, g_suf, np.maximum(d, 0.0) + extra


@dataclass(frozen=True)
class MFold:
    """``m`` steps of one event as a discrete PLD on its own window (for online composition)."""

    start: int
    pmf: FloatArray
    cum: FloatArray  # cum[t] = sum of pmf[:t]
    g: FloatArray  # g[t] = sum_{t' >= t} pmf[t'] e^{-(t' - t) h}
    extra: float  # mass at +inf, Chernoff tail above the window, FFT allowance
    rev: FloatArray  # pmf[::-1], contiguous


@dataclass(frozen=True)
class Stepped:
    """A composed PLD (a checkpoint) followed by ``m`` more steps of one event, never materialised.

    Delta, the suffix mass A and the discounted suffix G of a composition are all convolutions of
    the checkpoint's with the added steps' PMF (``delta_{S+T}(x) = sum_t w_t delta_S(x - t)``), so a
    query evaluates them at a few grid points with dot products of the added steps' PMF against the
    checkpoint's arrays: O(width of m steps) per point instead of an FFT of the whole window. Outside
    the checkpoint's window the bounds used are pessimistic: delta and A are 1 (plus allowances)
    below it and the allowances above it; G (subtracted) is 0 outside.
    """

    base: Composed
    more: MFold

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
            raise BelowFloor
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
        return solve_between(hi_j * h - h, hi_j * h, a, g, delta)


class PerDirection(dict[Direction, Any]):  # values: Composed, or Stepped on a checkpoint
    """direction -> composed PLD, each computed on first use (a certified direction never is)."""

    def __init__(self, make: Callable[[Direction], Composed | Stepped]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, direction: Direction) -> Composed | Stepped:
        value = self._make(direction)
        self[direction] = value
        return value


# Relative allowance on the exact one-step delta for floating-point error: against 50-digit mpmath
_COARSE = 32  # stride of the first, coarse pass over a wide leaf
_NEGLIGIBLE = 1e-30  # per-step mass left on the coarse points


def profile_points(
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
    pmf_c, _ = connect_dots(eps_c, log_delta(eps_c))
    heavy = pmf_c > _NEGLIGIBLE
    # coarse interval i = [coarse[i], coarse[i + 1]] is refined when either end carries mass
    dense = heavy[:-1] | heavy[1:]
    interval = np.minimum(np.arange(n) // _COARSE, len(dense) - 1)
    keep = dense[interval]
    keep[coarse - lo_i] = True
    return np.nonzero(keep)[0] + lo_i


class BelowFloor(Exception):
    """The asked delta is below what this discrete PLD can resolve."""


def connect_dots(
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
