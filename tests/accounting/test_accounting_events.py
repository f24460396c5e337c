"""Events: immutable, validated, hashable, and round-trip through dicts (for the ledger's SQL)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gaussdp.accounting import (
    ComposedEvent,
    EpsilonDeltaEvent,
    GaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    event_from_dict,
)
from gaussdp.accounting.events import flatten_event
from gaussdp.errors import InvalidParameter

EVENTS = [
    GaussianEvent(1.5),
    SubsampledGaussianEvent(1.1, 256 / 60000),
    EpsilonDeltaEvent(0.5, 1e-6),
    EpsilonDeltaEvent(2.0),
    SelfComposedEvent(SubsampledGaussianEvent(0.8, 0.001), 100000),
    ComposedEvent((GaussianEvent(2.0), SelfComposedEvent(EpsilonDeltaEvent(0.1), 3))),
    ComposedEvent(()),
]


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


def test_flatten_multiplies_counts_and_maps_full_sampling_to_gaussian():
    ev = SelfComposedEvent(ComposedEvent((SubsampledGaussianEvent(2.0, 1.0), EpsilonDeltaEvent(1.0))), 3)
    assert list(flatten_event(ev, 2)) == [(GaussianEvent(2.0), 6), (EpsilonDeltaEvent(1.0), 6)]
