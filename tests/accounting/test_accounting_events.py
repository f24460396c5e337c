"""Events: immutable, validated, hashable, and round-trip through dicts (for the ledger's SQL)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gaussdp.accounting import (
    ComposedEvent,
    DiscreteGaussianEvent,
    EpsilonDeltaEvent,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
)
from gaussdp.accounting.events import _KINDS, event_json, flatten_event
from gaussdp.errors import InvalidParameter

EVENTS = [
    GaussianEvent(1.5),
    SubsampledGaussianEvent(1.1, 256 / 60000),
    EpsilonDeltaEvent(0.5, 1e-6),
    EpsilonDeltaEvent(2.0),
    SelfComposedEvent(SubsampledGaussianEvent(0.8, 0.001), 100000),
    ComposedEvent((GaussianEvent(2.0), SelfComposedEvent(EpsilonDeltaEvent(0.1), 3))),
    ComposedEvent(()),
    ReplaceOneSubsampledGaussianEvent(1.1, 0.01),
    FixedBatchGaussianEvent(1.0, 64, 60000),
    LaplaceEvent(2.0, 0.5),
    DiscreteGaussianEvent(3.0, 2),
    PrivacyLossDistributionEvent((-0.5, 0.2, 1.0), (0.2, 0.5, 0.29)),
    PrivacyProfileEvent((0.5, 1.0), (1e-2, 1e-4)),
]

# The stored form of every kind (ledgers hold these in their databases: the shape must not drift).
STORED = [
    (GaussianEvent(1.5), {"type": "gaussian", "noise_multiplier": 1.5}),
    (
        SubsampledGaussianEvent(1.1, 0.01),
        {"type": "subsampled_gaussian", "noise_multiplier": 1.1, "sample_rate": 0.01},
    ),
    (EpsilonDeltaEvent(0.5, 1e-6), {"type": "epsilon_delta", "epsilon": 0.5, "delta": 1e-6}),
    (
        ReplaceOneSubsampledGaussianEvent(1.1, 0.01),
        {"type": "replace_one_subsampled_gaussian", "noise_multiplier": 1.1, "sample_rate": 0.01},
    ),
    (
        FixedBatchGaussianEvent(1.0, 64, 60000),
        {"type": "fixed_batch_gaussian", "noise_multiplier": 1.0, "batch_size": 64, "dataset_size": 60000},
    ),
    (LaplaceEvent(2.0, 0.5), {"type": "laplace", "scale": 2.0, "sensitivity": 0.5}),
    (DiscreteGaussianEvent(3.0, 2), {"type": "discrete_gaussian", "sigma": 3.0, "sensitivity": 2}),
    (
        PrivacyLossDistributionEvent((0.2, 1.0), (0.5, 0.29)),
        {"type": "privacy_loss_distribution", "losses": [0.2, 1.0], "probabilities": [0.5, 0.29]},
    ),
    (
        PrivacyProfileEvent((0.5, 1.0), (1e-2, 1e-4)),
        {"type": "privacy_profile", "epsilons": [0.5, 1.0], "deltas": [1e-2, 1e-4]},
    ),
    (
        SelfComposedEvent(GaussianEvent(2.0), 3),
        {"type": "self_composed", "event": {"type": "gaussian", "noise_multiplier": 2.0}, "count": 3},
    ),
    (
        ComposedEvent((GaussianEvent(2.0), LaplaceEvent(1.0))),
        {
            "type": "composed",
            "events": [
                {"type": "gaussian", "noise_multiplier": 2.0},
                {"type": "laplace", "scale": 1.0, "sensitivity": 1.0},
            ],
        },
    ),
]


def test_every_event_kind_has_a_round_trip_and_a_stored_form():
    # A new event kind registers itself by its class: it must also get a case here.
    assert {e.kind for e in EVENTS} == set(_KINDS)
    assert {e.kind for e, _ in STORED} == set(_KINDS)


@pytest.mark.parametrize(("event", "stored"), STORED, ids=lambda x: getattr(x, "kind", ""))
def test_stored_form(event, stored):
    assert event.to_dict() == stored
    assert event_from_dict(stored) == event
    assert event_json(event) == json.dumps(stored, sort_keys=True, separators=(",", ":"))
    assert event_json(stored) == event_json(event)


def test_fields_with_a_default_may_be_left_out():
    assert event_from_dict({"type": "epsilon_delta", "epsilon": 1.0}) == EpsilonDeltaEvent(1.0, 0.0)
    assert event_from_dict({"type": "laplace", "scale": 2.0}) == LaplaceEvent(2.0, 1.0)
    assert event_from_dict({"type": "discrete_gaussian", "sigma": 2.0}) == DiscreteGaussianEvent(2.0, 1)
    with pytest.raises(InvalidParameter, match="'events'"):
        event_from_dict({"type": "composed"})  # a default factory is not a default: the list is required


def test_event_json_is_canonical():
    a = event_json({"sample_rate": 0.01, "type": "subsampled_gaussian", "noise_multiplier": 1.1})
    assert a == event_json(SubsampledGaussianEvent(1.1, 0.01))
    assert a == '{"noise_multiplier":1.1,"sample_rate":0.01,"type":"subsampled_gaussian"}'
    with pytest.raises(ValueError):
        event_json({"type": "gaussian", "noise_multiplier": math.nan})


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip_through_json(event):
    d = json.loads(json.dumps(event.to_dict()))
    back = event_from_dict(d)
    assert back == event
    assert hash(back) == hash(event)


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_frozen(event):
    field = dataclasses.fields(event)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(event, field, 1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GaussianEvent(0.0),
        lambda: GaussianEvent(-1.0),
        lambda: GaussianEvent(math.nan),
        lambda: GaussianEvent(math.inf),
        lambda: SubsampledGaussianEvent(1.0, 0.0),
        lambda: SubsampledGaussianEvent(1.0, 1.5),
        lambda: EpsilonDeltaEvent(-0.1),
        lambda: EpsilonDeltaEvent(1.0, 1.0),
        lambda: SelfComposedEvent(GaussianEvent(1.0), 0),
    ],
)
def test_invalid_parameters_raise_naming_the_argument(make):
    with pytest.raises(InvalidParameter):
        make()


def test_type_errors():
    with pytest.raises(TypeError, match="noise_multiplier"):
        GaussianEvent("1.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="count"):
        SelfComposedEvent(GaussianEvent(1.0), 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="count"):
        SelfComposedEvent(GaussianEvent(1.0), True)
    with pytest.raises(TypeError):
        ComposedEvent((GaussianEvent(1.0), "not an event"))  # type: ignore[arg-type]


def test_event_from_dict_rejects_unknown_and_incomplete():
    with pytest.raises(InvalidParameter, match="unknown event type"):
        event_from_dict({"type": "zcdp", "rho": 1.0})
    with pytest.raises(InvalidParameter, match="noise_multiplier"):
        event_from_dict({"type": "gaussian"})
    with pytest.raises(InvalidParameter):
        event_from_dict({"type": "gaussian", "noise_multiplier": -1})
    with pytest.raises(InvalidParameter, match="'sample_rate'"):
        event_from_dict({"type": "subsampled_gaussian", "noise_multiplier": 1.0})
    with pytest.raises(InvalidParameter, match="unknown event type"):
        event_from_dict({"noise_multiplier": 1.0})
    with pytest.raises(TypeError):
        event_from_dict([("type", "gaussian")])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        event_from_dict({"type": "self_composed", "event": "gaussian", "count": 2})
    # a misspelt field is refused, not replaced by its default (count=1 would undercharge)
    inner = GaussianEvent(1.0).to_dict()
    with pytest.raises(InvalidParameter, match=r"unknown fields \['cuont'\]"):
        event_from_dict({"type": "self_composed", "event": inner, "cuont": 1000})
    with pytest.raises(InvalidParameter, match="unknown fields"):
        event_from_dict({"type": "self_composed", "event": {**inner, "extra": 1}, "count": 2})


def test_flatten_multiplies_counts_and_maps_full_sampling_to_gaussian():
    ev = SelfComposedEvent(ComposedEvent((SubsampledGaussianEvent(2.0, 1.0), EpsilonDeltaEvent(1.0))), 3)
    assert list(flatten_event(ev, 2)) == [(GaussianEvent(2.0), 6), (EpsilonDeltaEvent(1.0), 6)]
