"""Adaptive clipping (Andrew et al. 2021): the noise split, its accounting, convergence to the quantile."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gaussdp.accounting import GaussianEvent, accountant
from gaussdp.errors import InvalidParameter
from gaussdp.federated import AdaptiveClipping, DPFedAvg, effective_noise_multiplier

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")


def test_effective_noise_multiplier_formula() -> None:
    # z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), by hand for z = 1, sigma_b = 1: (1 - 1/4)^(-1/2).
    assert effective_noise_multiplier(1.0, 1.0) == pytest.approx(1 / math.sqrt(0.75))
    assert effective_noise_multiplier(0.8, 5.0) == pytest.approx((0.8**-2 - 10.0**-2) ** -0.5)
    with pytest.raises(InvalidParameter, match="count_stddev must be > 1/"):
        effective_noise_multiplier(1.0, 0.5)


@pytest.mark.parametrize("z, sigma_b", [(1.0, 1.0), (0.7, 3.0)])
def test_sum_and_count_together_cost_one_gaussian_of_multiplier_z(z: float, sigma_b: float) -> None:
    # Two Gaussian releases (the sum with z_Delta, the centred count with sensitivity 1/2 and noise
    # sigma_b, i.e. multiplier 2 sigma_b) compose exactly into one Gaussian of multiplier z: check it
    # with the accounting layer's PLD accountant, independently of the formula's derivation.
    zd = effective_noise_multiplier(z, sigma_b)
    both = accountant("pld").compose(GaussianEvent(zd)).compose(GaussianEvent(2 * sigma_b)).epsilon(1e-5)
    one = accountant("pld").compose(GaussianEvent(z)).epsilon(1e-5)
    assert both == pytest.approx(one, rel=2e-3)


def test_adaptive_server_uses_the_split_and_charges_z() -> None:
    ad = AdaptiveClipping(initial_clip_norm=0.5, target_quantile=0.5, count_stddev=2.0)
    srv = DPFedAvg(
        num_clients=10,
        sample_rate=1.0,
        noise_multiplier=1.0,
        adaptive=ad,
        ledger="memory://",
        epsilon=100.0,
        delta=1e-5,
        accountant="rdp",
        noise="fast",
        seed=0,
    )
    assert srv.sum_noise_multiplier == pytest.approx(effective_noise_multiplier(1.0, 2.0))
    assert srv.event == GaussianEvent(1.0)
    res = srv.run_round(np.zeros(3), lambda g, ids: np.ones((ids.size, 3)))
    assert res.noise_stddev == pytest.approx(srv.sum_noise_multiplier * 0.5)
    assert res.next_clip_norm != res.clip_norm


@pytest.mark.parametrize("target", [0.5, 0.8])
def test_adaptive_clipping_converges_to_the_target_quantile(target: float) -> None:
    n, q = 2000, 0.5
    rng = np.random.default_rng(4)
    norms = rng.lognormal(mean=0.0, sigma=1.0, size=n)  # the clients' (fixed) update norms
    dirs = rng.normal(size=(n, 4))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    updates = dirs * norms[:, None]
    m = q * n
    ad = AdaptiveClipping(
        initial_clip_norm=0.05, target_quantile=target, learning_rate=0.2, count_stddev=m / 20
    )
    srv = DPFedAvg(
        num_clients=n,
        sample_rate=q,
        noise_multiplier=1.0,
        adaptive=ad,
        ledger="memory://",
        epsilon=1e4,
        delta=1e-6,
        accountant="rdp",
        noise="fast",
        seed=9,
    )
    trace = []
    for _ in range(120):
        res = srv.run_round(np.zeros(4), lambda g, ids: updates[ids])
        trace.append(res.next_clip_norm)
    c_final = float(np.median(trace[-40:]))
    achieved = float(np.mean(norms <= c_final))
    # The noisy estimate of the quantile has stddev sigma_b/m = 0.05 per round and the geometric
    # step averages it out; the population quantile is reached to within 0.05.
    assert abs(achieved - target) < 0.05, (target, achieved, c_final)
    assert c_final == pytest.approx(float(np.quantile(norms, target)), rel=0.25)


def test_adaptive_parameters_are_validated() -> None:
    with pytest.raises(InvalidParameter, match="target_quantile"):
        AdaptiveClipping(initial_clip_norm=1.0, target_quantile=1.0)
    with pytest.raises(InvalidParameter, match="initial_clip_norm"):
        AdaptiveClipping(initial_clip_norm=-1.0)
