"""Fixed-size batches, replace-one Poisson steps and Laplace releases against dp_accounting and mpmath.

Every reference value is computed in the test: by dp_accounting (which has the event), or by
50-digit mpmath quadrature of the hockey-stick divergence of the event's dominating pair.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gaussdp.accounting import (
    ComposedEvent,
    DiscreteGaussianEvent,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    PLDAccountant,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
    ReplaceOneSubsampledGaussianEvent,
    SubsampledGaussianEvent,
    accountant,
    event_from_dict,
    neighboring_relation_of,
)
from gaussdp.accounting._mechanisms import fixed_batch_gaussian_rdp, laplace_rdp, leaf_log_delta, leaf_rdp
from gaussdp.calibration import epsilon_for_mu
from gaussdp.errors import InvalidParameter

dp_event = pytest.importorskip("dp_accounting.dp_event")
pld_lib = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
pld_acc_lib = pytest.importorskip("dp_accounting.pld.pld_privacy_accountant")
rdp_lib = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")
NR = pytest.importorskip("dp_accounting.privacy_accountant").NeighboringRelation
mp = pytest.importorskip("mpmath")

Q, SIGMA, STEPS = 256 / 60000, 1.1, 14063  # Abadi et al. 2016, MNIST


def _dp_rdp_wor(sigma, batch, n, steps, delta):
    acc = rdp_lib.RdpAccountant(neighboring_relation=NR.REPLACE_ONE)
    # dp_accounting's noise multiplier is relative to the replace-one sensitivity, 2 clip norms.
    acc.compose(
        dp_event.SampledWithoutReplacementDpEvent(n, batch, dp_event.GaussianDpEvent(sigma / 2)), steps
    )
    return acc.get_epsilon(delta)


def _dp_optimistic_poisson(sigma, q, steps, delta, h=1e-4):
    pld = pld_lib.from_gaussian_mechanism(
        sigma,
        sampling_prob=q,
        value_discretization_interval=h,
        pessimistic_estimate=False,
        use_connect_dots=False,
    )
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


def _mp_hockey_stick(p, q, eps, cuts):
    """50-digit H_{e^eps}(P||Q) for densities p, q on the real line with a monotone ratio p/q.

    The crossing of p and e^eps q inside [cuts[0], cuts[-1]] is found by bisection on
    log p - log q - eps and added to the integration's break points with the given kinks.
    """
    mp.mp.dps = 50
    a = mp.exp(mp.mpf(eps))

    def g(z):
        return mp.log(p(z)) - mp.log(q(z)) - mp.mpf(eps)

    lo, hi = mp.mpf(cuts[0]), mp.mpf(cuts[-1])
    pts = set(map(mp.mpf, cuts))
    if g(lo) * g(hi) < 0:
        for _ in range(200):
            mid = (lo + hi) / 2
            if g(mid) * g(lo) > 0:
                lo = mid
            else:
                hi = mid
        pts.add((lo + hi) / 2)
    return float(mp.quad(lambda z: max(p(z) - a * q(z), 0), [-mp.inf, *sorted(pts), mp.inf]))


# ----- fixed-size batches (sampling without replacement, replace-one) ---------------------------


@pytest.mark.parametrize(
    ("sigma", "batch", "n", "steps"), [(1.0, 256, 60000, 1000), (2.0, 100, 1000, 100), (0.8, 32, 3200, 500)]
)
def test_fixed_batch_rdp_equals_dp_accounting(sigma, batch, n, steps):
    ev = FixedBatchGaussianEvent(sigma, batch, n)
    for delta in (1e-5, 1e-8):
        ours = accountant("rdp").compose(ev, steps).epsilon(delta)
        theirs = _dp_rdp_wor(sigma, batch, n, steps, delta)
        # the same Theorem 27 bound on a superset of dp_accounting's orders: never looser
        assert theirs * 0.98 < ours <= theirs * (1 + 1e-9)


@pytest.mark.parametrize("order", [2.0, 3.0, 5.5, 20.0, 64.0, 256.0, 1000.0])
@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (0.7, 0.1), (3.0, 0.001)])
def test_fixed_batch_rdp_orders_equal_dp_accounting(sigma, q, order):
    ours = fixed_batch_gaussian_rdp(2 * sigma, 1, round(1 / q), [order])[0]
    theirs = rdp_lib._compute_rdp_sample_wor_gaussian(q, sigma, [order])[0]
    assert ours == pytest.approx(theirs, rel=1e-9)


@pytest.mark.parametrize(
    ("sigma", "batch", "n", "steps"), [(1.0, 256, 60000, 1000), (2.0, 100, 1000, 100), (0.8, 32, 3200, 500)]
)
def test_fixed_batch_pld_between_worst_case_dataset_and_rdp(sigma, batch, n, steps):
    ours = accountant("pld").compose(FixedBatchGaussianEvent(sigma, batch, n), steps).epsilon(1e-5)
    # Lower bound: a dataset whose other records all equal the replacing one makes each step the
    # Poisson add/remove pair of noise sigma/2 at rate b/n (shift of 2 clip norms), composed.
    lower = _dp_optimistic_poisson(sigma / 2, batch / n, steps, 1e-5)
    upper = _dp_rdp_wor(sigma, batch, n, steps, 1e-5)
    assert lower <= ours < upper
    assert ours < lower * 1.15  # the symmetrisation costs 5-11% here, not a factor


@pytest.mark.parametrize(("sigma", "batch", "n"), [(1.0, 64, 1000), (0.6, 10, 50)])
def test_fixed_batch_one_step_profile_matches_mpmath(sigma, batch, n):
    ev = FixedBatchGaussianEvent(sigma, batch, n)
    g, s = batch / n, mp.mpf(sigma) / 2
    phi = lambda z, m: mp.npdf(z, m, s)  # noqa: E731
    for eps in (0.1, 0.7, 2.0):
        remove = _mp_hockey_stick(
            lambda z: (1 - g) * phi(z, 0) + g * phi(z, 1), lambda z: phi(z, 0), eps, [-1, 2, 6]
        )
        add = _mp_hockey_stick(
            lambda z: phi(z, 0), lambda z: (1 - g) * phi(z, 0) + g * phi(z, 1), eps, [-6, -2, 1]
        )
        exact = max(remove, add)
        assert math.exp(leaf_log_delta(ev, eps)[0]) == pytest.approx(exact, rel=1e-9)
        got = PLDAccountant().compose(ev).delta(eps)
        assert exact <= got <= exact * 1.01 + 1e-12


def test_fixed_batch_full_batch_is_a_gaussian_with_twice_the_sensitivity():
    got = accountant("pld").compose(FixedBatchGaussianEvent(2.0, 100, 100), 10).epsilon(1e-5)
    exact = epsilon_for_mu(mu=math.sqrt(10) * 2 / 2.0, delta=1e-5)
    assert exact <= got <= exact * 1.005


def test_fixed_batch_validates_and_round_trips():
    with pytest.raises(InvalidParameter, match="batch_size"):
        FixedBatchGaussianEvent(1.0, 11, 10)
    with pytest.raises(TypeError):
        FixedBatchGaussianEvent(1.0, 2.5, 10)
    ev = FixedBatchGaussianEvent(1.0, 64, 1000)
    assert event_from_dict(ev.to_dict()) == ev
    assert ev.sample_rate == 0.064


@pytest.mark.parametrize("name", ["pld", "rdp", "basic", "advanced"])
def test_relations_do_not_mix(name):
    acc = accountant(name).compose(FixedBatchGaussianEvent(1.0, 64, 1000), 3)
    assert acc.neighboring_relation == "replace_one"
    with pytest.raises(InvalidParameter, match="replace_one"):
        acc.compose(SubsampledGaussianEvent(1.0, 0.01))
    assert not acc.supports(SubsampledGaussianEvent(1.0, 0.01))
    assert acc.steps == 3  # nothing composed by the refused call
    acc.compose(GaussianEvent(4.0))  # relation-free events compose with either
    with pytest.raises(InvalidParameter, match="mixes"):
        neighboring_relation_of(
            ComposedEvent((SubsampledGaussianEvent(1.0, 0.01), FixedBatchGaussianEvent(1.0, 1, 10)))
        )


# ----- replace-one Poisson-subsampled Gaussian ------------------------------------------------------


def test_replace_one_abadi_matches_dp_accounting():
    ev = ReplaceOneSubsampledGaussianEvent(SIGMA, Q)
    ours = accountant("pld").compose(ev, STEPS).epsilon(1e-5)
    acc = pld_acc_lib.PLDAccountant(NR.REPLACE_ONE, value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(SIGMA)), STEPS)
    theirs = acc.get_epsilon(1e-5)
    optimistic = (
        pld_lib.from_gaussian_mechanism(
            SIGMA,
            sampling_prob=Q,
            neighboring_relation=NR.REPLACE_ONE,
            value_discretization_interval=1e-4,
            pessimistic_estimate=False,
            use_connect_dots=False,
        )
        .self_compose(STEPS)
        .get_epsilon_for_delta(1e-5)
    )
    assert optimistic <= ours <= theirs * 1.005
    # far below halving the noise multiplier of the add/remove event (issue 17: 14.74)
    assert ours < 0.5 * accountant("pld").compose(SubsampledGaussianEvent(SIGMA / 2, Q), STEPS).epsilon(1e-5)


@pytest.mark.parametrize(("sigma", "q"), [(1.1, 0.01), (0.5, 0.2), (3.0, 0.5)])
def test_replace_one_profile_matches_mpmath(sigma, q):
    ev = ReplaceOneSubsampledGaussianEvent(sigma, q)
    s = mp.mpf(sigma)
    p = lambda z: (1 - q) * mp.npdf(z, 0, s) + q * mp.npdf(z, -1, s)  # noqa: E731
    r = lambda z: (1 - q) * mp.npdf(z, 0, s) + q * mp.npdf(z, 1, s)  # noqa: E731
    for eps in (0.0, 0.05, 0.5, 2.0):
        exact = _mp_hockey_stick(p, r, eps, [-8 * sigma - 2, -1, 8 * sigma])
        assert math.exp(leaf_log_delta(ev, eps)[0]) == pytest.approx(exact, rel=1e-9)
        # negative epsilon (orders below 1), used by the composition: the reversed order of the pair
        assert math.exp(leaf_log_delta(ev, -eps)[0]) == pytest.approx(
            _mp_hockey_stick(r, p, -eps, [-8 * sigma, 1, 8 * sigma + 2]), rel=1e-9
        )


def test_replace_one_antipodal_pair_dominates_other_replacements():
    # The pair bounds every replacement x -> x' with |x|, |x'| <= 1, not just x' = -x: checked on a 2-D
    # grid (the plane of 0, x, x') at orders below and above 1, to the grid's accuracy.
    s, q = 0.7, 0.3
    g = np.linspace(-8 * s - 2, 8 * s + 2, 700)
    d = g[1] - g[0]
    xx, yy = np.meshgrid(g, g)

    def mix(m):
        n0 = np.exp(-(xx**2 + yy**2) / (2 * s * s))
        return ((1 - q) * n0 + q * np.exp(-((xx - m[0]) ** 2 + (yy - m[1]) ** 2) / (2 * s * s))) / (
            2 * np.pi * s * s
        )

    pm, pp = mix((-1, 0)), mix((1, 0))
    configs = [
        ((1, 0), (0, 1)),
        ((1, 0), (0, 0)),
        ((0, 0), (1, 0)),
        ((0.5, 0), (-1, 0)),
        ((0.6, 0.8), (-0.6, 0.8)),
    ]
    others = [(mix(x), mix(y)) for x, y in configs]
    for a in np.exp(np.linspace(-2.5, 2.5, 11)):
        ref = np.sum(np.maximum(pm - a * pp, 0)) * d * d
        for p1, p2 in others:
            assert np.sum(np.maximum(p1 - a * p2, 0)) * d * d <= ref + 1e-7


def test_replace_one_full_sampling_is_a_gaussian():
    got = accountant("pld").compose(ReplaceOneSubsampledGaussianEvent(3.0, 1.0), 4).epsilon(1e-6)
    exact = epsilon_for_mu(mu=2 * 2 / 3.0, delta=1e-6)
    assert exact <= got <= exact * 1.005
    assert accountant("rdp").compose(ReplaceOneSubsampledGaussianEvent(3.0, 1.0), 4).epsilon(1e-6) >= exact


@pytest.mark.parametrize(
    ("sigma", "q", "alpha"), [(1.1, 0.01, 2.0), (0.5, 0.2, 1.5), (3.0, 0.5, 20.0), (0.8, 0.05, 64.0)]
)
def test_replace_one_rdp_matches_mpmath_quadrature(sigma, q, alpha):
    mp.mp.dps = 50
    s = mp.mpf(sigma)
    p = lambda z: (1 - q) * mp.npdf(z, 0, s) + q * mp.npdf(z, -1, s)  # noqa: E731
    r = lambda z: (1 - q) * mp.npdf(z, 0, s) + q * mp.npdf(z, 1, s)  # noqa: E731
    cuts = [-mp.inf, -alpha / sigma**2 - 20 * sigma, -5, -1, 0, 1, 5, mp.inf]
    exact = float(mp.log(mp.quad(lambda z: p(z) ** alpha * r(z) ** (1 - alpha), cuts)) / (alpha - 1))
    got = leaf_rdp(ReplaceOneSubsampledGaussianEvent(sigma, q), np.asarray([alpha]))
    assert got is not None and got[0] == pytest.approx(exact, rel=1e-8)


def test_replace_one_rdp_is_above_pld():
    ev = ReplaceOneSubsampledGaussianEvent(SIGMA, Q)
    rdp = accountant("rdp").compose(ev, STEPS).epsilon(1e-5)
    pld = accountant("pld").compose(ev, STEPS).epsilon(1e-5)
    assert pld <= rdp <= pld * 1.15


# ----- Laplace -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "count"), [(1.0, 1), (2.0, 10), (10.0, 100), (0.5, 3)])
def test_laplace_pld_matches_dp_accounting(scale, count):
    acc = pld_acc_lib.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.LaplaceDpEvent(scale), count)
    for delta in (1e-3, 1e-6):
        ours = accountant("pld").compose(LaplaceEvent(scale), count).epsilon(delta)
        theirs = acc.get_epsilon(delta)
        assert theirs * 0.999 <= ours <= theirs * 1.003
        if count == 1:  # exact: 1 - exp((eps - eps0)/2) = delta
            exact = 1 / scale + 2 * math.log1p(-delta)
            assert exact <= ours <= exact * 1.001


def test_laplace_profile_matches_mpmath():
    b = mp.mpf(0.8)
    p = lambda z: mp.exp(-abs(z) / b) / (2 * b)  # noqa: E731
    r = lambda z: mp.exp(-abs(z - 1) / b) / (2 * b)  # noqa: E731
    ev = LaplaceEvent(scale=0.8)
    for eps in (0.0, 0.3, 1.0):
        exact = _mp_hockey_stick(p, r, eps, [-5, 0, 0.4, 1, 6])
        assert math.exp(leaf_log_delta(ev, eps)[0]) == pytest.approx(exact, rel=1e-9)
    assert leaf_log_delta(ev, 1.25)[0] == -math.inf  # pure 1/0.8-DP
    assert LaplaceEvent(scale=2.0, sensitivity=3.0).epsilon == 1.5


def test_laplace_composes_with_gaussians_in_pld_like_dp_accounting():
    ours = (
        accountant("pld")
        .compose(LaplaceEvent(5.0), 20)
        .compose(SubsampledGaussianEvent(1.0, 0.01), 1000)
        .compose(GaussianEvent(10.0), 5)
    )
    acc = pld_acc_lib.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_event.LaplaceDpEvent(5.0), 20)
    acc.compose(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), 1000)
    acc.compose(dp_event.GaussianDpEvent(10.0), 5)
    for delta in (1e-4, 1e-7):
        theirs = acc.get_epsilon(delta)
        assert theirs * 0.995 <= ours.epsilon(delta) <= theirs * 1.005


@pytest.mark.parametrize("order", [1.01, 1.5, 2.0, 10.0, 256.0])
def test_laplace_rdp_equals_dp_accounting(order):
    for eps in (0.1, 1.0, 5.0):
        assert laplace_rdp(eps, [order])[0] == pytest.approx(rdp_lib._laplace_rdp(eps, order), rel=1e-9)
    ours = accountant("rdp").compose(LaplaceEvent(2.0), 50).epsilon(1e-6)
    acc = rdp_lib.RdpAccountant()
    acc.compose(dp_event.LaplaceDpEvent(2.0), 50)
    assert ours <= acc.get_epsilon(1e-6) * (1 + 1e-9)
    assert ours >= accountant("pld").compose(LaplaceEvent(2.0), 50).epsilon(1e-6)


def test_laplace_in_basic_composition_is_at_most_pure_epsilon():
    assert accountant("basic").compose(LaplaceEvent(2.0), 3).epsilon(1e-6) <= 1.5


@pytest.mark.parametrize(
    "ev",
    [
        LaplaceEvent(2.0, 3.0),
        ReplaceOneSubsampledGaussianEvent(1.1, 0.01),
        FixedBatchGaussianEvent(1.0, 64, 1000),
    ],
)
def test_new_events_round_trip_through_dicts(ev):
    assert event_from_dict(ev.to_dict()) == ev
    with pytest.raises(InvalidParameter):
        event_from_dict({k: v for k, v in ev.to_dict().items() if k != "noise_multiplier" and k != "scale"})


# ----- user-supplied privacy loss distributions and privacy profiles --------------------------------


def _mp_randomized_response_epsilon(k, delta):
    """50-digit epsilon of k-fold binary randomized response with P(truth) = 3/4 (losses +-ln 3)."""
    mp.mp.dps = 50
    l3 = mp.log(3)

    def dlt(e):
        return mp.fsum(
            mp.binomial(k, j)
            * mp.mpf(0.75) ** j
            * mp.mpf(0.25) ** (k - j)
            * (1 - mp.exp(e - (2 * j - k) * l3))
            for j in range(k + 1)
            if (2 * j - k) * l3 > e
        )

    lo, hi = mp.mpf(0), mp.mpf(2 * k)
    for _ in range(120):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if dlt(mid) > delta else (lo, mid)
    return float(hi)


@pytest.mark.parametrize("k", [1, 10, 100])
def test_loss_histogram_of_randomized_response_is_exact_and_below_dp_accounting(k):
    ev = PrivacyLossDistributionEvent.from_probability_mass_functions([0.75, 0.25], [0.25, 0.75])
    assert sorted(ev.losses) == pytest.approx([-math.log(3), math.log(3)])
    ours = accountant("pld").compose(ev, k).epsilon(1e-5)
    exact = _mp_randomized_response_epsilon(k, mp.mpf("1e-5"))
    theirs = pld_lib.from_randomized_response(0.5, 2, value_discretization_interval=1e-4).self_compose(k)
    assert exact <= ours <= exact * 1.0005
    assert ours <= theirs.get_epsilon_for_delta(1e-5) * (1 + 1e-9)


def test_loss_histogram_validation_and_infinite_mass():
    with pytest.raises(InvalidParameter, match="E\\[exp"):
        PrivacyLossDistributionEvent((-1.0,), (0.9,))  # Q would carry 0.9 e > 1
    with pytest.raises(InvalidParameter, match="sum"):
        PrivacyLossDistributionEvent((0.1, 0.2), (0.6, 0.6))
    ev = PrivacyLossDistributionEvent((0.5,), (0.99,))  # 1% of the mass at +infinity
    assert accountant("pld").compose(ev).delta(10.0) >= 0.01
    assert event_from_dict(ev.to_dict()) == ev


@pytest.mark.parametrize("k", [1, 10, 50])
def test_single_point_profile_matches_dp_accounting_privacy_parameters(k):
    common = pytest.importorskip("dp_accounting.pld.common")
    ev = PrivacyProfileEvent((1.0,), (1e-6,))
    ours = accountant("pld").compose(ev, k).epsilon(1e-4)
    theirs = (
        pld_lib.from_privacy_parameters(
            common.DifferentialPrivacyParameters(1.0, 1e-6), value_discretization_interval=1e-4
        )
        .self_compose(k)
        .get_epsilon_for_delta(1e-4)
    )
    assert theirs * (1 - 1e-6) <= ours <= theirs * 1.001


@pytest.mark.parametrize("k", [1, 10, 100])
def test_profile_sampled_from_a_gaussian_stays_above_the_gaussian(k):
    sigma = 3.0
    eps = np.linspace(0.0, 3.0, 60)
    dl = [
        math.exp(float(leaf_log_delta(ReplaceOneSubsampledGaussianEvent(2 * sigma, 1.0), float(e))[0]))
        for e in eps
    ]
    ours = accountant("pld").compose(PrivacyProfileEvent(tuple(eps), tuple(dl)), k).epsilon(1e-5)
    exact = epsilon_for_mu(mu=math.sqrt(k) / sigma, delta=1e-5)
    assert exact <= ours <= exact * 1.01
    # a sparse profile is a weaker guarantee: never a smaller epsilon
    sparse = (
        accountant("pld").compose(PrivacyProfileEvent(tuple(eps[::10]), tuple(dl[::10])), k).epsilon(1e-5)
    )
    assert sparse >= ours * (1 - 1e-9)


# ----- discrete Gaussian ------------------------------------------------------------------------------


def _mp_discrete_gaussian_epsilon(sigma, sens, k, delta):
    """50-digit epsilon of k discrete Gaussian releases: the composed loss depends on the noise sum S only."""
    mp.mp.dps = 50
    s2 = 2 * mp.mpf(sigma) ** 2
    t = int(12 * sigma) + 2
    w = [mp.exp(-(mp.mpf(y) ** 2) / s2) for y in range(-t, t + 1)]
    z = mp.fsum(mp.exp(-(mp.mpf(y) ** 2) / s2) for y in range(-40 * t, 40 * t + 1))
    one = [x / z for x in w]
    pmf = one
    for _ in range(k - 1):  # exact convolution of the k noise terms
        out = [mp.mpf(0)] * (len(pmf) + len(one) - 1)
        for i, a in enumerate(pmf):
            for j, b in enumerate(one):
                out[i + j] += a * b
        pmf = out
    lo = -k * t
    losses = [(k * sens**2 - 2 * sens * (lo + i)) / s2 for i in range(len(pmf))]

    def dlt(e):
        return mp.fsum(p * (1 - mp.exp(e - v)) for p, v in zip(pmf, losses, strict=True) if v > e)

    a, b = mp.mpf(0), mp.mpf(max(losses))
    for _ in range(100):
        m = (a + b) / 2
        a, b = (m, b) if dlt(m) > delta else (a, m)
    return float(b)


@pytest.mark.parametrize(("sigma", "sens", "k"), [(0.7, 2, 5), (2.0, 1, 10), (1.0, 1, 1)])
def test_discrete_gaussian_pld_matches_exact_composition(sigma, sens, k):
    ours = accountant("pld").compose(DiscreteGaussianEvent(sigma, sens), k).epsilon(1e-6)
    exact = _mp_discrete_gaussian_epsilon(sigma, sens, k, mp.mpf("1e-6"))
    assert exact <= ours <= exact * 1.002
    theirs = pld_lib.from_discrete_gaussian_mechanism(sigma, sens, value_discretization_interval=1e-4)
    assert ours <= theirs.self_compose(k).get_epsilon_for_delta(1e-6) * 1.0005


@pytest.mark.parametrize(("sigma", "sens", "k"), [(5.0, 1, 10), (50.0, 3, 100)])
def test_discrete_gaussian_pld_matches_dp_accounting(sigma, sens, k):
    ours = accountant("pld").compose(DiscreteGaussianEvent(sigma, sens), k).epsilon(1e-6)
    pld = pld_lib.from_discrete_gaussian_mechanism(sigma, sens, value_discretization_interval=1e-4)
    theirs = pld.self_compose(k).get_epsilon_for_delta(1e-6)
    assert abs(ours / theirs - 1) < 0.002


def test_discrete_gaussian_rdp_is_concentrated_dp_and_above_pld():
    acc = accountant("rdp").compose(DiscreteGaussianEvent(4.0, 2), 20)
    orders = np.asarray(acc.orders)
    assert acc.rdp() == pytest.approx(20 * orders * 4 / (2 * 16.0), rel=1e-12)
    assert acc.epsilon(1e-6) >= accountant("pld").compose(DiscreteGaussianEvent(4.0, 2), 20).epsilon(1e-6)
    assert event_from_dict(DiscreteGaussianEvent(4.0, 2).to_dict()) == DiscreteGaussianEvent(4.0, 2)
    with pytest.raises(TypeError):
        DiscreteGaussianEvent(4.0, 1.5)
