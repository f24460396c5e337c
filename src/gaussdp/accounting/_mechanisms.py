"""Exact privacy profiles, loss ranges and RDP of the events beyond the (subsampled) Gaussian.

Every event here has a *symmetric* dominating pair ``(P, Q)`` (``T(P, Q) = T(Q, P)``): one pair
bounds every ordered pair of neighbours at every order ``alpha = e^eps >= 0``, so the accountants
compose it as it is (the PLD accountant uses the same discretisation in its "remove" and "add"
compositions). For such a pair the profile at negative epsilon follows from the one at positive
epsilon (``H_a(P||Q) = 1 - a + a H_{1/a}(Q||P)``, and ``H(Q||P) = H(P||Q)`` by symmetry):

    delta(-t) = 1 - e^{-t} (1 - delta(t)),   t >= 0,

so each profile below is written for epsilon >= 0 and extended by :func:`symmetric_log_delta`.

* :class:`LaplaceEvent`: ``delta(eps) = 1 - exp((eps - eps0)/2)`` on ``[-eps0, eps0]``,
  ``eps0 = sensitivity / scale`` (integrating ``(p - e^eps q)_+`` for the two Laplace densities;
  the same profile as dp_accounting's ``LaplacePrivacyLoss``).
* :class:`ReplaceOneSubsampledGaussianEvent`: the pair ``P = (1-q) N(0, s^2) + q N(-1, s^2)``,
  ``Q = (1-q) N(0, s^2) + q N(1, s^2)`` that dp_accounting's PLD uses for REPLACE_ONE with Poisson
  sampling (``AdditiveNoisePrivacyLoss``). It dominates the remove pair ``((1-q) N(0) + q N(1),
  N(0))`` and the add pair at every order (on ``{P > a Q}`` the difference is the reflected remove
  difference plus ``a q (N(0) - N(1)) >= 0``), and the tests check it against other replacements
  ``x -> x'`` in the plane; for general ``x, x'`` gaussdp relies on dp_accounting's analysis. Its
  likelihood ratio is decreasing, so ``delta(eps) = P(Z < z*) - e^eps Q(Z < z*)`` with ``z*`` the
  root of ``P(z) = e^eps Q(z)``, a quadratic in ``e^{z/s^2}`` solved in closed form.
* :class:`FixedBatchGaussianEvent`: sampling ``b`` of ``n`` without replacement, replace-one, noise
  ``s`` per clip norm, ``gamma = b/n``. Conditioning on the other sampled records and on the record
  that takes the slot when the changed one is not drawn (joint convexity of ``H_a``), each ordered
  pair of neighbours is ``A = (1-gamma) mu + gamma nu`` against ``B = (1-gamma) mu + gamma nu'`` with
  Gaussians ``mu, nu, nu'`` whose means are at most 2 clip norms apart. Advanced joint convexity
  (Balle, Barthe & Gaboardi 2018) gives, for ``a' = 1 + gamma (a-1) >= 1`` and ``beta = a'/a``,
  ``H_a'(A||B) = gamma H_a(nu || (1-beta) mu + beta nu') <= gamma H_a(N(2)||N(0)) = H_a'(R)`` with the
  "remove" pair ``R = ((1-gamma) N(0) + gamma N(2), N(0))``; below order 1 the identity above bounds
  it by ``R`` in the reverse order (Zhu, Dong & Wang 2022 state the same pairs). A dataset whose other
  records all equal the replacing one attains ``R``, so the profile is tight. No single *ordered*
  pair does both, so the composition uses the symmetrised pair whose profile is
  ``max(delta_R, delta_R-reversed)`` for epsilon >= 0: composing the two asymmetric pairs separately
  can under-report (Lebeda, Regehr, Kamath & Steinke 2024).
"""

from __future__ import annotations

import decimal
import functools
import math

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import special

from gaussdp.accounting._logmath import log1p_exp, log_excess
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.events import (
    DiscreteGaussianEvent,
    Event,
    FixedBatchGaussianEvent,
    LaplaceEvent,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
    ReplaceOneSubsampledGaussianEvent,
)
from gaussdp.errors import InvalidParameter

__all__ = [
    "PROFILE_LEAVES",
    "fixed_batch_gaussian_rdp",
    "laplace_rdp",
    "leaf_atom_scale",
    "leaf_log_delta",
    "leaf_loss_range",
    "leaf_mu2",
    "leaf_rdp",
    "symmetric_log_delta",
]

FloatArray = NDArray[np.float64]

#: Leaf events whose PLD the accountants build from the exact profile below.
PROFILE_LEAVES = (
    DiscreteGaussianEvent,
    ReplaceOneSubsampledGaussianEvent,
    FixedBatchGaussianEvent,
    LaplaceEvent,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
)


def symmetric_log_delta(log_delta_pos: FloatArray, eps: FloatArray) -> FloatArray:
    """log delta on all of ``eps`` from ``log_delta_pos`` = log delta(|eps|) of a symmetric pair."""
    out = np.array(log_delta_pos, dtype=np.float64)
    neg = eps < 0.0
    if np.any(neg):
        t = -eps[neg]
        # delta(-t) = 1 - exp(-t + log(1 - delta(t))), in log space.
        with np.errstate(divide="ignore"):
            log_1md = np.log(-np.expm1(np.minimum(out[neg], 0.0)))
            out[neg] = np.log(-np.expm1(np.minimum(-t + log_1md, 0.0)))
    return out


def _laplace_log_delta_pos(eps0: float, e: FloatArray) -> FloatArray:
    # delta(eps) = 1 - exp((eps - eps0)/2) for 0 <= eps <= eps0, 0 above (Koskela et al. 2020, 6.1).
    with np.errstate(divide="ignore"):
        return np.where(e < eps0, np.log(-np.expm1(np.minimum((e - eps0) / 2.0, 0.0))), -np.inf)


def _antipodal_log_delta_pos(sigma: float, q: float, e: FloatArray) -> FloatArray:
    # P = (1-q) N(0) + q N(-1), Q = (1-q) N(0) + q N(1), noise sigma; eps >= 0.
    # P(z) = a Q(z) with a = e^eps and u = e^{z/s^2}, c = e^{-1/(2 s^2)}:
    #   a q c u^2 + (1-q)(a-1) u - q c = 0,
    #   u = 2 q c / ((1-q)(a-1) + sqrt(((1-q)(a-1))^2 + 4 a q^2 c^2))
    # (the positive root, in the form without cancellation for a >= 1).
    s2 = sigma * sigma
    log_q, log1mq = math.log(q), math.log1p(-q)
    with np.errstate(divide="ignore", invalid="ignore"):
        la = log1mq + np.where(e > 0.0, e + np.log(-np.expm1(-np.maximum(e, 1e-300))), -np.inf)
        lb = math.log(2.0) + e / 2.0 + log_q - 0.5 / s2
        ls = 0.5 * np.logaddexp(2.0 * la, 2.0 * lb)
        log_u = math.log(2.0) + log_q - 0.5 / s2 - np.logaddexp(la, ls)
    z = s2 * log_u
    # delta = q Phi((z+1)/s) - [a q Phi((z-1)/s) + (a-1)(1-q) Phi(z/s)]
    log_a_term = log_q + special.log_ndtr((z + 1.0) / sigma)
    with np.errstate(divide="ignore"):
        log_b_term = np.logaddexp(
            e + log_q + special.log_ndtr((z - 1.0) / sigma), la + special.log_ndtr(z / sigma)
        )
    d = log_b_term - log_a_term
    with np.errstate(invalid="ignore", divide="ignore"):
        res = log_a_term + np.log(-np.expm1(np.minimum(d, 0.0)))
    return np.where((d < 0.0) & np.isfinite(log_a_term), res, -np.inf)


def _fixed_batch_log_delta_pos(sigma: float, gamma: float, e: FloatArray) -> FloatArray:
    # Shift 2 (a replacement moves the clipped sum by up to 2 clip norms) at noise sigma is shift 1 at
    # noise sigma / 2; both orders of the Zhu et al. (2022, Thm 11) pair, symmetrised by the max.
    s = sigma / 2.0
    r = subsampled_log_delta(s, gamma, e, "remove")
    if gamma >= 1.0:
        return r
    return np.maximum(r, subsampled_log_delta(s, gamma, e, "add"))


@functools.lru_cache(maxsize=256)
def _histogram_sums(leaf: PrivacyLossDistributionEvent) -> tuple[FloatArray, FloatArray, FloatArray, float]:
    order = np.argsort(leaf.losses)
    loss = np.asarray(leaf.losses)[order]
    p = np.asarray(leaf.probabilities)[order]
    a_suf = np.append(np.cumsum(p[::-1])[::-1], 0.0)  # sum_{i >= j} p_i
    # log sum_{i >= j} p_i e^{-l_i}, in log space: losses of hundreds of nats underflow e^{-l}
    with np.errstate(divide="ignore"):
        log_terms = np.log(p) - loss
    log_g_suf = np.append(np.logaddexp.accumulate(log_terms[::-1])[::-1], -np.inf)
    return loss, a_suf, log_g_suf, max(0.0, 1.0 - math.fsum(leaf.probabilities))


_DG_MAX_ATOMS = 4_000_000


@functools.lru_cache(maxsize=64)
def _discrete_gaussian_pld(leaf: DiscreteGaussianEvent) -> PrivacyLossDistributionEvent:
    # Exact PLD of N_Z(0, s^2) against N_Z(D, s^2) (Canonne, Kamath & Steinke 2020): at y the loss is
    # ((y - D)^2 - y^2) / (2 s^2) with probability exp(-y^2 / (2 s^2)) / Z. Atoms with |y| beyond
    # 9.7 s (total mass < 1e-20) are left out, i.e. moved to loss +infinity: pessimistic.
    s, d = leaf.sigma, leaf.sensitivity
    if s >= 1.0:
        # Poisson summation: Z = s sqrt(2 pi) sum_k exp(-2 pi^2 s^2 k^2), exactly.
        k = np.arange(1, 6, dtype=np.float64)
        log_z = math.log(s * math.sqrt(2.0 * math.pi)) + math.log1p(
            2.0 * float(np.sum(np.exp(-2.0 * math.pi**2 * s * s * k * k)))
        )
    else:
        y_all = np.arange(-60, 61, dtype=np.float64)
        log_z = float(special.logsumexp(-(y_all**2) / (2.0 * s * s)))
    t = math.ceil(s * math.sqrt(2.0 * math.log(1e20))) + 1
    if 2 * t + 1 > _DG_MAX_ATOMS:
        raise InvalidParameter(
            f"{leaf!r} has too many atoms for an exact PLD; use its concentrated-DP bound "
            "(the 'rdp' accountant)"
        )
    y = np.arange(-t, t + 1, dtype=np.float64)
    p = np.exp(-(y**2) / (2.0 * s * s) - log_z)
    keep = p > 0.0
    losses = (d * d - 2.0 * y[keep] * d) / (2.0 * s * s)
    return PrivacyLossDistributionEvent(tuple(losses.tolist()), tuple(p[keep].tolist()))


def _histogram_log_delta(leaf: PrivacyLossDistributionEvent, e: FloatArray) -> FloatArray:
    # delta(eps) = sum_{l_i > eps} p_i (1 - e^{eps - l_i}) + p_inf, from suffix sums over sorted losses.
    loss, a_suf, log_g_suf, p_inf = _histogram_sums(leaf)
    j = np.searchsorted(loss, e, side="right")
    # e^eps sum_{l_i > eps} p_i e^{-l_i} <= sum_{l_i > eps} p_i: formed as one exponential (no overflow)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        d = a_suf[j] - np.exp(np.minimum(e + log_g_suf[j], 0.0)) + p_inf
        return np.log(np.maximum(d, 0.0))


@functools.lru_cache(maxsize=256)
def _profile_hull(leaf: PrivacyProfileEvent) -> tuple[FloatArray, FloatArray]:
    # Vertices of the least private profile with delta(eps_i) <= delta_i: the lower convex hull, in
    # (y = e^eps, delta), of (0, 1), the points, and their mirrors (the KOV pair of each point has
    # a profile through exactly those vertices; the max of trade-off functions is the convex
    # envelope of the min of profiles). Points implied by a smaller-epsilon point are dropped first.
    pts = sorted(zip(leaf.epsilons, leaf.deltas, strict=True))
    kept: list[tuple[float, float]] = []
    for eps, d in pts:
        if not kept or d < kept[-1][1]:
            kept.append((eps, d))
    xy = {(0.0, 1.0)}
    for eps, d in kept:
        xy.add((math.exp(eps), d))
        xy.add((math.exp(-eps), -math.expm1(-eps + math.log1p(-d))))
    hull: list[tuple[float, float]] = []
    for x, y in sorted(xy):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0.0:  # hull[-1] not below the chord
                hull.pop()
            else:
                break
        hull.append((x, y))
    return np.asarray([x for x, _ in hull]), np.asarray([y for _, y in hull])


def _profile_log_delta(leaf: PrivacyProfileEvent, e: FloatArray) -> FloatArray:
    hx, hy = _profile_hull(leaf)
    d = np.interp(np.exp(np.minimum(e, 700.0)), hx, hy, right=hy[-1])
    with np.errstate(divide="ignore"):
        out: FloatArray = np.log(np.maximum(d, 0.0))
    return out


def leaf_log_delta(leaf: Event, eps: ArrayLike) -> FloatArray:
    """Exact log delta(eps) of one release of ``leaf`` (a :data:`PROFILE_LEAVES` event), all real eps."""
    e = np.atleast_1d(np.asarray(eps, dtype=np.float64))
    if isinstance(leaf, PrivacyLossDistributionEvent):
        return _histogram_log_delta(leaf, e)
    if isinstance(leaf, PrivacyProfileEvent):
        return _profile_log_delta(leaf, e)
    if isinstance(leaf, DiscreteGaussianEvent):
        return _histogram_log_delta(_discrete_gaussian_pld(leaf), e)
    a = np.abs(e)
    if isinstance(leaf, LaplaceEvent):
        pos = _laplace_log_delta_pos(leaf.epsilon, a)
    elif isinstance(leaf, ReplaceOneSubsampledGaussianEvent):
        if leaf.sample_rate >= 1.0:  # N(-1) against N(1): a Gaussian with mu = 2 / sigma
            pos = subsampled_log_delta(leaf.noise_multiplier / 2.0, 1.0, a, "remove")
        else:
            pos = _antipodal_log_delta_pos(leaf.noise_multiplier, leaf.sample_rate, a)
    elif isinstance(leaf, FixedBatchGaussianEvent):
        pos = _fixed_batch_log_delta_pos(leaf.noise_multiplier, leaf.sample_rate, a)
    else:
        raise TypeError(f"no exact profile for {leaf!r}")
    return symmetric_log_delta(pos, e)


def leaf_loss_range(leaf: Event, tail: float) -> tuple[float, float]:
    """``[lo, hi]`` holding the privacy loss of ``leaf`` but for mass at most ``tail`` on each side.

    Mass above ``hi`` is moved to +infinity by the discretisation and mass below ``lo`` only enters
    through the chord to ``(e^eps = 0, delta = 1)``: both are upper bounds.
    """
    if isinstance(leaf, LaplaceEvent):
        return -leaf.epsilon, leaf.epsilon
    if isinstance(leaf, PrivacyLossDistributionEvent):
        return min(leaf.losses) - 1e-9, max(leaf.losses) + 1e-9
    if isinstance(leaf, PrivacyProfileEvent):
        m = max(leaf.epsilons) + 1e-9
        return -m, m
    if isinstance(leaf, DiscreteGaussianEvent):
        return leaf_loss_range(_discrete_gaussian_pld(leaf), tail)
    z = float(-special.ndtri(tail))
    if isinstance(leaf, ReplaceOneSubsampledGaussianEvent):
        s, q, shift = leaf.noise_multiplier, leaf.sample_rate, 1.0
    elif isinstance(leaf, FixedBatchGaussianEvent):
        s, q, shift = leaf.noise_multiplier, leaf.sample_rate, 2.0
    else:
        raise TypeError(f"no loss range for {leaf!r}")
    # The sampled component's likelihood ratio against the rest, at z noise standard deviations
    # into the tail: an upper end for both pairs (a replacement moves the mean by 2 * shift / 2).
    x = (2.0 * shift * (shift + z * s) - shift * shift) / (2.0 * s * s)
    if q >= 1.0:
        hi = 2.0 / (s * s) + 2.0 * z / s  # N(-1) vs N(1), or N(2) vs N(0): a Gaussian of mu = 2/s
    else:
        hi = float(np.logaddexp(math.log1p(-q), math.log(q) + x)) - math.log1p(-q)
    hi = max(hi, 1e-9)
    return -hi, hi


def leaf_mu2(leaf: Event) -> float:
    """A scale of one release's privacy loss (the CLT mu^2 of Bu et al. 2020), for grid sizing only."""
    if isinstance(leaf, LaplaceEvent):
        return leaf.epsilon**2
    if isinstance(leaf, PrivacyLossDistributionEvent):
        return math.fsum(p * v * v for v, p in zip(leaf.losses, leaf.probabilities, strict=True))
    if isinstance(leaf, PrivacyProfileEvent):
        return max(leaf.epsilons) ** 2
    if isinstance(leaf, DiscreteGaussianEvent):
        return (leaf.sensitivity / leaf.sigma) ** 2
    q: float
    s: float
    q, s = leaf.sample_rate, leaf.noise_multiplier  # type: ignore[attr-defined]
    if isinstance(leaf, ReplaceOneSubsampledGaussianEvent):
        # Var_{N(0)} of (phi(z+1) - phi(z-1)) / phi(z) = 2 (e^{1/s^2} - e^{-1/s^2})
        return 2.0 * q * q * (math.exp(min(1.0 / (s * s), 700.0)) - math.exp(-1.0 / (s * s)))
    if isinstance(leaf, FixedBatchGaussianEvent):
        return q * q * math.expm1(min(4.0 / (s * s), 700.0))  # a shift of 2 clip norms
    raise TypeError(f"no loss scale for {leaf!r}")


def leaf_atom_scale(leaf: Event) -> float:
    """The largest |loss| of a PLD with atoms the grid must resolve (inf for other events).

    Laplace's privacy loss has atoms of mass about 1/2 at +-epsilon; a discrete Gaussian's loss is
    atomic (the atom spacing is returned where it is coarse); user-supplied PLDs and profiles are
    atomic.
    """
    if isinstance(leaf, LaplaceEvent):
        return leaf.epsilon or math.inf
    if isinstance(leaf, DiscreteGaussianEvent) and leaf.sigma <= 4.0:
        # losses (2 k D - D^2) / (2 sigma^2) on integers k: atoms D / sigma^2 apart, which is
        # 1 / sigma of the loss's spread D / sigma; above sigma = 4 they blend like a continuum
        return leaf.sensitivity / leaf.sigma**2
    if isinstance(leaf, PrivacyLossDistributionEvent):
        return max(abs(v) for v in leaf.losses) or math.inf
    if isinstance(leaf, PrivacyProfileEvent):
        return max(leaf.epsilons) or math.inf
    return math.inf


# ----- RDP -------------------------------------------------------------------------------------


def laplace_rdp(epsilon: float, orders: ArrayLike) -> FloatArray:
    """Exact RDP of the Laplace mechanism with pure epsilon ``epsilon`` (Mironov 2017, Proposition 6).

    ``D_a = eps + log(1 + (a-1)/(2a-1) (e^{-(2a-1) eps} - 1)) / (a-1)`` for orders ``a > 1``.

    >>> round(float(laplace_rdp(1.0, [2.0])[0]), 6)   # log(2/3 e + 1/3 e^-2)
    0.619124
    """
    a = np.asarray(orders, dtype=np.float64)
    x = (a - 1.0) / (2.0 * a - 1.0) * np.expm1(-(2.0 * a - 1.0) * epsilon)
    # epsilon + log1p(x) / (a - 1) cancels for small epsilon (the result is about a epsilon^2 / 2):
    # its rounding error, a few ulps of epsilon, is added so that the value is never below D_a.
    out: FloatArray = epsilon + np.log1p(x) / (a - 1.0) + 8.0 * 2.0**-52 * epsilon
    return out


_DIFF_MAX = 258  # forward differences up to this order cover every integer order <= 256
_DIFF_DIGITS = 400  # most decimal digits of cancellation the forward differences may cost


@functools.lru_cache(maxsize=64)
def _log_forward_diffs(sigma: float) -> tuple[float, ...]:
    # log Delta^k f(-1) for even k <= _DIFF_MAX (NaN at odd k, which Theorem 27 does not use), for
    # f(x) = exp(x (x+1) / (2 sigma^2)) (the Gaussian's exp-CGF at order x+1). Delta^k f(-1) is a
    # B-spline average of the k-th derivative of f = exp(c (x + 1/2)^2 - c/4), positive for even k (a
    # power series in (x + 1/2)^2 with positive coefficients). They are computed from their binomial
    # sums in decimal arithmetic, with the working precision raised
    # until it exceeds the cancellation (log10 of the largest term over the result) by 30 digits:
    # no floating-point differences that could cancel to a too-small value.
    # Bounded work: the cancellation grows like (k / 2) log10(2 sigma^2) digits; orders whose
    # difference would need more than _DIFF_DIGITS digits are not computed (+inf: the other argument
    # of Theorem 27's min alone bounds them, a valid if looser bound).
    per_order = max(1.0, 0.5 * math.log10(max(2.0 * sigma * sigma, 10.0)))
    n = min(_DIFF_MAX, 2 * int(_DIFF_DIGITS / per_order / 2))
    prec = 60 + int(n * math.log10(2.0))
    for _ in range(20):
        ctx = decimal.Context(prec=prec, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
        two_s2 = ctx.multiply(2, ctx.power(decimal.Decimal(sigma), 2))
        f = [ctx.exp(ctx.divide(decimal.Decimal((i - 1) * i), two_s2)) for i in range(n + 1)]
        out: list[float] = []
        need = 0.0
        for k in range(n + 1):
            if k % 2:
                out.append(math.nan)
                continue
            acc = decimal.Decimal(0)
            for i in range(k + 1):
                term = ctx.multiply(math.comb(k, i), f[i])
                acc = ctx.add(acc, term) if (k - i) % 2 == 0 else ctx.subtract(acc, term)
            if acc <= 0:
                need = math.inf
                break
            biggest = ctx.multiply(math.comb(k, k // 2), f[k]).log10(ctx)
            need = max(need, float(biggest - acc.log10(ctx)) + 30.0)
            out.append(float(acc.ln(ctx)))
        if need <= prec:
            return tuple(out) + (math.inf,) * (_DIFF_MAX - n)
        prec = 2 * prec if not math.isfinite(need) else int(need) + 30
    raise ArithmeticError(f"forward differences did not converge for sigma={sigma!r}")


def _wor_log_a_int(gamma: float, sigma: float, alpha: int) -> float:
    # Wang, Balle & Kasiviswanathan 2019 (arXiv 1808.00087), Theorem 27: for the Gaussian mechanism
    # with RDP eps(j) = j / (2 sigma^2) under replace-one, subsampled without replacement at rate gamma,
    #   (alpha-1) eps'(alpha) <= log(1 + gamma^2 C(alpha,2) min(4 (e^{eps(2)} - 1), 2 e^{eps(2)})
    #       + sum_{j>=3} gamma^j C(alpha,j) min(4 sqrt(D^{2 floor(j/2)} D^{2 ceil(j/2)}), 2 e^{(j-1) eps(j)}))
    # with D^k the k-th forward difference of e^{x eps(x+1)} (above 256 only the second argument of
    # each min, Theorem 9's bound, as dp_accounting does).
    if alpha <= 1:
        return 0.0
    eps2 = 2.0 / (2.0 * sigma * sigma)
    log_gamma = math.log(gamma)
    terms = [0.0]
    log_f2m1 = eps2 + math.log(-math.expm1(-eps2))
    terms.append(2 * log_gamma + _log_comb(alpha, 2) + min(math.log(4.0) + log_f2m1, eps2 + math.log(2.0)))
    j = np.arange(3, alpha + 1, dtype=np.float64)
    cgf = (j - 1.0) * j / (2.0 * sigma * sigma)  # (j-1) eps(j)
    second = math.log(2.0) + cgf
    if alpha <= 256:
        d = np.asarray(_log_forward_diffs(float(sigma)))
        ji = j.astype(np.int64)
        first = math.log(4.0) + 0.5 * (d[2 * (ji // 2)] + d[2 * ((ji + 1) // 2)])
        second = np.minimum(first, second)
    log_comb = special.gammaln(alpha + 1.0) - special.gammaln(j + 1.0) - special.gammaln(alpha - j + 1.0)
    terms.extend((second + j * log_gamma + log_comb).tolist())
    # log(1 + S) with S = sum of the positive terms after the leading 1: log1p, never 1 + S (which
    # rounds S away below 1e-16, a zero RDP claiming delta = 0)
    return log1p_exp(float(special.logsumexp(terms[1:])))


def _log_comb(n: int, k: int) -> float:
    return float(special.gammaln(n + 1.0) - special.gammaln(k + 1.0) - special.gammaln(n - k + 1.0))


@functools.lru_cache(maxsize=256)
def _fixed_batch_rdp_cached(sigma: float, gamma: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    out = []
    for a in orders:
        if gamma >= 1.0:
            out.append(a / (2.0 * sigma * sigma))
        elif float(a).is_integer():
            out.append(_wor_log_a_int(gamma, sigma, int(a)) / (a - 1.0))
        else:
            # WBK 2019, Corollary 10: the CGF (a-1) eps'(a) is convex in a, so the chord between the
            # neighbouring integers bounds it.
            lo, hi = math.floor(a), math.ceil(a)
            t = a - lo
            x, y = _wor_log_a_int(gamma, sigma, lo), _wor_log_a_int(gamma, sigma, hi)
            out.append(((1.0 - t) * x + t * y) / (a - 1.0))
    return tuple(max(0.0, v) for v in out)


def fixed_batch_gaussian_rdp(
    noise_multiplier: float, batch_size: int, dataset_size: int, orders: ArrayLike
) -> FloatArray:
    """RDP of one :class:`FixedBatchGaussianEvent` at each order (WBK 2019, Theorem 27 / Cor. 10).

    The Gaussian's replace-one RDP is ``a / (2 (noise_multiplier / 2)^2)``: a replacement moves the
    clipped sum by up to twice the clip norm.
    """
    orders_t = tuple(float(a) for a in np.atleast_1d(np.asarray(orders, dtype=np.float64)))
    return np.asarray(
        _fixed_batch_rdp_cached(float(noise_multiplier) / 2.0, batch_size / dataset_size, orders_t)
    )


# Most trapezoid points one order of the replace-one RDP may cost (bounded work per event).
_RDP_POINTS_MAX = 200_000


@functools.lru_cache(maxsize=256)
def _replace_one_rdp_cached(sigma: float, q: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    # D_a(P||Q) for P = (1-q) N(0) + q N(-1), Q = (1-q) N(0) + q N(1) (noise sigma); the pair is
    # symmetric, so this is the RDP of both orders of neighbours. With P/Q = 1 + r and E_Q[r] = 0,
    # A_a - 1 = E_Q[(1 + r)^a - 1 - a r], an integrand >= 0 (convexity) evaluated in log space without
    # cancellation (_logmath.log_excess): summing A_a itself loses A_a - 1 to rounding once it is below
    # 1e-16 (a large sigma or a tiny q) and an RDP of 0 claims delta = 0. The integrand is analytic
    # with Gaussian tails: the trapezoid rule on a grid of step sigma / 40 is accurate to rounding (as
    # for rdp._log_a_frac), checked against mpmath in the tests. Its mass sits near 0 and, for the
    # sampled component, near z = -a (the peak of P^a Q^(1-a)): the grid covers both. An order whose
    # grid would exceed _RDP_POINTS_MAX points is left out (inf): the minimum over the other orders
    # is still a bound.
    if q >= 1.0:
        return tuple(a * 2.0 / (sigma * sigma) for a in orders)  # N(-1) vs N(1): a 2^2 / (2 sigma^2)
    out = []
    log1mq, log_q = math.log1p(-q), math.log(q)
    s2 = sigma * sigma
    for a in orders:
        half = 40.0 * sigma + max(a, 2.0 * a / s2) + 2.0
        n = math.ceil(2.0 * half / (sigma / 40.0)) + 1
        if n > _RDP_POINTS_MAX:
            out.append(math.inf)
            continue
        z = np.linspace(-half, half, n)
        step = 2.0 * half / (n - 1)
        u = (-2.0 * z - 1.0) / (2.0 * s2)  # log N(z; -1) / N(z; 0)
        v = (2.0 * z - 1.0) / (2.0 * s2)  # log N(z; +1) / N(z; 0)
        log_q_mix = np.logaddexp(log1mq, log_q + v)  # log Q(z) / N(z; 0)
        log1p_r = np.logaddexp(log1mq, log_q + u) - log_q_mix  # log P/Q
        w = u - v  # r = expm1(w) * s, s = q e^v / ((1-q) + q e^v)
        log_s = -np.logaddexp(0.0, -(log_q - log1mq + v))
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            r = np.expm1(np.minimum(w, 700.0)) * np.exp(log_s)
            log_r = w + np.log(-np.expm1(-w)) + log_s  # read only where w > 0
        log_n0 = -(z * z) / (2.0 * s2) - math.log(sigma * math.sqrt(2.0 * math.pi))
        log_f = log_n0 + log_q_mix + log_excess(r, log_r, log1p_r, a)
        log_int = float(special.logsumexp(log_f) + math.log(step))
        out.append(log1p_exp(log_int) / (a - 1.0) if math.isfinite(log_int) else math.inf)
    return tuple(max(0.0, v) for v in out)


def leaf_rdp(leaf: Event, orders: FloatArray) -> FloatArray | None:
    """RDP of one release of ``leaf`` at ``orders``, or ``None`` where gaussdp has no RDP bound for it."""
    if isinstance(leaf, LaplaceEvent):
        return laplace_rdp(leaf.epsilon, orders)
    if isinstance(leaf, FixedBatchGaussianEvent):
        return fixed_batch_gaussian_rdp(leaf.noise_multiplier, leaf.batch_size, leaf.dataset_size, orders)
    if isinstance(leaf, ReplaceOneSubsampledGaussianEvent):
        o = tuple(float(a) for a in np.atleast_1d(orders))
        return np.asarray(_replace_one_rdp_cached(leaf.noise_multiplier, leaf.sample_rate, o))
    if isinstance(leaf, DiscreteGaussianEvent):
        # (D/s)^2 / 2-concentrated DP (Canonne, Kamath & Steinke 2020): D_a <= a D^2 / (2 s^2).
        out: FloatArray = np.asarray(orders, dtype=np.float64) * leaf.sensitivity**2 / (2.0 * leaf.sigma**2)
        return out
    return None
