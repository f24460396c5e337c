"""Privacy accounting: events (what was released) and accountants (what it cost).

Neighbouring relation everywhere: add/remove of one record. Every accountant except ``"gdp"``
(a central-limit approximation, labelled as such) returns upper bounds on the true epsilon(delta).
"""

from __future__ import annotations

from gaussdp.accounting.advanced import AdvancedComposition
from gaussdp.accounting.base import (
    Accountant,
    UnsupportedEvent,
    accountant,
    available_accountants,
    upper_bound_accountant,
)
from gaussdp.accounting.basic import BasicComposition
from gaussdp.accounting.documents import (
    PrivacyBudget,
    PrivacyParams,
    advanced_composition_epsilon,
    basic_composition_epsilon,
    compute_delta_from_epsilon,
    compute_epsilon_from_delta,
    estimate_noise_scale,
)
from gaussdp.accounting.events import (
    ComposedEvent,
    EpsilonDeltaEvent,
    Event,
    GaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
)
from gaussdp.accounting.gdp import GDPAccountant
from gaussdp.accounting.inverse import noise_for_epsilon
from gaussdp.accounting.pld import PLDAccountant
from gaussdp.accounting.rdp import RDPAccountant

__all__ = [
    "Accountant",
    "AdvancedComposition",
    "BasicComposition",
    "ComposedEvent",
    "EpsilonDeltaEvent",
    "Event",
    "GDPAccountant",
    "GaussianEvent",
    "PLDAccountant",
    "PrivacyBudget",
    "PrivacyParams",
    "RDPAccountant",
    "SelfComposedEvent",
    "SubsampledGaussianEvent",
    "UnsupportedEvent",
    "accountant",
    "advanced_composition_epsilon",
    "available_accountants",
    "basic_composition_epsilon",
    "compute_delta_from_epsilon",
    "compute_epsilon_from_delta",
    "estimate_noise_scale",
    "event_from_dict",
    "noise_for_epsilon",
    "upper_bound_accountant",
]

# The ledger-backed trackers moved up to the budget layer (they use the ledger, which sits above
# accounting); the old names still resolve, lazily, with a DeprecationWarning.
_MOVED_TO_BUDGET = frozenset(
    {"BudgetState", "PrivacyAccountant", "PrivacyBudgetTracker", "PrivacyExpenditure"}
)


def __getattr__(name: str) -> object:
    if name in _MOVED_TO_BUDGET:
        import importlib
        import warnings

        warnings.warn(
            f"gaussdp.accounting.{name} moved to gaussdp.budget.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("gaussdp.budget.trackers"), name)
    raise AttributeError(f"module 'gaussdp.accounting' has no attribute {name!r}")
