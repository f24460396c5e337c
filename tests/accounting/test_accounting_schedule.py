"""Multi-phase noise calibration, tree aggregation (DP-FTRL) and banded matrix factorisation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gaussdp.accounting import (
    ComposedEvent,
    EpsilonDeltaEvent,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    accountant,
    banded_matrix_factorization_event,
    noise_for_epsilon,
    noise_scale_for_schedule,
    scale_noise,
    tree_aggregation_event,
)
from gaussdp.errors import InvalidParameter

de = pytest.importorskip("dp_accounting.dp_event")
pld_acc = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
rdp_lib = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
NR = pytest.importorskip("dp_accounting.privacy_accountant").NeighboringRelation

PHASES = ComposedEvent(
    (
        SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.01), 2000),  # warm-up: small batches
        SelfComposedEvent(SubsampledGaussianEvent(1.5, 0.05), 500),  # large batches
        SelfComposedEvent(GaussianEvent(20.0), 3),  # full-batch evaluation queries
    )
)


def test_schedule_scale_meets_the_target_tightly_and_agrees_with_dp_accounting():
    c = noise_scale_for_schedule(target_epsilon=4.0, delta=1e-5, schedule=PHASES)
    scaled = scale_noise(PHASES, c)
    assert accountant("pld").compose(scaled).epsilon(1e-5) <= 4.0
    assert accountant("pld").compose(scale_noise(PHASES, c * 0.999)).epsilon(1e-5) > 4.0
    acc = pld_acc.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.01, de.GaussianDpEvent(c * 1.0)), 2000))
    acc.compose(de.SelfComposedDpEvent(de.PoissonSampledDpEvent(0.05, de.GaussianDpEvent(c * 1.5)), 500))
    acc.compose(de.SelfComposedDpEvent(de.GaussianDpEvent(c * 20.0), 3))
    assert acc.get_epsilon(1e-5) == pytest.approx(4.0, rel=0.005)


def test_one_phase_schedule_equals_noise_for_epsilon():
    one = SelfComposedEvent(SubsampledGaussianEvent(1.0, 0.02), 300)
    c = noise_scale_for_schedule(target_epsilon=2.0, delta=1e-6, schedule=one)
    sigma = noise_for_epsilon(target_epsilon=2.0, delta=1e-6, sample_rate=0.02, steps=300)
    assert c == pytest.approx(sigma, rel=1e-4)


def test_schedule_keeps_fixed_costs_and_refuses_approximations():
    run = ComposedEvent((PHASES, EpsilonDeltaEvent(1.0, 0.0), LaplaceEvent(5.0)))
    scaled = scale_noise(run, 2.0)
    assert scaled.events[1] == EpsilonDeltaEvent(1.0, 0.0) and scaled.events[2] == LaplaceEvent(10.0)
    with pytest.raises(InvalidParameter, match="approximation"):
        noise_scale_for_schedule(target_epsilon=4.0, delta=1e-5, schedule=PHASES, accountant="gdp")
    with pytest.raises(InvalidParameter, match="no noise scale"):
        noise_scale_for_schedule(target_epsilon=0.5, delta=1e-5, schedule=run)  # the fixed spend is 1.0
    fixed = SelfComposedEvent(FixedBatchGaussianEvent(1.0, 64, 6400), 200)
    c = noise_scale_for_schedule(target_epsilon=3.0, delta=1e-5, schedule=fixed, accountant="rdp")
    assert accountant("rdp").compose(scale_noise(fixed, c)).epsilon(1e-5) <= 3.0


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 100), (3.5, [7, 16, 100]), (10.0, 1)])
def test_tree_aggregation_equals_dp_accounting_rdp(sigma, steps):
    ev = tree_aggregation_event(sigma, steps)
    acc = accountant("rdp").compose(SubsampledGaussianEvent(ev.noise_multiplier, 1.0))
    theirs = rdp_lib._compute_rdp_single_epoch_tree_aggregation(sigma, steps, list(acc.orders))
    assert acc.rdp() == pytest.approx(theirs, rel=1e-12)
    dp = rdp_lib.RdpAccountant(neighboring_relation=NR.REPLACE_SPECIAL)
    dp.compose(de.SingleEpochTreeAggregationDpEvent(sigma, steps))
    assert accountant("pld").compose(ev).epsilon(1e-6) <= dp.get_epsilon(1e-6)


def _brute_force_sensitivity(c, bands, k):
    n = c.shape[0]
    best = 0.0
    for m in range(1, k + 1):
        for pattern in itertools.combinations(range(n), m):
            if all(b - a >= bands for a, b in itertools.pairwise(pattern)):
                best = max(best, float(np.linalg.norm(c[:, list(pattern)].sum(axis=1))))
    return best


@pytest.mark.parametrize(("n", "bands", "k"), [(8, 2, 3), (9, 3, 2), (6, 1, 6)])
def test_banded_mf_sensitivity_equals_brute_force(n, bands, k):
    rng = np.random.default_rng(n * 100 + bands)
    c = np.tril(rng.uniform(0.1, 1.0, (n, n)))
    c[np.subtract.outer(np.arange(n), np.arange(n)) >= bands] = 0.0
    ev = banded_matrix_factorization_event(2.0, c, bands=bands, max_participations=k)
    assert 2.0 / ev.noise_multiplier == pytest.approx(_brute_force_sensitivity(c, bands, k), rel=1e-12)


def test_banded_mf_identity_is_dp_sgd_and_non_banded_is_refused():
    ev = banded_matrix_factorization_event(3.0, np.eye(10), bands=1, max_participations=4)
    assert ev == GaussianEvent(3.0 / 2.0)  # k = 4 full-batch steps: sqrt(4) times the sensitivity
    with pytest.raises(InvalidParameter, match="bands"):
        banded_matrix_factorization_event(1.0, np.tril(np.ones((4, 4))), bands=2, max_participations=2)
    assert math.isfinite(accountant("pld").compose(ev).epsilon(1e-6))
