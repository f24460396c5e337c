"""Banded matrix-factorisation (MF) noise: correlated noise across training steps.

DP-SGD adds independent noise at each step; banded MF (DP-FTRL's successor) adds
``y = C^{-1} z`` for a banded lower-triangular strategy ``C``, i.e. the Gaussian release ``C x + z``
of the steps' clipped sums ``x``, post-processed. For multi-epoch training and federated learning
without sampling it gives a smaller error at the same epsilon.

* :func:`banded_toeplitz_coefficients`: the strategy, optimised for the run's steps and bands, cached.
* :func:`strategy_sensitivity` and :class:`BandedMFPlan`: its sensitivity under multiple
  participations and the accounting's event (:func:`gaussdp.accounting.banded_matrix_factorization_event`).
* :class:`BandedNoise`: the correlated noise, step by step, from a buffer of ``b - 1`` noise vectors.

The PyTorch engine uses it through ``make_private(..., noise_mechanism="banded-mf")`` and Flower
through :class:`gaussdp.federated.flower.DPFTRLStrategy` -- see docs/guides/matrix-factorization.md.
"""

from gaussdp.mf._noise import BandedNoise
from gaussdp.mf._plan import BandedMFPlan, strategy_sensitivity
from gaussdp.mf._strategy import banded_toeplitz_coefficients, prefix_sum_loss, toeplitz_matrix

__all__ = [
    "BandedMFPlan",
    "BandedNoise",
    "banded_toeplitz_coefficients",
    "prefix_sum_loss",
    "strategy_sensitivity",
    "toeplitz_matrix",
]
