"""Adaptive clipping for DP-FedAvg (Andrew, Thakkar, McMahan & Ramaswamy 2021).

Every sampled client also reports one bit, ``b_i = 1[||Delta_i|| <= C]``. The server releases the
noised, centred count ``sum_i (b_i - 1/2) + N(0, sigma_b^2)`` and moves the clip norm geometrically
towards the ``target_quantile`` gamma of the update norms:

    b_hat = count / m + 1/2            (m = q N, the fixed expected number of clients)
    C    <- C * exp(-eta * (b_hat - gamma))

Privacy: under add/remove of one client the centred count moves by at most 1/2, so the count is a
Gaussian release with noise multiplier ``2 sigma_b``; the clipped sum is one with ``z_Delta``. Two
Gaussian releases on the same (sub)sample compose into one Gaussian with
``z^-2 = z_Delta^-2 + (2 sigma_b)^-2``; given the total noise multiplier ``z`` the user wants to be
charged, the sum therefore gets ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021,
Section 3.1, "the effective noise multiplier"), and each round is charged
``SubsampledGaussianEvent(z, q)``. A dropped client sends nothing, i.e. the centred value 0, which is
within [-1/2, 1/2]: dropouts keep the bound.

References:
    Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive
    Clipping", NeurIPS (Algorithm 1; Theorem 1 for the composition of the two Gaussians).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gaussdp._validate import check_positive, real_number
from gaussdp.errors import InvalidParameter

__all__ = ["AdaptiveClipping", "effective_noise_multiplier"]


def effective_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the sum's noise multiplier that leaves a total of ``z``.

    Raises:
        InvalidParameter: ``count_stddev <= 1 / (2 z)``: the count alone would already cost more
            than the whole round is allowed to (Andrew et al. 2021, Section 3.1).
    """
    z = check_positive("noise_multiplier", noise_multiplier)
    sb = check_positive("count_stddev", count_stddev)
    rest = z**-2 - (2.0 * sb) ** -2
    if rest <= 0.0:
        raise InvalidParameter(
            f"count_stddev must be > 1/(2*noise_multiplier) = {1.0 / (2.0 * z):.6g} so that the clipped "
            f"sum keeps some of the privacy budget, got count_stddev={count_stddev!r}"
        )
    return rest**-0.5


@dataclass
class AdaptiveClipping:
    """State of the geometric clip-norm update (Andrew et al. 2021, Algorithm 1).

    Args:
        initial_clip_norm: ``C`` of the first round.
        target_quantile: gamma in (0, 1): the fraction of client updates that should be unclipped.
        learning_rate: eta of the geometric update (the paper uses 0.2).
        count_stddev: sigma_b, the noise of the centred count; the paper suggests ``m / 20`` for ``m``
            expected clients per round.
    """

    initial_clip_norm: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 1.0

    def __post_init__(self) -> None:
        self.initial_clip_norm = check_positive("initial_clip_norm", self.initial_clip_norm)
        q = real_number("target_quantile", self.target_quantile)
        if not 0.0 < q < 1.0:
            raise InvalidParameter(f"target_quantile must be in (0, 1), got target_quantile={q!r}")
        self.target_quantile = q
        self.learning_rate = check_positive("learning_rate", self.learning_rate)
        self.count_stddev = check_positive("count_stddev", self.count_stddev)
        self.clip_norm = self.initial_clip_norm

    def centred_bits(self, norms: np.ndarray) -> np.ndarray:
        """``b_i - 1/2`` for the clients that responded (computed before clipping)."""
        return (np.asarray(norms, dtype=np.float64) <= self.clip_norm).astype(np.float64) - 0.5

    def update(self, noisy_centred_count: float, expected_clients: float) -> float:
        """Apply ``C <- C exp(-eta (b_hat - gamma))`` from the *noised* count; returns the new ``C``."""
        b_hat = float(noisy_centred_count) / float(expected_clients) + 0.5
        self.clip_norm = self.clip_norm * math.exp(-self.learning_rate * (b_hat - self.target_quantile))
        return self.clip_norm
