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
from gaussdp.calibration import epsilon_for
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
def test_one_tree_per_record_equals_dp_accounting_rdp(sigma, steps):
    ev = tree_aggregation_event(sigma, steps, trees_per_record=1)
    acc = accountant("rdp").compose(SubsampledGaussianEvent(ev.noise_multiplier, 1.0))
    theirs = rdp_lib._compute_rdp_single_epoch_tree_aggregation(sigma, steps, list(acc.orders))
    assert acc.rdp() == pytest.approx(theirs, rel=1e-12)
    assert np.all(
        np.asarray(acc.rdp()) >= np.asarray(theirs)
    )  # our noise multiplier is rounded down, never up
    dp = rdp_lib.RdpAccountant(neighboring_relation=NR.REPLACE_SPECIAL)
    dp.compose(de.SingleEpochTreeAggregationDpEvent(sigma, steps))
    assert accountant("pld").compose(ev).epsilon(1e-6) <= dp.get_epsilon(1e-6)


def _tree_matrix(leaves):
    """The 0/1 matrix of one online tree over ``leaves`` steps: a row per dyadic node complete by the
    last step (``[k 2^j, (k + 1) 2^j)``), a column per leaf."""
    rows = []
    size = 1
    while size <= leaves:
        for start in range(0, leaves - size + 1, size):
            row = np.zeros(leaves)
            row[start : start + size] = 1.0
            rows.append(row)
        size *= 2
    return np.array(rows)


def _tree_brute_force_sensitivity(leaves_per_tree, trees_per_record):
    """Worst L2 change of every node of every tree (a block-diagonal matrix, one block per tree) over
    all participation patterns of one record: up to ``trees_per_record`` trees, one leaf in each,
    contribution +1 or -1 (a scalar clipped to norm 1)."""
    blocks = [_tree_matrix(t) for t in leaves_per_tree]
    a = np.zeros((sum(b.shape[0] for b in blocks), sum(leaves_per_tree)))
    r = c = 0
    cols = []
    for blk in blocks:
        a[r : r + blk.shape[0], c : c + blk.shape[1]] = blk
        cols.append(range(c, c + blk.shape[1]))
        r, c = r + blk.shape[0], c + blk.shape[1]
    best = 0.0
    for m in range(1, trees_per_record + 1):
        for trees in itertools.combinations(range(len(blocks)), m):
            for leaves in itertools.product(*(cols[i] for i in trees)):
                for signs in itertools.product((1.0, -1.0), repeat=m):
                    u = np.zeros(a.shape[1])
                    u[list(leaves)] = signs
                    best = max(best, float(np.linalg.norm(a @ u)))
    return best


@pytest.mark.parametrize(
    ("leaves", "per_record"), [([5, 5, 5], 3), ([7, 3, 8], 2), ([1, 4, 6, 2], 4), ([9], 1), ([3, 16], 1)]
)
def test_tree_aggregation_sensitivity_equals_brute_force(leaves, per_record):
    ev = tree_aggregation_event(2.0, leaves, trees_per_record=per_record)
    sens = _tree_brute_force_sensitivity(leaves, per_record)
    assert 2.0 / ev.noise_multiplier == pytest.approx(sens, rel=1e-12)
    assert ev.noise_multiplier <= 2.0 / sens  # rounded the safe way
    if len(set(leaves)) == 1:  # an int: every tree that long
        assert tree_aggregation_event(2.0, leaves[0], trees_per_record=per_record) == ev


def test_ten_epochs_over_the_same_data_compose_ten_trees():
    # The case: 10 epochs of 1000 steps, each record in every tree (restarted every epoch).
    ten = tree_aggregation_event(5.0, [1000] * 10, trees_per_record=10)
    one = tree_aggregation_event(5.0, 1000, trees_per_record=1)
    eps_ten = accountant("pld").compose(ten).epsilon(1e-5)
    eps_composed = accountant("pld").compose(one, count=10).epsilon(1e-5)
    assert eps_ten == pytest.approx(eps_composed, rel=1e-9)
    assert eps_ten == pytest.approx(epsilon_for(sigma=5.0 / math.sqrt(10 * 10), delta=1e-5), rel=1e-9)
    assert 9.9 < eps_ten < 10.1  # not the 2.59 of one tree
    assert accountant("pld").compose(one).epsilon(1e-5) == pytest.approx(2.594, abs=1e-3)
    # the largest trees are the ones a record is charged for when it is in fewer than all
    mixed = tree_aggregation_event(1.0, [1, 1000, 3], trees_per_record=2)
    assert mixed.noise_multiplier == pytest.approx(1.0 / math.sqrt(10 + 2), rel=1e-15)


def test_tree_aggregation_participation_is_required_and_checked():
    with pytest.raises(TypeError, match="trees_per_record"):
        tree_aggregation_event(5.0, [1000] * 10)  # type: ignore[call-arg]
    with pytest.raises(InvalidParameter, match="trees_per_record"):
        tree_aggregation_event(5.0, [1000] * 10, trees_per_record=11)
    with pytest.raises(InvalidParameter, match="trees_per_record"):
        tree_aggregation_event(5.0, 1000, trees_per_record=0)
    with pytest.raises(TypeError, match="trees_per_record"):
        tree_aggregation_event(5.0, 1000, trees_per_record=True)
    with pytest.raises(InvalidParameter, match="steps_per_tree"):
        tree_aggregation_event(5.0, [], trees_per_record=1)
    with pytest.raises(TypeError, match="steps_per_tree"):
        tree_aggregation_event(5.0, "1000", trees_per_record=1)
    with pytest.raises(InvalidParameter, match="noise_multiplier"):
        tree_aggregation_event(float("nan"), 1000, trees_per_record=1)
    # depth from integers, exact past 2**53 (a float log2 would round 2**60 down to 60 levels)
    assert tree_aggregation_event(1.0, 2**60, trees_per_record=1).noise_multiplier < 1.0 / math.sqrt(61)


def _banded(rng, n, bands, low=0.1):
    c = np.tril(rng.uniform(low, 1.0, (n, n)))
    c[np.subtract.outer(np.arange(n), np.arange(n)) >= bands] = 0.0
    return c


def _banded_brute_force_sensitivity(c, min_separation, k):
    """Worst ``||C u||`` over every participation pattern of one scalar record: at most ``k`` steps,
    ``min_separation`` apart, each contribution +1 or -1 (the extreme points of [-1, 1])."""
    n = c.shape[0]
    best = 0.0
    for m in range(1, k + 1):
        for pattern in itertools.combinations(range(n), m):
            if all(b - a >= min_separation for a, b in itertools.pairwise(pattern)):
                for signs in itertools.product((1.0, -1.0), repeat=m):
                    best = max(best, float(np.linalg.norm(c[:, list(pattern)] @ np.array(signs))))
    return best


# (n, bands, min_separation, k): separated (sep >= bands), overlapping (sep < bands), full matrix
CASES = [(8, 2, 3, 3), (9, 3, 3, 2), (6, 1, 1, 6), (8, 3, 1, 3), (8, 3, 2, 4), (9, 4, 2, 3), (7, 7, 1, 7)]


@pytest.mark.parametrize(("n", "bands", "sep", "k"), CASES)
def test_banded_mf_sensitivity_equals_brute_force(n, bands, sep, k):
    c = _banded(np.random.default_rng(n * 100 + bands * 10 + sep), n, bands)
    ev = banded_matrix_factorization_event(2.0, c, bands=bands, min_separation=sep, max_participations=k)
    # C >= 0, so G = C^T C >= 0 and the worst vector-valued record is a scalar one: exact
    brute = _banded_brute_force_sensitivity(c, sep, k)
    assert 2.0 / ev.noise_multiplier == pytest.approx(brute, rel=1e-12)
    assert 2.0 / ev.noise_multiplier >= brute  # the rounding margins go the safe way


def test_banded_mf_with_signs_is_an_upper_bound_over_vector_records():
    rng = np.random.default_rng(7)
    for _ in range(3):
        c = _banded(rng, 7, 3, low=-1.0)
        ev = banded_matrix_factorization_event(1.0, c, bands=3, min_separation=1, max_participations=3)
        assert 1.0 / ev.noise_multiplier >= _banded_brute_force_sensitivity(c, 1, 3)
    # Columns at obtuse angles: no scalar record reaches what vector-valued ones do (6.33 > 6 in
    # squared norm); the event charges sum |C^T C| = 8, above both.
    c = np.array([[1.0, 0.0, 0.0], [1.0, -1.0, 0.0], [-0.5, -0.5, 1.0]])
    sens = (
        1.0
        / banded_matrix_factorization_event(
            1.0, c, bands=3, min_separation=1, max_participations=3
        ).noise_multiplier
    )
    assert _banded_brute_force_sensitivity(c, 1, 3) ** 2 == pytest.approx(6.0)
    worst = 0.0
    for _ in range(3000):
        g = rng.standard_normal((3, 3))
        g /= np.linalg.norm(g, axis=1, keepdims=True)  # one unit gradient per step
        worst = max(worst, float(np.linalg.norm(c @ g)))
    assert 6.0 < worst**2 <= sens**2 and sens**2 == pytest.approx(8.0)


def test_banded_mf_upper_bound_when_the_exact_search_is_too_large(monkeypatch):
    import gaussdp.accounting._schedule as schedule

    rng = np.random.default_rng(3)
    for n, bands, sep, k in [(8, 3, 1, 3), (9, 4, 2, 3), (7, 7, 1, 7)]:
        c = _banded(rng, n, bands)
        exact = banded_matrix_factorization_event(
            1.0, c, bands=bands, min_separation=sep, max_participations=k
        )
        monkeypatch.setattr(schedule, "_WORK_LIMIT", 10)
        bound = banded_matrix_factorization_event(
            1.0, c, bands=bands, min_separation=sep, max_participations=k
        )
        monkeypatch.undo()
        assert bound.noise_multiplier <= exact.noise_multiplier  # Algorithm 4: never below the truth
        assert 1.0 / bound.noise_multiplier >= _banded_brute_force_sensitivity(c, sep, k)
    # prefix sums (DP-FTRL without a tree) over 10 fixed-order epochs of 100 steps: exact again
    c = np.tril(np.ones((1000, 1000)))
    ev = banded_matrix_factorization_event(1.0, c, bands=1000, min_separation=100, max_participations=10)
    cyclic = c[:, ::100].sum(axis=1)
    assert 1.0 / ev.noise_multiplier == pytest.approx(float(np.linalg.norm(cyclic)), rel=1e-10)
    assert 1.0 / ev.noise_multiplier >= float(np.linalg.norm(cyclic))
    with pytest.raises(InvalidParameter, match="min_separation"):
        banded_matrix_factorization_event(1.0, c, bands=1000, min_separation=1, max_participations=1000)


def test_banded_mf_participation_is_required_and_the_separation_is_not_assumed():
    ev = banded_matrix_factorization_event(3.0, np.eye(10), bands=1, min_separation=1, max_participations=4)
    assert ev.noise_multiplier == pytest.approx(3.0 / 2.0, rel=1e-15)  # 4 full-batch steps
    assert ev.noise_multiplier < 3.0 / 2.0
    with pytest.raises(TypeError, match="min_separation"):
        banded_matrix_factorization_event(3.0, np.eye(10), bands=1, max_participations=4)  # type: ignore[call-arg]
    with pytest.raises(InvalidParameter, match="bands"):
        banded_matrix_factorization_event(
            1.0, np.tril(np.ones((4, 4))), bands=2, min_separation=2, max_participations=2
        )
    # two bands, participations one step apart: the old rule (steps `bands` apart) charged sqrt(2)
    c = np.eye(6) + np.eye(6, k=-1)
    ev = banded_matrix_factorization_event(1.0, c, bands=2, min_separation=1, max_participations=2)
    brute = _banded_brute_force_sensitivity(c, 1, 2)
    assert brute > math.sqrt(2 * 2) * 1.1 and 1.0 / ev.noise_multiplier == pytest.approx(brute, rel=1e-12)
    assert math.isfinite(accountant("pld").compose(ev).epsilon(1e-6))


def test_docstring_examples():
    import doctest

    import gaussdp.accounting._schedule as schedule

    result = doctest.testmod(schedule, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 3
