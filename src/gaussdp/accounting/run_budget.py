"""A DP-SGD run's budget: its parameters, the per-round noise that keeps it, and the run helpers.

The DP-SGD privacy manager's accounting API, with correct math: :class:`PrivacyParams`,
:class:`PrivacyBudget` and the helpers (epsilon, delta and noise scale of a run). The manager's
per-round split ``epsilon_round = epsilon / sqrt(T)`` is *not* what the advanced composition
theorem gives; here the per-round noise is chosen with an accountant so that the ``num_rounds``
rounds provably stay within (epsilon, delta).

The ledger-backed trackers of the federated anomaly detector and of the inference server
(:class:`PrivacyTracker`, :class:`PrivacyBudgetTracker`) live in :mod:`gaussdp.budget.trackers`,
above the ledger they use.

Neighbouring relation: add/remove of one record, as everywhere in gaussdp.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from gaussdp._validate import (
    check_delta,
    check_epsilon,
    check_positive,
    check_probability,
)
from gaussdp.accounting.advanced import advanced_bound
from gaussdp.accounting.base import Accountant
from gaussdp.accounting.events import (
    Event,
    GaussianEvent,
    SubsampledGaussianEvent,
    check_count,
)
from gaussdp.accounting.inverse import noise_for_epsilon
from gaussdp.accounting.registry import accountant as make_accountant
from gaussdp.calibration import delta_for, epsilon_for, sigma_for
from gaussdp.errors import BudgetExhausted

__all__ = [
    "PrivacyBudget",
    "PrivacyParams",
    "advanced_composition_epsilon",
    "basic_composition_epsilon",
    "compute_delta_from_epsilon",
    "compute_epsilon_from_delta",
    "estimate_noise_scale",
]

logger = logging.getLogger(__name__)


# ----- the DP-SGD privacy manager ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PrivacyParams:
    """Privacy parameters of a training run: total (epsilon, delta) and the L2 clip norm."""

    epsilon: float
    delta: float
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        object.__setattr__(self, "delta", check_delta(self.delta))
        object.__setattr__(self, "clip_norm", check_positive("clip_norm", self.clip_norm))


def _round_event(noise_multiplier: float, sample_rate: float) -> Event:
    if sample_rate >= 1.0:
        return GaussianEvent(noise_multiplier)
    return SubsampledGaussianEvent(noise_multiplier, sample_rate)


class PrivacyBudget:
    """A total (epsilon, delta) budget spread over ``num_rounds`` Gaussian rounds.

    The per-round noise multiplier is the smallest whose ``num_rounds`` rounds compose to at most
    (epsilon, delta) under ``accountant`` (PLD by default; exact for plain Gaussian rounds). A round
    beyond ``num_rounds`` is refused with :class:`BudgetExhausted` before anything is released.

    >>> b = PrivacyBudget(epsilon=1.0, delta=1e-5, num_rounds=10)
    >>> round(b.noise_multiplier, 3)          # sqrt(10) * 3.7306: exact composition of 10 rounds
    11.797
    >>> b.use_round(); round(b.epsilon_remaining(), 3)
    0.715
    """

    def __init__(
        self,
        epsilon: float,
        delta: float,
        num_rounds: int,
        *,
        sample_rate: float = 1.0,
        accountant: str = "pld",
    ) -> None:
        self.epsilon = check_epsilon(epsilon)
        self.delta = check_delta(delta)
        self.num_rounds = check_count(num_rounds, "num_rounds")
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.accountant_name = accountant
        self._acc: Accountant = make_accountant(accountant)  # the budget must provably hold
        self.noise_multiplier = noise_for_epsilon(
            target_epsilon=self.epsilon,
            delta=self.delta,
            sample_rate=self.sample_rate,
            steps=self.num_rounds,
            accountant=accountant,
        )
        self.event = _round_event(self.noise_multiplier, self.sample_rate)
        self.rounds_used = 0

    @property
    def epsilon_per_round(self) -> float:
        """Epsilon of one round alone at ``delta`` (for information; rounds compose sub-additively)."""
        return make_accountant(self.accountant_name).compose(self.event).epsilon(self.delta)

    def use_round(self) -> None:
        """Charge one round. Raises :class:`BudgetExhausted` (and charges nothing) past ``num_rounds``."""
        if self.rounds_used >= self.num_rounds:
            raise BudgetExhausted(
                f"all {self.num_rounds} rounds of the (epsilon={self.epsilon:g}, delta={self.delta:g}) "
                "budget are used"
            )
        self._acc.compose(self.event)
        self.rounds_used += 1

    def epsilon_spent(self) -> float:
        """Epsilon of the rounds used so far, at ``delta``."""
        return self._acc.epsilon(self.delta)

    def epsilon_remaining(self) -> float:
        """``epsilon - epsilon_spent()``, never below 0."""
        return max(0.0, self.epsilon - self.epsilon_spent())

    def get_status(self) -> dict[str, Any]:
        """A status dict: budget, rounds used/remaining, spent/remaining epsilon, noise, accountant."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "num_rounds": self.num_rounds,
            "rounds_used": self.rounds_used,
            "rounds_remaining": self.num_rounds - self.rounds_used,
            "epsilon_spent": self.epsilon_spent(),
            "epsilon_remaining": self.epsilon_remaining(),
            "epsilon_per_round": self.epsilon_per_round,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "accountant": self.accountant_name,
            "neighbouring_relation": "add/remove",
        }


def compute_epsilon_from_delta(
    sigma: float,
    delta: float,
    sensitivity: float = 1.0,
    *,
    steps: int = 1,
    sample_rate: float = 1.0,
    accountant: str = "pld",
) -> float:
    """Epsilon at ``delta`` of ``steps`` Gaussian releases with noise ``sigma`` (exact for one)."""
    sigma = check_positive("sigma", sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    if steps == 1 and sample_rate == 1.0:
        return epsilon_for(sigma=sigma, delta=delta, sensitivity=sensitivity)
    return _composed(sigma / sensitivity, sample_rate, steps, accountant).epsilon(delta)


def compute_delta_from_epsilon(
    sigma: float,
    epsilon: float,
    sensitivity: float = 1.0,
    *,
    steps: int = 1,
    sample_rate: float = 1.0,
    accountant: str = "pld",
) -> float:
    """Delta at ``epsilon`` of ``steps`` Gaussian releases with noise ``sigma`` (exact for one)."""
    sigma = check_positive("sigma", sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    if steps == 1 and sample_rate == 1.0:
        return delta_for(sigma=sigma, epsilon=epsilon, sensitivity=sensitivity)
    return _composed(sigma / sensitivity, sample_rate, steps, accountant).delta(epsilon)


def _composed(noise_multiplier: float, sample_rate: float, steps: int, accountant: str) -> Accountant:
    """``steps`` rounds of (subsampled) Gaussian noise, composed under the named accountant."""
    event = _round_event(noise_multiplier, check_probability("sample_rate", sample_rate))
    return make_accountant(accountant).compose(event, count=steps)


def estimate_noise_scale(
    epsilon: float,
    delta: float,
    sensitivity: float = 1.0,
    *,
    steps: int = 1,
    sample_rate: float = 1.0,
    accountant: str = "pld",
) -> float:
    """Noise standard deviation sigma for (epsilon, delta)-DP over ``steps`` releases.

    One release uses the exact analytic calibration (Balle & Wang 2018), not the classical formula.

    >>> round(estimate_noise_scale(1.0, 1e-5), 4)
    3.7306
    """
    sensitivity = check_positive("sensitivity", sensitivity)
    if steps == 1 and sample_rate == 1.0:
        return sigma_for(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
    nm = noise_for_epsilon(
        target_epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )
    return nm * sensitivity


def advanced_composition_epsilon(epsilon_round: float, num_rounds: int, delta_prime: float) -> float:
    """Total epsilon of ``num_rounds`` (epsilon_round, delta_round)-DP rounds by advanced composition.

    ``sqrt(2 k ln(1/delta')) eps + k eps (e^eps - 1)`` (Dwork & Roth 2014, Theorem 3.20); the total
    delta is ``k delta_round + delta'``. The DP-SGD privacy manager printed
    ``2 sqrt(k ln(1/delta')) eps + k (e^eps
    - 1)``, which is not the theorem.

    >>> round(advanced_composition_epsilon(0.1, 100, 1e-5), 4)
    5.8502
    """
    eps = check_epsilon(epsilon_round, "epsilon_round")
    k = check_count(num_rounds, "num_rounds")
    d = check_delta(delta_prime, "delta_prime")
    return advanced_bound([(eps, k)], d)


def basic_composition_epsilon(epsilon_round: float, num_rounds: int) -> float:
    """``num_rounds * epsilon_round`` (Dwork & Roth 2014, Theorem 3.16; deltas add up too).

    >>> basic_composition_epsilon(0.1, 100)
    10.0
    """
    eps = check_epsilon(epsilon_round, "epsilon_round")
    k = check_count(num_rounds, "num_rounds")
    return math.fsum([eps] * k) if k < 1000 else eps * k
