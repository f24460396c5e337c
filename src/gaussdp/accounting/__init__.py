"""Privacy accounting: events (what was released) and accountants (what it cost).

Neighbouring relation: add/remove of one record, or replace-one for the events that say so
(fixed-size batches, :class:`ReplaceOneSubsampledGaussianEvent`); an accountant refuses to mix the
two. Every accountant except ``"gdp"`` (a central-limit approximation, labelled as such) returns
upper bounds on the true epsilon(delta).
"""

from __future__ import annotations

from gaussdp._neighbouring import Neighbouring
from gaussdp.accounting._dp_accounting import from_dp_event, to_dp_event
from gaussdp.accounting._schedule import (
    banded_matrix_factorization_event,
    noise_scale_for_schedule,
    scale_noise,
    tree_aggregation_event,
)
from gaussdp.accounting.advanced import AdvancedComposition
from gaussdp.accounting.base import Accountant, UnsupportedEvent
from gaussdp.accounting.basic import BasicComposition
from gaussdp.accounting.events import (
    ComposedEvent,
    DiscreteGaussianEvent,
    EpsilonDeltaEvent,
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
    neighboring_relation_of,
)
from gaussdp.accounting.gdp import GDPAccountant
from gaussdp.accounting.inverse import noise_for_epsilon
from gaussdp.accounting.pld import PLDAccountant
from gaussdp.accounting.rdp import RDPAccountant
from gaussdp.accounting.registry import accountant, available_accountants
from gaussdp.accounting.run_budget import (
    PrivacyBudget,
    PrivacyParams,
    advanced_composition_epsilon,
    basic_composition_epsilon,
    compute_delta_from_epsilon,
    compute_epsilon_from_delta,
    estimate_noise_scale,
)

__all__ = [
    "Accountant",
    "AdvancedComposition",
    "BasicComposition",
    "ComposedEvent",
    "DiscreteGaussianEvent",
    "EpsilonDeltaEvent",
    "Event",
    "FixedBatchGaussianEvent",
    "GDPAccountant",
    "GaussianEvent",
    "LaplaceEvent",
    "Neighbouring",
    "PLDAccountant",
    "PrivacyBudget",
    "PrivacyLossDistributionEvent",
    "PrivacyParams",
    "PrivacyProfileEvent",
    "RDPAccountant",
    "ReplaceOneSubsampledGaussianEvent",
    "SelfComposedEvent",
    "SubsampledGaussianEvent",
    "UnsupportedEvent",
    "accountant",
    "advanced_composition_epsilon",
    "available_accountants",
    "banded_matrix_factorization_event",
    "basic_composition_epsilon",
    "compute_delta_from_epsilon",
    "compute_epsilon_from_delta",
    "estimate_noise_scale",
    "event_from_dict",
    "from_dp_event",
    "neighboring_relation_of",
    "noise_for_epsilon",
    "noise_scale_for_schedule",
    "scale_noise",
    "to_dp_event",
    "tree_aggregation_event",
]
