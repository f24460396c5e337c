"""Numbers against the literature and against dp_accounting / prv_accountant, computed in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gaussdp.accounting import (
    EpsilonDeltaEvent,
    GaussianEvent,
    PLDAccountant,
    SubsampledGaussianEvent,
    accountant,
)
from gaussdp.accounting.rdp import DEFAULT_ORDERS, subsampled_gaussian_rdp
from gaussdp.calibration import epsilon_for_mu

dp_event = pytest.importorskip("dp_accounting.dp_event")
pld_lib = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
pld_acc_lib = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
rdp_lib = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")

# Abadi et al. 2016, MNIST: lot 256 of 60000, sigma 1.1, 60 epochs, delta 1e-5.
Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14063, 1e-5


def _default_grid():
    # The PLD accountant's grid with its default truncation (PLDAccountant(tail_mass=1e-14)).
    from gaussdp.accounting._pld_grid import Discretisation

    return Discretisation(fixed_h=None, tail_mass=1e-14)


def _default_engine():
    # The PLD accountant's FFT engine with its default allowances (tail_mass=1e-14, fft_floor=1e-13).
    from gaussdp.accounting._pld_fft import FFTEngine

    return FFTEngine(_default_grid(), fft_floor=1e-13)


def _dp_pld(sigma, q, steps, delta, h=1e-4):
    acc = pld_acc_lib.PLDAccountant(value_discretization_interval=h)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _dp_optimistic(sigma, q, steps, delta, h=1e-4):
    # dp_accounting's optimistic discretisation: a lower estimate of the true epsilon.
    pld = pld_lib.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=h, pessimistic_estimate=False
    )
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


def _dp_rdp(sigma, q, steps, delta):
    acc = rdp_lib.RdpAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def test_abadi_mnist_pld_matches_dp_accounting_and_prv():
    ours = accountant("pld").compose(SubsampledGaussianEvent(SIGMA, Q), STEPS).epsilon(DELTA)
    theirs = _dp_pld(SIGMA, Q, STEPS, DELTA)
    lower = _dp_optimistic(SIGMA, Q, STEPS, DELTA)
    assert 2.35 < ours < 2.42  # "about 2.38" (tight accounting of the setting)
    assert ours >= lower  # never below an optimistic (lower) estimate of the exact value
    assert abs(ours / theirs - 1) < 0.005
    prv = pytest.importorskip("prv_accountant")
    low, _, up = prv.Accountant(
        noise_multiplier=SIGMA, sampling_probability=Q, delta=DELTA, eps_error=0.01, max_compositions=STEPS
    ).compute_epsilon(num_compositions=STEPS)
    assert low <= ours <= up


def test_abadi_mnist_rdp_matches_dp_accounting():
    ours = accountant("rdp").compose(SubsampledGaussianEvent(SIGMA, Q), STEPS).epsilon(DELTA)
    theirs = _dp_rdp(SIGMA, Q, STEPS, DELTA)
    assert 2.55 < ours < 2.65  # "about 2.60"
    # same bound on a denser grid of orders: never looser, and not far off
    assert theirs * 0.99 < ours <= theirs * (1 + 1e-9)


@pytest.mark.parametrize("order", [2, 3, 7, 20, 64, 256, 1000])
@pytest.mark.parametrize(("sigma", "q"), [(1.1, Q), (0.8, 0.001), (2.0, 0.5)])
def test_rdp_integer_orders_equal_dp_accounting(sigma, q, order):
    ours = subsampled_gaussian_rdp(sigma, q, (float(order),))[0]
    theirs = rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, [order])[0]
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("sigma", "q", "alpha"), [(1.1, 0.004, 1.5), (0.5, 0.01, 1.01), (2.0, 0.5, 2.125)])
def test_rdp_fractional_orders_equal_high_precision_quadrature(sigma, q, alpha):
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 30
    s, qq, a = mp.mpf(sigma), mp.mpf(q), mp.mpf(alpha)

    def f(x):
        return (
            mp.exp(-x * x / (2 * s * s))
            / (mp.sqrt(2 * mp.pi) * s)
            * ((1 - qq) + qq * mp.exp((2 * x - 1) / (2 * s * s))) ** a
        )

    exact = float(mp.log(mp.quad(f, [-60, -5, 0, 0.5, 1, 5, alpha + 60])) / (a - 1))
    ours = subsampled_gaussian_rdp(sigma, q, (alpha,))[0]
    assert ours == pytest.approx(exact, rel=1e-8)


def test_default_orders_are_dense_and_not_capped_at_63():
    orders = np.asarray(DEFAULT_ORDERS)
    assert orders.min() < 1.01 and orders.max() >= 10000
    assert np.sum(orders < 2) >= 20 and np.sum((orders > 2) & (orders < 12) & (orders % 1 != 0)) >= 50


@pytest.mark.parametrize(("sigma", "q", "steps"), [(SIGMA, Q, 3000), (0.7, 0.02, 500), (2.0, 0.3, 50)])
def test_pld_never_below_a_much_finer_discretisation(sigma, q, steps):
    ev = SubsampledGaussianEvent(sigma, q)
    ours = PLDAccountant().compose(ev, steps)
    h = _default_grid().grid_h({ev: steps})
    fine = PLDAccountant(value_discretization_interval=h / 4).compose(ev, steps)
    for delta in (1e-3, 1e-5, 1e-8):
        e, ef = ours.epsilon(delta), fine.epsilon(delta)
        assert e >= ef * (1 - 1e-9)
        assert e <= ef * 1.005
    assert ours.epsilon(1e-5) >= _dp_optimistic(sigma, q, steps, 1e-5, h=h / 4)


def test_pld_numeric_gaussian_part_never_below_closed_form():
    # Gaussians mixed with a negligible subsampled step go through the FFT path, not the closed form.
    acc = PLDAccountant().compose(GaussianEvent(3.0), 10).compose(SubsampledGaussianEvent(50.0, 1e-6))
    exact = epsilon_for_mu(mu=math.sqrt(10) / 3.0, delta=1e-5)
    got = acc.epsilon(1e-5)
    assert exact <= got <= exact * 1.005


def test_pld_online_updates_the_spectrum_incrementally():
    acc = PLDAccountant()
    ev = SubsampledGaussianEvent(SIGMA, Q)
    acc.compose(ev, 1100)
    acc.epsilon(DELTA)
    n_before = acc._fft._fft_state["remove"][1]
    for _ in range(20):
        acc.compose(ev)
        acc.epsilon(DELTA)
    assert acc._fft._fft_state["remove"][1] == n_before  # same window: each step was one multiply
    batch = PLDAccountant().compose(ev, 1120).epsilon(DELTA)
    assert acc.epsilon(DELTA) == pytest.approx(batch, rel=1e-9)


GRID = [
    (0.6, 0.001, 10000),
    (0.6, 0.02, 1000),
    (1.0, 0.001, 100),
    (1.0, 0.02, 10000),
    (2.0, 0.001, 10000),
    (2.0, 0.02, 100),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sigma", "q", "steps"), GRID)
def test_pld_grid_against_dp_accounting(sigma, q, steps):
    ev = SubsampledGaussianEvent(sigma, q)
    ours = accountant("pld").compose(ev, steps).epsilon(1e-5)
    assert ours >= _dp_optimistic(sigma, q, steps, 1e-5)
    assert ours <= _dp_pld(sigma, q, steps, 1e-5) * 1.005
    rdp = accountant("rdp").compose(ev, steps).epsilon(1e-5)
    assert rdp <= _dp_rdp(sigma, q, steps, 1e-5) * (1 + 1e-9)
    assert ours <= rdp * (1 + 1e-9) or ours < 0.05


@pytest.mark.parametrize("delta", [1e-12, 1e-15, 1e-20])
def test_pld_small_delta_tilted_never_below_exact_and_tighter_than_rdp(delta):
    # Gaussians through the FFT path (with a negligible subsampled step): the closed form is exact.
    acc = PLDAccountant().compose(GaussianEvent(3.0), 10).compose(SubsampledGaussianEvent(50.0, 1e-6))
    exact = epsilon_for_mu(mu=math.sqrt(10) / 3.0, delta=delta)
    assert exact <= acc.epsilon(delta) <= exact * 1.001
    ev = SubsampledGaussianEvent(1.0, 0.01)
    ours = PLDAccountant().compose(ev, 1000)
    fine = PLDAccountant(value_discretization_interval=_default_grid().grid_h({ev: 1000}) / 4).compose(
        ev, 1000
    )
    assert fine.epsilon(delta) <= ours.epsilon(delta) <= fine.epsilon(delta) * 1.005
    assert ours.epsilon(delta) < accountant("rdp").compose(ev, 1000).epsilon(delta)


@pytest.mark.parametrize(("sigma", "q", "steps"), [(100.0, 1e-6, 10**7), (1.0, 1e-4, 10**8)])
def test_pld_never_looser_than_rdp_on_very_long_runs(sigma, q, steps):
    ev = SubsampledGaussianEvent(sigma, q)
    pld = accountant("pld").compose(ev, steps)
    rdp = accountant("rdp").compose(ev, steps)
    for delta in (1e-5, 1e-12):
        assert 0.0 < pld.epsilon(delta) <= rdp.epsilon(delta) * (1 + 1e-12)


def _mp_one_step_delta(sigma, q, eps):
    # 50-digit hockey-stick divergence of one Poisson-subsampled Gaussian step, both directions
    # (Zhu, Dong & Wang 2022, Theorem 11), written out independently of gaussdp's log-space code.
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    s, qq, e = mp.mpf(sigma), mp.mpf(q), mp.mpf(eps)
    t = mp.e**e - 1 + qq
    x = s**2 * mp.log(t / qq) + mp.mpf(1) / 2
    remove = qq * mp.ncdf((1 - x) / s) - t * mp.ncdf(-x / s)
    u = mp.e ** (-e) - 1 + qq
    add = mp.mpf(0)
    if u > 0:
        xa = s**2 * mp.log(u / qq) + mp.mpf(1) / 2
        add = mp.ncdf(xa / s) * (1 - mp.e**e * (1 - qq)) - qq * mp.e**e * mp.ncdf((xa - 1) / s)
    return max(remove, add)


@pytest.mark.parametrize(("sigma", "q"), [(SIGMA, Q), (0.8, 0.001), (2.0, 0.05), (0.6, 0.02), (5.0, 1e-6)])
def test_pld_one_step_is_the_exact_profile(sigma, q):
    # One step is answered from the exact profile: never below the 50-digit value, at most the
    # stated floating-point allowance above it, and both directions of the query agree.
    acc = PLDAccountant().compose(SubsampledGaussianEvent(sigma, q))
    for delta in (1e-3, 1e-5, 1e-10):
        eps = acc.epsilon(delta)
        exact_delta = float(_mp_one_step_delta(sigma, q, eps))
        assert exact_delta <= delta  # eps is an upper bound: the exact delta there is within budget
        if eps > 0.0:  # and tight: a little less epsilon would not do
            assert float(_mp_one_step_delta(sigma, q, eps * (1 - 1e-5))) > delta * (1 - 1e-5)
        for e in (eps, eps / 2, 2 * eps):
            got, exact = acc.delta(e), float(_mp_one_step_delta(sigma, q, e))
            assert exact <= got <= exact * (1 + 2e-6) + 1e-300
    # no looser than dp_accounting's discretisation (up to the floating-point allowance)
    assert acc.epsilon(1e-5) <= _dp_pld(sigma, q, 1, 1e-5) * (1 + 1e-6)


def test_pld_online_steps_convolve_the_checkpoint_and_agree_with_batch():
    # Online (compose one step, query): up to _ONLINE_STEPS steps are convolved with the last full
    # composition at the queried grid points. Same discrete PLD as a batch composition: the answers
    # agree to rounding and the allowances, for epsilon and delta, across the leaf's count buckets.
    from gaussdp.accounting._pld_values import Stepped

    ev = SubsampledGaussianEvent(SIGMA, Q)
    acc = PLDAccountant()
    for k in range(1, 301):
        acc.compose(ev)
        eps = acc.epsilon(DELTA)
        if k in (2, 3, 16, 17, 40, 100, 255, 256, 257, 300):
            batch = PLDAccountant().compose(ev, k)
            assert eps == pytest.approx(batch.epsilon(DELTA), rel=1e-6)
            for e in (0.5 * eps, eps, 2 * eps):
                assert acc.delta(e) == pytest.approx(batch.delta(e), rel=1e-5, abs=1e-12)
    assert isinstance(acc._fft.current(acc.counts)["remove"], Stepped)


@pytest.mark.parametrize(
    ("sigma", "q", "steps"), [(SIGMA, Q, 10), (SIGMA, Q, 100), (0.6, 0.02, 500), (2.0, 0.05, 50)]
)
def test_pld_add_direction_certificate_is_a_bound(sigma, q, steps):
    # The add direction is skipped where a Chernoff bound on its delta is already below the answer:
    # that bound is never below the composed add direction's delta, and the answers are unchanged.
    ev = SubsampledGaussianEvent(sigma, q)
    engine = _default_engine()
    composition = engine.composition({ev: steps})
    both = {d: composition[d] for d in ("remove", "add")}
    for x in (0.0, 0.1, 0.5, 1.0, 3.0):
        # (the composed delta carries the truncation and FFT allowances, which the bound needs not)
        assert engine.add_delta_bound({ev: steps}, x) >= (both["add"].delta(x) - both["add"].tail) * (
            1 - 1e-9
        )
    for delta in (1e-3, 1e-5, 1e-8):
        full = max(c.epsilon(delta) for c in both.values())
        assert PLDAccountant().compose(ev, steps).epsilon(delta) == pytest.approx(full, rel=1e-12)


def test_pld_grid_and_coarse_check_share_one_loss_spread():
    # One per-step loss variance for both the grid choice and the coarse-grid check. An (epsilon,
    # delta) event's losses are +-epsilon: it counts epsilon^2 per step (the grid is sized for it, so
    # a composition of such events alone is never "coarse"; a copy that left it out called every
    # such grid coarse, comparing h with a spread of zero).
    from gaussdp.accounting._pld_grid import loss_mu2

    assert loss_mu2({EpsilonDeltaEvent(0.5): 4}) == pytest.approx(1.0)
    assert loss_mu2({EpsilonDeltaEvent(0.5): 4, GaussianEvent(2.0): 3}) == pytest.approx(1.75)
    for counts in ({EpsilonDeltaEvent(1.0): 10}, {EpsilonDeltaEvent(0.3, 1e-6): 5, GaussianEvent(1.0): 2}):
        assert not _default_grid().is_coarse(counts)
    assert not _default_grid().is_coarse({SubsampledGaussianEvent(1.0, 0.01): 1000})
