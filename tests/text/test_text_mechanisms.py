"""Word mechanisms: guarantees against independent formulas and dp_accounting, noise distributions,
and TEM's exact output distribution. Statistical tests use fixed seeds; each states its alpha."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats

from gaussdp.calibration import epsilon_for
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.text import (
    GaussianWordMechanism,
    LaplaceWordMechanism,
    MahalanobisWordMechanism,
    TruncatedExponentialWordMechanism,
    Vocabulary,
    make_mechanism,
)

ALPHA = 1e-3  # false-alarm rate of each statistical test below


def _seeded(cls, vocab, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return cls(vocab, seed=kw.pop("seed", 7), **kw)


@pytest.fixture(scope="module")
def vocab():
    rng = np.random.default_rng(0)
    return Vocabulary([f"w{i}" for i in range(400)], rng.uniform(-1, 1, (400, 50)).astype(np.float32))


def _balle_wang_delta(eps, d, sigma):
    """Theorem 8 of Balle & Wang (2018), computed here independently of gaussdp.calibration."""
    mu = d / sigma
    return stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu)


def test_text_gaussian_per_word_guarantee_is_exact(vocab):
    mech = GaussianWordMechanism(vocab, sigma=0.5, delta=1e-5)
    for d in (0.3, 1.0, vocab.diameter_bound):
        g = mech.word_guarantee(d)
        assert g.kind == "metric-zCDP" and g.rho == pytest.approx(d * d / (2 * 0.25))
        assert _balle_wang_delta(g.epsilon, d, 0.5) == pytest.approx(1e-5, rel=1e-3)
    assert mech.word_guarantee(0.0).epsilon == 0.0


def test_text_gaussian_document_002_numbers_are_wrong():
    # Document 002: "sensitivity 2, sigma 0.1, epsilon about 96.9". The exact epsilon is about 284,
    # and the true worst case for [-1, 1]^50 is sensitivity 2*sqrt(50).
    v = Vocabulary(["a", "b"], [[1.0] * 50, [-1.0] * 50])
    mech = GaussianWordMechanism(v, sigma=0.1, delta=1e-5)
    eps2 = mech.word_guarantee(2.0).epsilon
    assert _balle_wang_delta(eps2, 2.0, 0.1) == pytest.approx(1e-5, rel=1e-3)
    assert 280 < eps2 < 290
    worst = mech.report()["box_diameter"]
    assert worst["distance"] == pytest.approx(2 * math.sqrt(50))
    assert worst["epsilon"] > 30 * 96.9


def test_text_gaussian_calibrated_from_epsilon(vocab):
    mech = GaussianWordMechanism(vocab, epsilon=8.0, delta=1e-6)
    assert mech.word_guarantee(vocab.diameter_bound).epsilon == pytest.approx(8.0, rel=1e-6)
    mech = GaussianWordMechanism(vocab, epsilon=2.0, delta=1e-6, distance=1.0)
    assert mech.word_guarantee(1.0).epsilon == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(InvalidParameter, match="exactly one"):
        GaussianWordMechanism(vocab, sigma=1.0, epsilon=1.0)
    with pytest.raises(InvalidParameter):
        GaussianWordMechanism(vocab, sigma=-1.0)


def test_text_gaussian_document_composition_matches_dp_accounting(vocab):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    sigma, d, n = 1.0, 0.5, 10
    mech = GaussianWordMechanism(vocab, sigma=sigma, delta=1e-5)
    g = mech.document_guarantee([d] * n)
    assert g.rho == pytest.approx(n * d * d / (2 * sigma**2))
    assert g.epsilon == pytest.approx(epsilon_for(sigma=sigma, delta=1e-5, sensitivity=d * math.sqrt(n)))
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma / d), n)
    ref = acc.get_epsilon(1e-5)
    assert 0.97 * ref <= g.epsilon <= ref * 1.001  # PLD is a (slightly loose) upper bound


def test_text_gaussian_noise_level(vocab):
    mech = _seeded(GaussianWordMechanism, vocab, sigma=0.3)
    z = mech._noisy(np.zeros((4000, 50), np.float32))
    # chi-square test of the variance: sum z^2 / sigma^2 ~ chi2(n*dim).
    stat = float(np.sum(z.astype(np.float64) ** 2) / 0.09)
    df = z.size
    p = 2 * min(stats.chi2.cdf(stat, df), stats.chi2.sf(stat, df))
    assert p > ALPHA


def test_text_laplace_radius_and_direction(vocab):
    mech = _seeded(LaplaceWordMechanism, vocab, epsilon=5.0)
    z = mech._noisy(np.zeros((5000, 50), np.float32)).astype(np.float64)
    r = np.linalg.norm(z, axis=1)
    assert stats.kstest(r, stats.gamma(a=50, scale=1 / 5.0).cdf).pvalue > ALPHA
    u = z / r[:, None]
    # Mean of uniform unit vectors: each coordinate has variance 1/(50*5000); |z-score| < 4.
    assert np.all(np.abs(u.mean(axis=0)) < 4 / math.sqrt(50 * 5000))
    g = mech.word_guarantee(2.0)
    assert g.kind == "metric-DP" and g.epsilon == 10.0 and g.delta == 0.0
    assert mech.document_guarantee([1.0, 2.0]).epsilon == pytest.approx(15.0)


def test_text_mahalanobis_noise_covariance():
    rng = np.random.default_rng(4)
    basis = rng.normal(size=(4, 4))
    x = np.tanh(rng.normal(size=(300, 4)) @ basis * 0.5)
    vocab = Vocabulary([f"w{i}" for i in range(300)], x.astype(np.float32))
    mech = _seeded(MahalanobisWordMechanism, vocab, epsilon=2.0, lam=0.6)
    cov = np.cov(x.astype(np.float32).astype(np.float64), rowvar=False)
    cov *= 4 / np.trace(cov)
    sigma_p = 0.6 * cov + 0.4 * np.eye(4)
    z = mech._noisy(np.zeros((200_000, 4), np.float32)).astype(np.float64)
    expected = (4 + 1) / 2.0**2 * sigma_p  # E[R^2]/dim * Sigma_p with R ~ Gamma(dim, 1/eps)
    assert np.linalg.norm(z.T @ z / len(z) - expected) / np.linalg.norm(expected) < 0.03
    assert mech.lambda_min == pytest.approx(float(np.linalg.eigvalsh(sigma_p).min()), rel=1e-6)
    g = mech.word_guarantee(1.0)
    assert g.epsilon == pytest.approx(2.0 / math.sqrt(mech.lambda_min))


def test_text_tem_samples_the_truncated_exponential_distribution():
    # Six words on a line; epsilon 2, gamma 1.5: some words inside the threshold, some outside.
    pts = np.array([[0.0], [0.3], [0.5], [0.9], [-0.8], [1.0]])
    pts = np.hstack([pts, np.zeros((6, 1))]).astype(np.float32)
    vocab = Vocabulary([f"w{i}" for i in range(6)], pts)
    eps, gamma = 2.0, 0.85
    mech = _seeded(TruncatedExponentialWordMechanism, vocab, epsilon=eps, gamma=gamma, seed=11)
    n = 30_000
    out = mech.perturb_indices(np.zeros(n, dtype=np.int64))
    d = np.linalg.norm(pts - pts[0], axis=1).astype(np.float64)
    p = np.exp(-eps * np.minimum(d, gamma) / 2)
    p /= p.sum()
    counts = np.bincount(out, minlength=6)
    assert stats.chisquare(counts, n * p).pvalue > ALPHA
    # Its guarantee: epsilon * d; the distribution above satisfies it exactly (ratio check).
    p64 = pts.astype(np.float64)
    for j in range(6):
        dj = np.linalg.norm(p64 - p64[j], axis=1)
        q = np.exp(-eps * np.minimum(dj, gamma) / 2)
        q /= q.sum()
        assert np.all(np.abs(np.log(p / q)) <= eps * float(np.linalg.norm(p64[0] - p64[j])) + 1e-9)


def test_text_uniform_and_gumbel_helpers(vocab):
    mech = _seeded(TruncatedExponentialWordMechanism, vocab, epsilon=1.0, seed=5)
    u = mech._uniform(20_000)
    assert u.min() > 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > ALPHA
    g = mech._gumbel(20_000, 2.0)
    assert stats.kstest(g, stats.gumbel_r(loc=0.0, scale=2.0).cdf).pvalue > ALPHA
    ints = mech._integers(20_000, 7)
    assert stats.chisquare(np.bincount(ints, minlength=7)).pvalue > ALPHA


def test_text_tem_default_gamma_and_large_vocab(vocab):
    mech = _seeded(TruncatedExponentialWordMechanism, vocab, epsilon=10.0, beta=0.01)
    assert mech.gamma == pytest.approx(0.2 * math.log(0.99 * 399 / 0.01))
    out = mech.perturb_indices(np.arange(400))
    assert out.shape == (400,) and out.min() >= 0 and out.max() < 400


def test_text_seed_is_marked_not_private(vocab):
    with pytest.warns(NotPrivateWarning, match="NOT private"):
        mech = GaussianWordMechanism(vocab, sigma=1.0, seed=3)
    assert mech.private is False
    default = GaussianWordMechanism(vocab, sigma=1.0)
    assert default.private is True and default._source.name == "secure"
    fast = GaussianWordMechanism(vocab, sigma=1.0, noise="fast")
    assert fast.private is True and fast._source.name == "fast"
    with pytest.raises(InvalidParameter):
        GaussianWordMechanism(vocab, sigma=1.0, noise="urandom")
    with pytest.raises(TypeError):
        GaussianWordMechanism(vocab, sigma=1.0, seed=1.5)


def test_text_mechanisms_refuse_bad_input(vocab):
    mech = make_mechanism("laplace", vocab, epsilon=1.0)
    with pytest.raises(UnsafeInput):
        mech.perturb_vectors(np.full((1, 50), np.nan))
    with pytest.raises(UnsafeInput, match="lie in"):
        mech.perturb_vectors(np.full((1, 50), 2.0))
    with pytest.raises(InvalidParameter):
        make_mechanism("rappor", vocab, epsilon=1.0)
    with pytest.raises(InvalidParameter):
        LaplaceWordMechanism(vocab, epsilon=0.0)
    with pytest.raises(InvalidParameter):
        MahalanobisWordMechanism(vocab, epsilon=1.0, lam=1.5)


def test_text_approximate_search_reports_recall(vocab):
    mech = GaussianWordMechanism(vocab, sigma=0.3)
    assert mech.recall is None
    exact_out = mech.perturb_indices(np.arange(50))
    assert exact_out.shape == (50,) and mech.recall is None
    mech.search = "faiss-flat"  # exact as well: agreement is 1 up to float32 near-ties
    mech.perturb_indices(np.arange(400))
    assert mech.recall is not None and mech.recall >= 0.99
