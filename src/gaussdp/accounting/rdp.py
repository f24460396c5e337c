"""Renyi differential privacy accountant (Mironov 2017) with the subsampled Gaussian of MTZ 2019.

Per order alpha, the RDP of a composition is the sum of the RDPs of its releases (Mironov 2017,
Proposition 1). Under add/remove of one record:

* Gaussian, noise multiplier sigma: ``alpha / (2 sigma^2)`` (Mironov 2017, Proposition 7).
* Poisson-subsampled Gaussian: ``log(A_alpha) / (alpha - 1)`` with ``A_alpha`` the exact expression
  of Mironov, Talwar & Zhang 2019: a finite binomial sum for integer alpha (Section 3.2) and the
  two convergent series for fractional alpha (Section 3.3); ``D_alpha(mixture || N(0))`` dominates
  the other direction for alpha >= 1 (their Theorem 5).
* (epsilon, 0)-DP: ``min(epsilon, alpha epsilon^2 / 2)`` (Bun & Steinke 2016, Proposition 3.3).

RDP -> (epsilon, delta): ``eps = rdp + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1)``
(Canonne, Kamath & Steinke 2020, Proposition 12 of arXiv 2004.00010 v4; Balle et al. 2020,
Theorem 21), minimised over a dense grid of orders from 1.005 to 10000 (not capped at 63).

Plain Gaussian compositions bypass RDP and use the exact GDP closed form mu = sqrt(sum 1/sigma_i^2),
which RDP can only approximate from above.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numpy.typing import NDArray
from scipy import special

from gaussdp.accounting._logmath import log1p_exp, log_excess
from gaussdp.accounting._mechanisms import leaf_rdp
from gaussdp.accounting.base import Accountant
from gaussdp.accounting.events import (
    DiscreteGaussianEvent,
    EpsilonDeltaEvent,
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    ReplaceOneSubsampledGaussianEvent,
    SubsampledGaussianEvent,
)
from gaussdp.calibration import delta_for_mu, epsilon_for_mu
from gaussdp.errors import InvalidParameter

__all__ = ["DEFAULT_ORDERS", "RDPAccountant", "subsampled_gaussian_rdp"]

FloatArray = NDArray[np.float64]

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    sorted(
        {
            *np.round(1.0 + np.geomspace(0.005, 0.05, 12), 6).tolist(),
            *np.round(np.arange(1.05, 12.0, 0.05), 6).tolist(),
            *range(12, 64),
            *np.unique(np.round(np.geomspace(64, 10000, 40))).tolist(),
            128,
            256,
            512,
            1024,
        }
    )
)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    # A_alpha = sum_k C(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2))   (MTZ 2019, Sec 3.2).
    # The binomial weights sum to 1, so A_alpha - 1 = sum_{k>=2} C(alpha, k) (1-q)^(alpha-k) q^k
    # expm1((k^2 - k) / (2 sigma^2)): every term is >= 0 and nothing cancels. Summing A_alpha itself
    # loses A_alpha - 1 to rounding once it is below ~1e-16 (q/sigma <= ~1e-7), and a zero RDP then
    # claims delta = 0.
    if alpha < 2:
        return 0.0
    k = np.arange(2, alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1.0) - special.gammaln(k + 1.0) - special.gammaln(alpha - k + 1.0)
    y = (k * k - k) / (2 * sigma**2)
    log_gain = y + np.log(-np.expm1(-y))  # log(expm1(y)), also where expm1(y) overflows
    log_terms = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q) + log_gain
    return log1p_exp(float(special.logsumexp(log_terms)))


def _log_excess(q: float, z: FloatArray, alpha: float) -> FloatArray:
    """log((1 + r)^alpha - 1 - alpha r) for r = q expm1(z) > -1 (see ``_logmath.log_excess``)."""
    with np.errstate(over="ignore"):
        r = q * np.expm1(np.minimum(z, 700.0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_r = math.log(q) + z + np.log(-np.expm1(-z))  # read only where z > 0 (r > 0)
    log1p_r = np.logaddexp(math.log1p(-q), math.log(q) + z)  # log(1 + r)
    return log_excess(r, log_r, log1p_r, alpha)


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    # A_alpha = E_{x ~ N(0, sigma^2)} [(1 + r(x))^alpha], r(x) = q (exp((2x - 1) / (2 sigma^2)) - 1),
    # the definition that MTZ 2019 (Section 3.3) expand into two series. Those series converge only
    # polynomially when q is not small (dp_accounting drops such orders); the integrand is analytic
    # and decays like a Gaussian, so the trapezoid rule on a wide grid is accurate to rounding (its
    # error is exponentially small in 1/step), checked against the series and quadrature in the
    # tests. E[r] = 0, so A_alpha - 1 = E[(1 + r)^alpha - 1 - alpha r], whose integrand is >= 0
    # (convexity): integrating that excess keeps it accurate when it is far below 1e-16.
    lo, hi = -40.0 * sigma, max(alpha, 1.0) + 40.0 * sigma
    n = math.ceil((hi - lo) / (sigma / 40.0)) + 1
    if n > _FRAC_POINTS_MAX:
        # Bounded work: the grid needs ~480 / sigma points (0.5 s per order at sigma = 1e-3). An order
        # left out only removes a candidate from the minimum over orders: the bound stays valid, and at
        # such small noise the integer orders (a finite sum) carry it.
        return math.inf
    x = np.linspace(lo, hi, n)
    step = (hi - lo) / (n - 1)
    z = (2.0 * x - 1.0) / (2.0 * sigma**2)
    log_density = -(x * x) / (2.0 * sigma**2) - math.log(sigma * math.sqrt(2.0 * math.pi))
    log_f = log_density + _log_excess(q, z, alpha)
    return log1p_exp(float(special.logsumexp(log_f) + math.log(step)))


# Most trapezoid points one fractional order may cost (sigma >= about 2.4e-3 at order 12).
_FRAC_POINTS_MAX = 200_000


@functools.lru_cache(maxsize=256)
def _subsampled_rdp_cached(sigma: float, q: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    out = []
    for a in orders:
        if q >= 1.0:
            out.append(a / (2.0 * sigma * sigma))
            continue
        log_a = _log_a_int(q, sigma, int(a)) if float(a).is_integer() else _log_a_frac(q, sigma, a)
        out.append(log_a / (a - 1.0) if math.isfinite(log_a) else math.inf)
    return tuple(max(0.0, v) for v in out)


def subsampled_gaussian_rdp(
    noise_multiplier: float, sample_rate: float, orders: tuple[float, ...] = DEFAULT_ORDERS
) -> FloatArray:
    """RDP epsilon(alpha) of one Poisson-subsampled Gaussian step at each order (MTZ 2019).

    >>> round(float(subsampled_gaussian_rdp(1.0, 1.0, (2.0,))[0]), 6)   # alpha / (2 sigma^2)
    1.0
    """
    return np.asarray(_subsampled_rdp_cached(float(noise_multiplier), float(sample_rate), tuple(orders)))


def rdp_to_epsilon(rdp: FloatArray, orders: FloatArray, delta: float) -> float:
    """Smallest epsilon over orders from the improved conversion (CKS 2020, Proposition 12).

    Zero where ``delta`` is at least the total-variation bound ``min_alpha sqrt(1 - e^-rdp)`` that
    :func:`rdp_to_delta` also uses (every delta(eps >= 0) is below it), so that the two conversions
    agree: ``epsilon(delta(e)) <= e``.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        log_tv = float(np.nanmin(0.5 * np.log(-np.expm1(-rdp))))
    if log_tv < 0.0 and math.log(delta) >= log_tv:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp + np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)
    eps = np.where(np.isfinite(eps), eps, np.inf)
    return max(0.0, float(np.min(eps)))


def rdp_to_delta(rdp: FloatArray, orders: FloatArray, epsilon: float) -> float:
    """Smallest delta over orders: the inverse conversion, and ``delta <= sqrt(1 - e^-rdp)``."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        log_d = (orders - 1.0) * (rdp - epsilon + np.log1p(-1.0 / orders)) - np.log(orders)
        # delta(eps) <= TV <= sqrt(1 - exp(-KL)) <= sqrt(1 - exp(-D_alpha)) (Bretagnolle-Huber).
        log_tv = 0.5 * np.log(-np.expm1(-rdp))
    best = float(np.nanmin(np.minimum(log_d, log_tv)))
    return min(1.0, math.exp(best)) if best < 0.0 else 1.0


class RDPAccountant(Accountant):
    """Renyi DP accountant over a dense grid of orders (add/remove neighbouring relation).

    Args:
        orders: the Renyi orders (> 1) to optimise over; default :data:`DEFAULT_ORDERS`
            (1.005 ... 10000: 1.005-1.05 geometric, then every 0.05 up to 12, every integer
            to 64, 40 more up to 10000; a superset of dp_accounting's default orders).

    Accepted domain: Gaussian, Poisson- and replace-one-subsampled Gaussian, fixed-size batch,
    Laplace, discrete Gaussian and pure (epsilon, 0) events, every parameter they accept; every delta
    in (0, 1). An order whose RDP cannot be computed within bounded work (a fractional order at noise
    multipliers below ~2.4e-3; a replace-one order past 2e5 integration points) is left out of the
    minimum, which stays a bound; epsilon above 1e6 is refused.

    References:
        Mironov, I. (2017). Renyi Differential Privacy. CSF.
        Mironov, I., Talwar, K. & Zhang, L. (2019). Renyi Differential Privacy of the Sampled
        Gaussian Mechanism. arXiv:1908.10530.
        Canonne, C., Kamath, G. & Steinke, T. (2020). The Discrete Gaussian for Differential
        Privacy, Proposition 12. Balle, B. et al. (2020). Hypothesis Testing Interpretations and
        Renyi Differential Privacy, Theorem 21.
    """

    name = "rdp"

    def __init__(self, *, orders: tuple[float, ...] | None = None) -> None:
        super().__init__()
        o = tuple(float(a) for a in (orders if orders is not None else DEFAULT_ORDERS))
        if not o or any(not (a > 1.0 and math.isfinite(a)) for a in o):
            raise InvalidParameter(f"orders must be finite numbers > 1, got orders={orders!r}")
        self._orders = o
        self._orders_arr = np.asarray(o)
        self._rdp: FloatArray | None = None

    @property
    def orders(self) -> tuple[float, ...]:
        return self._orders

    def _supports_leaf(self, leaf: Event) -> bool:
        if isinstance(leaf, EpsilonDeltaEvent):
            return leaf.delta == 0.0
        if isinstance(
            leaf,
            FixedBatchGaussianEvent
            | LaplaceEvent
            | DiscreteGaussianEvent
            | ReplaceOneSubsampledGaussianEvent,
        ):
            return True  # Wang, Balle & Kasiviswanathan 2019 Thm 27; Mironov 2017 Prop 6; CKS 2020
        return isinstance(leaf, GaussianEvent | SubsampledGaussianEvent)

    def _on_compose(self) -> None:
        self._rdp = None

    def rdp(self) -> FloatArray:
        """The composed RDP epsilon at each of :attr:`orders`."""
        if self._rdp is None:
            total = np.zeros(len(self._orders))
            for e, c in self._counts.items():
                if isinstance(e, GaussianEvent):
                    total += c * self._orders_arr / (2.0 * e.noise_multiplier**2)
                elif isinstance(e, SubsampledGaussianEvent):
                    total += c * subsampled_gaussian_rdp(e.noise_multiplier, e.sample_rate, self._orders)
                elif isinstance(e, EpsilonDeltaEvent):
                    total += c * np.minimum(e.epsilon, self._orders_arr * e.epsilon**2 / 2.0)
                else:
                    r = leaf_rdp(e, self._orders_arr)
                    if r is None:
                        raise InvalidParameter(f"no RDP bound for {e!r}")
                    total += c * r
            self._rdp = total
        return self._rdp

    def _epsilon(self, delta: float) -> float:
        if self._only_gaussian():
            return epsilon_for_mu(mu=self._gaussian_mu(), delta=delta)
        return rdp_to_epsilon(self.rdp(), self._orders_arr, delta)

    def _delta(self, epsilon: float) -> float:
        if self._only_gaussian():
            return delta_for_mu(mu=self._gaussian_mu(), epsilon=epsilon)
        return rdp_to_delta(self.rdp(), self._orders_arr, epsilon)
