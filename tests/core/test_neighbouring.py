"""One neighbouring relation, one spelling: ``Neighbouring`` ("add_remove", "replace_one") everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gaussdp._neighbouring import (
    DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    Neighbouring,
    check_neighbouring,
    hidden_state_sensitivity,
)
from gaussdp._rows import release_epsilon
from gaussdp.accounting import (
    FixedBatchGaussianEvent,
    GaussianEvent,
    PLDAccountant,
    ReplaceOneSubsampledGaussianEvent,
    SubsampledGaussianEvent,
)
from gaussdp.errors import InvalidParameter
from gaussdp.mechanism import GaussianMechanism

OLD = [("replace", "replace_one"), ("replace-one", "replace_one"), ("add-remove", "add_remove")]


def test_the_two_values():
    assert [n.value for n in Neighbouring] == ["add_remove", "replace_one"]
    assert Neighbouring.ADD_REMOVE == "add_remove" and f"{Neighbouring.REPLACE_ONE}" == "replace_one"
    assert json.dumps({"n": Neighbouring.REPLACE_ONE}) == '{"n": "replace_one"}'
    assert DEFAULT_HIDDEN_STATE_NEIGHBOURING == Neighbouring.REPLACE_ONE
    for n in Neighbouring:
        assert check_neighbouring(n) is n and check_neighbouring(n.value) is n


@pytest.mark.parametrize(("old", "right"), OLD)
def test_old_spellings_are_refused_naming_the_right_one(old, right):
    with pytest.raises(InvalidParameter, match=f"write neighbouring='{right}'"):
        check_neighbouring(old)
    with pytest.raises(InvalidParameter, match=f"'{right}'"):
        hidden_state_sensitivity(1.0, old)
    with pytest.raises(InvalidParameter, match=f"'{right}'"):
        release_epsilon(GaussianMechanism(sigma=2.0, sensitivity=1.0), 1e-5, old)


def test_other_values_are_refused():
    with pytest.raises(InvalidParameter, match="'add_remove' or 'replace_one'"):
        check_neighbouring("swap")
    with pytest.raises(TypeError):
        check_neighbouring(None)


def test_events_and_accountants_speak_the_enum():
    assert SubsampledGaussianEvent(1.0, 0.01).neighboring_relation is Neighbouring.ADD_REMOVE
    assert ReplaceOneSubsampledGaussianEvent(1.0, 0.01).neighboring_relation is Neighbouring.REPLACE_ONE
    assert FixedBatchGaussianEvent(1.0, 8, 100).neighboring_relation is Neighbouring.REPLACE_ONE
    assert GaussianEvent(1.0).neighboring_relation is None
    acc = PLDAccountant().compose(ReplaceOneSubsampledGaussianEvent(1.0, 0.01))
    assert acc.neighboring_relation is Neighbouring.REPLACE_ONE
    with pytest.raises(InvalidParameter, match="cannot compose a add_remove event"):
        acc.compose(SubsampledGaussianEvent(1.0, 0.01))


def test_rows_and_hidden_states_by_relation():
    mech = GaussianMechanism(sigma=2.0, sensitivity=1.0)
    assert release_epsilon(mech, 1e-5, "add_remove") == pytest.approx(mech.epsilon(1e-5))
    doubled = GaussianMechanism(sigma=2.0, sensitivity=2.0).epsilon(1e-5)
    assert release_epsilon(mech, 1e-5, Neighbouring.REPLACE_ONE) == pytest.approx(doubled)
    assert hidden_state_sensitivity(0.5, "replace_one") == 1.0
    assert hidden_state_sensitivity(0.5, Neighbouring.ADD_REMOVE) == 0.5
    assert np.isfinite(release_epsilon(mech, 1e-5, "replace_one"))


def test_dp_accounting_conversion_refuses_old_spellings():
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event

    from gaussdp.accounting import from_dp_event

    with pytest.raises(InvalidParameter, match="write neighboring_relation='replace_one'"):
        from_dp_event(dp_event.GaussianDpEvent(1.0), neighboring_relation="replace")


@pytest.mark.parametrize(("old", "right"), OLD)
def test_service_json_refuses_old_spellings(old, right):
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from gaussdp.service.models import HiddenStateIn

    with pytest.raises(ValidationError, match=f"write neighbouring='{right}'"):
        HiddenStateIn.model_validate({"hidden_state": [1.0], "neighbouring": old})
    ok = HiddenStateIn.model_validate({"hidden_state": [1.0], "neighbouring": right})
    assert ok.neighbouring == right
    with pytest.raises(ValidationError):
        HiddenStateIn.model_validate({"hidden_state": [1.0], "neighbouring": 1})
