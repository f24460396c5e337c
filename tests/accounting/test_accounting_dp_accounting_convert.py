"""Converters to and from dp_accounting's DpEvent trees: structure, relations, and equal epsilons."""

from __future__ import annotations

import pytest

from gaussdp.accounting import (
    ComposedEvent,
    EpsilonDeltaEvent,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    UnsupportedEvent,
    accountant,
    from_dp_event,
    to_dp_event,
)
from gaussdp.errors import InvalidParameter

de = pytest.importorskip("dp_accounting.dp_event")
pld_acc = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
rdp_acc = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
NR = pytest.importorskip("dp_accounting.privacy_accountant").NeighboringRelation

ADD_REMOVE_TREE = de.ComposedDpEvent(
    [
        de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(1.1)), 1000),
        de.GaussianDpEvent(8.0),
        de.SelfComposedDpEvent(de.LaplaceDpEvent(20.0), 5),
        de.NoOpDpEvent(),
    ]
)
REPLACE_TREE = de.ComposedDpEvent(
    [
        de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(1.1)), 500),
        de.GaussianDpEvent(16.0),
    ]
)


def test_add_remove_tree_converts_and_gives_dp_accounting_epsilon():
    ours = from_dp_event(ADD_REMOVE_TREE)
    assert ours == ComposedEvent(
        (
            SelfComposedEvent(SubsampledGaussianEvent(1.1, 0.01), 1000),
            GaussianEvent(8.0),
            SelfComposedEvent(LaplaceEvent(20.0), 5),
            ComposedEvent(()),
        )
    )
    acc = pld_acc.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ADD_REMOVE_TREE)
    got = accountant("pld").compose(ours).epsilon(1e-6)
    assert abs(got / acc.get_epsilon(1e-6) - 1) < 0.005
    assert to_dp_event(ours) == ADD_REMOVE_TREE
    assert from_dp_event(to_dp_event(ours)) == ours


def test_replace_one_tree_follows_dp_accounting_pld():
    ours = from_dp_event(REPLACE_TREE, neighboring_relation="replace_one")
    assert ours == ComposedEvent(
        (SelfComposedEvent(ReplaceOneSubsampledGaussianEvent(1.1, 0.01), 500), GaussianEvent(8.0))
    )
    acc = pld_acc.PLDAccountant(NR.REPLACE_ONE, value_discretization_interval=1e-4)
    acc.compose(REPLACE_TREE)
    got = accountant("pld").compose(ours).epsilon(1e-6)
    assert abs(got / acc.get_epsilon(1e-6) - 1) < 0.005
    assert to_dp_event(ours) == REPLACE_TREE
    assert from_dp_event(to_dp_event(ours), neighboring_relation="replace_one") == ours


def test_sampled_without_replacement_follows_dp_accounting_rdp():
    tree = de.SelfComposedDpEvent(
        de.SampledWithoutReplacementDpEvent(60000, 256, de.GaussianDpEvent(0.55)), 2000
    )
    ours = from_dp_event(tree, neighboring_relation="replace_one")
    assert ours == SelfComposedEvent(FixedBatchGaussianEvent(1.1, 256, 60000), 2000)
    acc = rdp_acc.RdpAccountant(neighboring_relation=NR.REPLACE_ONE)
    acc.compose(tree)
    got = accountant("rdp").compose(ours).epsilon(1e-5)
    theirs = acc.get_epsilon(1e-5)
    assert theirs * 0.98 < got <= theirs * (1 + 1e-9)
    assert to_dp_event(ours) == tree
    with pytest.raises(UnsupportedEvent, match="replace-one"):
        from_dp_event(tree)  # dp_accounting refuses it under add/remove too


@pytest.mark.parametrize(
    "node",
    [
        de.NonPrivateDpEvent(),
        de.UnsupportedDpEvent(),
        de.ZCDpEvent(0.1),
        de.RandomizedResponseDpEvent(0.5, 2),
        de.SingleEpochTreeAggregationDpEvent(1.0, 10),
        de.PoissonSampledDpEvent(0.1, de.LaplaceDpEvent(1.0)),
    ],
)
def test_unknown_nodes_are_refused(node):
    with pytest.raises(UnsupportedEvent):
        from_dp_event(de.ComposedDpEvent([de.GaussianDpEvent(1.0), node]))


def test_refusals_on_our_side():
    with pytest.raises(UnsupportedEvent):
        to_dp_event(EpsilonDeltaEvent(1.0, 1e-6))
    with pytest.raises(UnsupportedEvent):
        from_dp_event(de.LaplaceDpEvent(1.0), neighboring_relation="replace_one")
    with pytest.raises(InvalidParameter):
        from_dp_event(de.GaussianDpEvent(1.0), neighboring_relation="swap")
    with pytest.raises(InvalidParameter):
        from_dp_event(de.GaussianDpEvent(0.0))  # non-private: no finite noise multiplier
    with pytest.raises(TypeError):
        from_dp_event(GaussianEvent(1.0))
