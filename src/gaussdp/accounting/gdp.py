"""Gaussian DP via the central limit theorem: an APPROXIMATION, not an upper bound.

Plain Gaussian compositions are exactly mu-GDP with mu = sqrt(sum 1/sigma_i^2) (Dong, Roth & Su
2019, Corollary 3.3), and this accountant is exact for them. For Poisson-subsampled Gaussian steps
it uses the CLT of Bu, Dong, Long & Su (2020, Theorem 5 / Corollary 5.4): T steps at rate q with
noise sigma are approximately mu-GDP with ``mu = q sqrt(T (e^{1/sigma^2} - 1))``. That limit can
*underestimate* epsilon for finite T (it is known to be optimistic for small T and small sigma), so
it is never the default and its name says so; use ``"pld"`` for a guarantee.
"""

from __future__ import annotations

import math

from gaussdp.accounting.base import Accountant
from gaussdp.accounting.events import Event, GaussianEvent, SubsampledGaussianEvent
from gaussdp.calibration import delta_for_mu, epsilon_for_mu
from gaussdp.errors import InvalidParameter

__all__ = ["GDPAccountant"]


class GDPAccountant(Accountant):
    """mu-GDP by the central limit theorem (approximate for subsampled events; add/remove).

    References:
        Dong, J., Roth, A. & Su, W. (2019). Gaussian Differential Privacy. arXiv:1905.02383.
        Bu, Z., Dong, J., Long, Q. & Su, W. (2020). Deep Learning with Gaussian Differential Privacy.
        Harvard Data Science Review.
    """

    name = "gdp"
    approximate = True

    def _supports_leaf(self, leaf: Event) -> bool:
        return isinstance(leaf, GaussianEvent | SubsampledGaussianEvent)

    def mu(self) -> float:
        """The (approximate, for subsampled events) GDP parameter of the composition."""
        s = 0.0
        for e, c in self._counts.items():
            if isinstance(e, GaussianEvent):
                s += c / e.noise_multiplier**2
            elif isinstance(e, SubsampledGaussianEvent):
                inv = 1.0 / e.noise_multiplier**2
                if inv > 700.0:
                    raise InvalidParameter(
                        f"noise_multiplier={e.noise_multiplier:g} is too small for the GDP CLT"
                    )
                s += c * e.sample_rate**2 * math.expm1(inv)
        return math.sqrt(s)

    def _epsilon(self, delta: float) -> float:
        return epsilon_for_mu(mu=self.mu(), delta=delta)

    def _delta(self, epsilon: float) -> float:
        return delta_for_mu(mu=self.mu(), epsilon=epsilon)
