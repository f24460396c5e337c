"""Byzantine-robust aggregators: resistance to f < n/3 attackers, and the norm bounds used for DP."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.federated import CoordinateMedian, Krum, TrimmedMean, krum, robust_aggregator

N, F, D = 30, 9, 50  # f = 9 < n/3 = 10
CLIP = 1.0
SPREAD = 0.005  # honest per-coordinate stddev; an honest row is ~SPREAD*sqrt(D) = 0.035 from mu


def _honest(rng: np.random.Generator, n: int = N - F) -> tuple[np.ndarray, np.ndarray]:
    mu = rng.normal(size=D)
    mu *= 0.5 / np.linalg.norm(mu)
    return mu, mu + SPREAD * rng.normal(size=(n, D))


def _attacks(rng: np.random.Generator, honest: np.ndarray, mu: np.ndarray) -> dict[str, np.ndarray]:
    """The attack set: each entry is F malicious rows."""
    m, s = honest.mean(axis=0), honest.std(axis=0)
    return {
        "huge": np.tile(1e6 * np.ones(D), (F, 1)),
        "gaussian": 100.0 * rng.normal(size=(F, D)),
        "sign_flip": np.tile(-10.0 * mu, (F, 1)),
        # "A little is enough" (Baruch et al. 2019): shift every coordinate by z standard deviations.
        "little_is_enough": np.tile(m - 1.5 * s, (F, 1)),
        # Inner-product manipulation (Xie et al. 2020): -eps times the honest mean.
        "ipm": np.tile(-0.5 * m, (F, 1)),
        "nan_free_collude": np.tile(m + 3.0 * np.ones(D) / math.sqrt(D), (F, 1)),
    }


def _clip(rows: np.ndarray, c: float = CLIP) -> np.ndarray:
    from gaussdp.clipping import clip_rows

    return clip_rows(rows, c)[0]


@pytest.mark.parametrize("name", ["krum", "multi_krum", "median", "trimmed_mean"])
def test_robust_aggregators_resist_the_attack_set(name: str) -> None:
    rng = np.random.default_rng(8)
    agg = robust_aggregator(name, **({"num_byzantine": F} if "krum" in name else {}))
    if name == "trimmed_mean":
        agg = TrimmedMean(beta=F / N)
    mu, honest = _honest(rng)
    for attack, bad in _attacks(rng, honest, mu).items():
        rows = _clip(np.concatenate([honest, bad]))[rng.permutation(N)]
        out = agg(rows)
        plain = rows.mean(axis=0)
        err = np.linalg.norm(out - mu)
        # A robust rule stays within a few honest spreads of the honest mean whatever the attackers
        # send (Krum: it picks a row near the honest cluster; median / trimmed mean: the attackers
        # can only shift each coordinate within the honest range). The plain mean does not.
        bound = 4 * SPREAD * math.sqrt(D)
        assert err < bound, (name, attack, err, np.linalg.norm(plain - mu))


def test_plain_mean_is_broken_by_the_attack_set() -> None:
    # Not a tautology: shows the attacks are strong enough to matter for a non-robust rule.
    rng = np.random.default_rng(8)
    mu, honest = _honest(rng)
    errs = {
        a: np.linalg.norm(_clip(np.concatenate([honest, bad])).mean(axis=0) - mu)
        for a, bad in _attacks(rng, honest, mu).items()
    }
    bound = 4 * SPREAD * math.sqrt(D)
    assert errs["sign_flip"] > 2 * bound and errs["huge"] > 2 * bound and errs["nan_free_collude"] > 2 * bound


def test_krum_selects_an_honest_row() -> None:
    rng = np.random.default_rng(1)
    _mu, honest = _honest(rng)
    bad = np.tile(np.ones(D), (F, 1))
    rows = _clip(np.concatenate([bad, honest]))
    out = krum(rows, num_byzantine=F)
    assert any(np.array_equal(out, h) for h in rows[F:])


def _ball(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)) * rng.exponential(size=(n, 1))
    return _clip(x, CLIP)


@pytest.mark.parametrize(
    "agg", [Krum(num_byzantine=2), Krum(num_byzantine=1, multi=3), CoordinateMedian(), TrimmedMean(0.2)]
)
def test_output_norm_is_within_the_stated_radius(agg) -> None:
    rng = np.random.default_rng(3)
    r = agg.output_radius(CLIP)
    worst = 0.0
    for n in (1, 2, 3, 4, 5, 8, 13):
        for _ in range(40):
            rows = _ball(rng, n, 6)
            worst = max(worst, float(np.linalg.norm(agg(rows))))
    assert worst <= r + 1e-12
    assert agg.sensitivity(CLIP) == pytest.approx(2 * r)


def test_median_radius_exceeds_clip_norm_on_a_crafted_input() -> None:
    # Three unit vectors whose coordinate-wise median has norm sqrt(3/2) > C: the bound sqrt(2) C is
    # needed (and the naive "median of clipped rows has norm <= C" would be false).
    a = 1 / math.sqrt(2)
    rows = np.array([[a, a, 0.0], [a, 0.0, a], [0.0, a, a]])
    med = CoordinateMedian()(rows)
    assert np.linalg.norm(med) == pytest.approx(math.sqrt(1.5))
    assert np.linalg.norm(med) <= CoordinateMedian().output_radius(1.0)


def test_robust_refuses_bad_input() -> None:
    with pytest.raises(UnsafeInput):
        CoordinateMedian()(np.array([[np.nan, 1.0]]))
    with pytest.raises(UnsafeInput):
        CoordinateMedian()(np.ones(3))
    with pytest.raises(InvalidParameter, match="beta"):
        TrimmedMean(0.5)
    with pytest.raises(InvalidParameter, match="n > f"):
        krum(np.ones((4, 2)), num_byzantine=2)
    with pytest.raises(InvalidParameter, match="robust aggregator"):
        robust_aggregator("mean")


@pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")
@pytest.mark.parametrize("agg", [Krum(num_byzantine=F, multi=3), CoordinateMedian(), TrimmedMean(F / N)])
def test_robust_dp_fedavg_resists_attacks_with_noise_on_the_stated_sensitivity(agg) -> None:
    from gaussdp.accounting import GaussianEvent
    from gaussdp.federated import DPFedAvg

    rng = np.random.default_rng(12)
    mu, honest = _honest(rng)
    z = 0.002  # tiny noise so the attack resistance is visible; the noise scale is checked exactly
    srv = DPFedAvg(
        num_clients=N,
        sample_rate=1.0,
        noise_multiplier=z,
        clip_norm=CLIP,
        robust=agg,
        ledger="memory://",
        epsilon=1e6,
        delta=1e-5,
        accountant="rdp",
        noise="fast",
        seed=4,
    )
    for attack, bad in _attacks(rng, honest, mu).items():
        rows = np.concatenate([honest, bad])  # unclipped: the server clips before aggregating
        res = srv.run_round(np.zeros(D), lambda g, ids, rows=rows: rows[ids])
        # Noise stddev is z * 2R (the aggregate's sensitivity), the update is not divided by qN.
        assert res.noise_stddev == pytest.approx(z * 2 * agg.output_radius(CLIP))
        noise_norm = res.noise_stddev * math.sqrt(D)
        assert np.linalg.norm(res.update - mu) < 4 * SPREAD * math.sqrt(D) + 3 * noise_norm, attack
    assert srv.event == GaussianEvent(z)
