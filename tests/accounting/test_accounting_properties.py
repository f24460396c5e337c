"""Invariants (hypothesis), the exports, and PLD on (epsilon, delta) events against the exact formula."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gaussdp.accounting as acc_pkg
from gaussdp.accounting import EpsilonDeltaEvent, SubsampledGaussianEvent, accountant
from gaussdp.accounting._profiles import subsampled_delta
from gaussdp.calibration import delta_for_mu

sigmas = st.floats(min_value=0.3, max_value=20.0)
rates = st.floats(min_value=1e-5, max_value=1.0)
epsilons = st.floats(min_value=0.0, max_value=50.0)


@settings(max_examples=200, deadline=None)
@given(sigma=sigmas, q=rates, e1=epsilons, e2=epsilons)
def test_subsampled_profile_is_monotone_and_amplifies(sigma, q, e1, e2):
    lo, hi = sorted((e1, e2))
    d_lo, d_hi = subsampled_delta(sigma, q, lo), subsampled_delta(sigma, q, hi)
    assert 0.0 <= d_hi <= d_lo * (1 + 1e-9) + 1e-300 <= 1.0 + 1e-12
    # subsampling never hurts: at most the delta of the full Gaussian release
    assert d_lo <= delta_for_mu(mu=1.0 / sigma, epsilon=lo) * (1 + 1e-9) + 1e-300


@settings(max_examples=8, deadline=None)
@given(sigma=sigmas, q=rates, k=st.integers(1, 500))
def test_rdp_monotone_in_count_and_in_noise(sigma, q, k):
    ev = SubsampledGaussianEvent(sigma, q)
    e1 = accountant("rdp").compose(ev, k).epsilon(1e-5)
    assert e1 <= accountant("rdp").compose(ev, k + 1).epsilon(1e-5) * (1 + 1e-12)
    assert accountant("rdp").compose(SubsampledGaussianEvent(sigma * 1.5, q), k).epsilon(1e-5) <= e1 * (
        1 + 1e-12
    )


def test_exports_match_all():
    public = {n for n in dir(acc_pkg) if not n.startswith("_")}
    modules = {
        "advanced",
        "base",
        "basic",
        "events",
        "gdp",
        "inverse",
        "pld",
        "rdp",
        "registry",
        "run_budget",
        "annotations",
    }
    assert set(acc_pkg.__all__) == public - modules
    assert acc_pkg.__all__ == sorted(acc_pkg.__all__, key=str)


def _optimal_composition_delta(eps: float, k: int, eps_total: float) -> float:
    # k-fold eps-DP randomized response: the privacy loss is (k - 2i) eps with probability
    # C(k, i) p^(k-i) (1-p)^i, p = e^eps / (1 + e^eps); delta = E[(1 - e^(eps_total - L))_+]
    # (Kairouz, Oh & Viswanath 2015: the exact optimal composition).
    p = math.exp(eps) / (1 + math.exp(eps))
    total = 0.0
    for i in range(k + 1):
        loss = (k - 2 * i) * eps
        if loss > eps_total:
            total += math.comb(k, i) * p ** (k - i) * (1 - p) ** i * -math.expm1(eps_total - loss)
    return total


@pytest.mark.parametrize(("eps", "k"), [(0.5, 10), (0.1, 50), (1.0, 3)])
def test_pld_of_pure_dp_events_is_the_optimal_composition(eps, k):
    acc = accountant("pld").compose(EpsilonDeltaEvent(eps), k)
    # midway between two atoms (k - 2i) eps of the loss, where delta does not jump
    for eps_total in ((k - 2 * (k // 4) - 1) * eps, (k - 2 * (k // 8) - 1) * eps):
        exact = _optimal_composition_delta(eps, k, eps_total)
        got = acc.delta(eps_total)
        assert got >= exact * (1 - 1e-9)
        assert got <= exact * 1.01 + 1e-12
    assert acc.epsilon(1e-6) <= accountant("advanced").compose(EpsilonDeltaEvent(eps), k).epsilon(1e-6)


def test_pld_fft_composition_matches_direct_convolution():
    # The FFT (power of the spectrum, circular window, clipping, allowances) against plain direct
    # convolution of the same discrete PLD: never below it, and only the stated allowances above.
    import numpy as np

    from gaussdp.accounting._pld_fft import FFTEngine
    from gaussdp.accounting._pld_grid import Discretisation

    ev, k = SubsampledGaussianEvent(1.0, 0.05), 4
    grid = Discretisation(fixed_h=2e-3, tail_mass=1e-14)  # PLDAccountant's default truncation
    composition = FFTEngine(grid, fft_floor=1e-13).composition({ev: k})
    for direction in ("remove", "add"):
        composed = composition[direction]
        leaf = grid.leaf_pmf(ev, k, direction, composed.h)
        direct = leaf.pmf
        for _ in range(k - 1):
            direct = np.convolve(direct, leaf.pmf)
        losses = (k * leaf.start + np.arange(len(direct))) * composed.h
        inf_mass = -math.expm1(k * leaf.log_finite_mass)
        for eps in (0.0, 0.5, 1.0, 2.0, 3.0):
            exact = inf_mass + float(np.sum(direct * np.maximum(0.0, -np.expm1(eps - losses))))
            got = composed.delta(eps)
            # above it only by the allowances and by lower-tail mass wrapped to the top (conservative)
            assert exact <= got <= exact * (1 + 1e-4) + 2 * composed.tail + 1e-15, (direction, eps)
