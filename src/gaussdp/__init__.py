"""gaussdp: the Gaussian mechanism of differential privacy, with privacy claims that are true.

The flow everywhere: bound the sensitivity (clip), calibrate the noise, charge the budget, release.
The top level re-exports the core (numpy and scipy only); the applications that need extras live in
their own subpackages (``gaussdp.torch``, ``gaussdp.text``, ``gaussdp.federated``,
``gaussdp.service``) and are imported from there.
"""

from __future__ import annotations

from gaussdp.calibration import (
    classical_sigma,
    delta_for,
    delta_for_mu,
    epsilon_for,
    epsilon_for_mu,
    mu_for,
    sigma_for,
)
from gaussdp.errors import (
    BudgetExhausted,
    InvalidParameter,
    NotPrivateWarning,
    PrivacyError,
    PrivacyWarning,
    UnsafeInput,
)

__version__ = "0.1.0"

__all__ = [
    "BudgetExhausted",
    "InvalidParameter",
    "NotPrivateWarning",
    "PrivacyError",
    "PrivacyWarning",
    "UnsafeInput",
    "__version__",
    "classical_sigma",
    "delta_for",
    "delta_for_mu",
    "epsilon_for",
    "epsilon_for_mu",
    "mu_for",
    "sigma_for",
]
