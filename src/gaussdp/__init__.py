"""gaussdp: the Gaussian mechanism of differential privacy, with privacy claims that are true.

The flow everywhere: bound the sensitivity (clip), calibrate the noise, charge the budget, release.
The top level re-exports the core (numpy and scipy only); the applications that need extras live in
their own subpackages (``gaussdp.torch``, ``gaussdp.text``, ``gaussdp.federated``,
``gaussdp.service``) and are imported from there.
"""

from __future__ import annotations

from gaussdp.accounting import (
    GaussianEvent,
    SubsampledGaussianEvent,
    accountant,
    noise_for_epsilon,
)
from gaussdp.budget import Budget, Ledger
from gaussdp.calibration import (
    classical_sigma,
    delta_for,
    delta_for_mu,
    epsilon_for,
    epsilon_for_mu,
    mu_for,
    sigma_for,
)
from gaussdp.clipping import clip_l2, clip_rows, clip_tree, clipped_sum
from gaussdp.errors import (
    BudgetExhausted,
    InvalidParameter,
    NotPrivateWarning,
    NumericalFault,
    PrivacyError,
    PrivacyWarning,
    UnsafeInput,
)
from gaussdp.mechanism import GaussianMechanism
from gaussdp.noise import NoiseSource, noise_source

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "BudgetExhausted",
    "GaussianEvent",
    "GaussianMechanism",
    "InvalidParameter",
    "Ledger",
    "NoiseSource",
    "NotPrivateWarning",
    "NumericalFault",
    "PrivacyError",
    "PrivacyWarning",
    "SubsampledGaussianEvent",
    "UnsafeInput",
    "__version__",
    "accountant",
    "classical_sigma",
    "clip_l2",
    "clip_rows",
    "clip_tree",
    "clipped_sum",
    "delta_for",
    "delta_for_mu",
    "epsilon_for",
    "epsilon_for_mu",
    "mu_for",
    "noise_for_epsilon",
    "noise_source",
    "sigma_for",
]
