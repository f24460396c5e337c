"""Contract tests of banded MF: sensitivity against brute force, noise covariance against the strategy.

Statistical tests use fixed seeds (reproducible) and Bonferroni-corrected bounds whose false-alarm
rate for a correct generator is below 1e-6 per test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from gaussdp.errors import InvalidParameter
from gaussdp.mf import (
    BandedMFPlan,
    BandedNoise,
    banded_toeplitz_coefficients,
    prefix_sum_loss,
    strategy_sensitivity,
    toeplitz_matrix,
)
from gaussdp.mf._strategy import _loss_and_grad, sqrt_coefficients


def _patterns(n: int, sep: int, k: int):
    """Every set of at most k steps of range(n), any two at least sep apart."""
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(b - a >= sep for a, b in itertools.pairwise(combo)):
                yield combo


def brute_force_sensitivity(c: np.ndarray, sep: int, k: int) -> float:
    """max over patterns S and scalar gradients g_t in {-1, +1} of ||C[:, S] g||: the sensitivity for
    one-dimensional gradients (extreme points of the box), a lower bound in general and exact when
    C^T C >= 0 entrywise (all gradients equal is then the worst case in any dimension)."""
    best = 0.0
    for s in _patterns(c.shape[0], sep, k):
        cols = c[:, s]
        for signs in itertools.product((-1.0, 1.0), repeat=len(s)):
            best = max(best, float(np.linalg.norm(cols @ np.array(signs))))
    return best


def naive_sensitivity(c: np.ndarray, k: int) -> float:
    """A broken variant: sqrt(k) times the largest column norm, right only when columns don't overlap."""
    return math.sqrt(k) * float(np.max(np.linalg.norm(c, axis=0)))


CASES = [  # (steps, bands, min_separation, max_participations)
    (6, 2, 2, 3),
    (7, 3, 3, 2),
    (8, 3, 1, 3),  # overlapping columns: the windowed search
    (8, 4, 2, 2),
    (9, 1, 1, 4),
]


@pytest.mark.parametrize(("n", "b", "sep", "k"), CASES)
def test_sensitivity_matches_brute_force(n: int, b: int, sep: int, k: int) -> None:
    c = toeplitz_matrix(banded_toeplitz_coefficients(steps=n, bands=b), n)
    assert np.all(c.T @ c >= 0)  # optimised prefix-sum strategies: brute force is then exact
    got = strategy_sensitivity(c, bands=b, min_separation=sep, max_participations=k)
    want = brute_force_sensitivity(c, sep, k)
    assert want <= got <= want * (1 + 1e-12)


def test_sensitivity_is_an_upper_bound_with_negative_entries() -> None:
    rng = np.random.default_rng(3)
    for _ in range(5):
        c = np.tril(rng.normal(size=(7, 7))) * (np.subtract.outer(np.arange(7), np.arange(7)) < 3)
        got = strategy_sensitivity(c, bands=3, min_separation=1, max_participations=3)
        assert got >= brute_force_sensitivity(c, 1, 3) * (1 - 1e-12)


def test_brute_force_catches_a_broken_sensitivity() -> None:
    # The naive bound (max column norm times sqrt(k)) is what the b-min-separated formula gives; with
    # participations closer than the bands it is too small, and the brute force shows it.
    c = toeplitz_matrix(banded_toeplitz_coefficients(steps=8, bands=3), 8)
    assert naive_sensitivity(c, 3) < 0.95 * brute_force_sensitivity(c, 1, 3)


def test_plan_sensitivity_is_sqrt_k_column_norm_when_separated() -> None:
    plan = BandedMFPlan.cyclic(steps_per_epoch=10, epochs=4, bands=5)
    c = plan.coefficients
    assert plan.sensitivity() == pytest.approx(2.0 * np.linalg.norm(c), rel=1e-12)
    # prefixes: one more participation fits at each epoch
    assert plan.sensitivity(upto=10) == pytest.approx(np.linalg.norm(c), rel=1e-12)
    assert plan.sensitivity(upto=11) == pytest.approx(math.sqrt(np.dot(c, c) + c[0] ** 2), rel=1e-12)
    assert plan.event(3.0).noise_multiplier <= 3.0 / (2.0 * np.linalg.norm(c))


def test_plan_refuses_bands_past_the_separation() -> None:
    with pytest.raises(InvalidParameter, match="bands must be <= min_separation"):
        BandedMFPlan.cyclic(steps_per_epoch=4, epochs=3, bands=5)
    with pytest.raises(InvalidParameter, match="bands"):
        banded_toeplitz_coefficients(steps=3, bands=4)


def test_optimised_strategy_beats_its_start_and_dp_sgd() -> None:
    for n, b in [(50, 4), (300, 8)]:
        c = banded_toeplitz_coefficients(steps=n, bands=b)
        assert prefix_sum_loss(c, n) <= prefix_sum_loss(sqrt_coefficients(b), n)
        assert prefix_sum_loss(c, n) < prefix_sum_loss(np.ones(1), n)  # b = 1 is DP-SGD
        assert np.all(np.abs(np.roots(c[::-1])) > 1)  # stable inverse


def test_loss_gradient_is_exact() -> None:
    x = np.array([0.5, 0.3, 0.1])
    _, g = _loss_and_grad(x, 40)
    h = 1e-6
    fd = [(_loss_and_grad(x + h * e, 40)[0] - _loss_and_grad(x - h * e, 40)[0]) / (2 * h) for e in np.eye(3)]
    np.testing.assert_allclose(g, fd, rtol=1e-5)


# ------------------------------------------------------------------------------ noise covariance
def _generate(noise: BandedNoise, n: int, d: int, std: float, rng: np.random.Generator) -> np.ndarray:
    return np.stack([noise.next("p", std * rng.standard_normal(d)) for _ in range(n)])


class _IndependentNoise(BandedNoise):
    """Broken variant: ignores the buffer (DP-SGD's independent noise, wrongly scaled)."""

    def next(self, key, fresh):
        return fresh / self.coefficients[0]


class _OffByOneNoise(BandedNoise):
    """Broken variant: uses c_{j+1} for y_{t-j} (a shifted recurrence)."""

    def next(self, key, fresh):
        c = self.coefficients
        self.coefficients = np.concatenate((c[:1], c[2:], [0.0]))
        try:
            return super().next(key, fresh)
        finally:
            self.coefficients = c


def _covariance_ok(gen: type[BandedNoise], seed: int) -> bool:
    n, b, d, std = 8, 3, 40_000, 1.7
    c = banded_toeplitz_coefficients(steps=n, bands=b)
    y = _generate(gen(c), n, d, std, np.random.default_rng(seed))  # (n, d): d samples of an n-vector
    cinv = np.linalg.inv(toeplitz_matrix(c, n))
    sigma = std**2 * cinv @ cinv.T
    emp = y @ y.T / d  # mean is zero by construction
    # the sample covariance of d Gaussian samples: Var(emp_ij) = (S_ii S_jj + S_ij^2) / d
    se = np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / d)
    z = stats.norm.isf(1e-6 / 2 / (n * (n + 1) / 2))  # Bonferroni over the distinct entries
    return bool(np.all(np.abs(emp - sigma) <= z * se))


def test_noise_covariance_matches_the_strategy() -> None:
    assert _covariance_ok(BandedNoise, seed=11)


@pytest.mark.parametrize("broken", [_IndependentNoise, _OffByOneNoise])
def test_noise_covariance_test_catches_broken_generators(broken: type[BandedNoise]) -> None:
    assert not _covariance_ok(broken, seed=11)


def test_buffer_is_bounded() -> None:
    noise = BandedNoise(banded_toeplitz_coefficients(steps=50, bands=4))
    for _ in range(50):
        noise.next("w", np.zeros(100))
        noise.next("b", np.zeros(10))
    assert noise.buffered_values() == 3 * 110  # (b - 1) x parameters


def test_noise_works_on_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    c = banded_toeplitz_coefficients(steps=10, bands=3)
    a, t = BandedNoise(c), BandedNoise(c)
    rng = np.random.default_rng(0)
    for _ in range(6):
        z = rng.standard_normal(5)
        np.testing.assert_allclose(a.next(0, z.copy()), t.next(0, torch.from_numpy(z.copy())).numpy())


def test_scratch_is_one_work_array_per_key():
    noise = BandedNoise(banded_toeplitz_coefficients(steps=20, bands=3))
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(6):
        fresh = noise.scratch("p")
        if fresh is None:
            fresh = np.empty(4)
        fresh[:] = rng.standard_normal(4)
        seen.add(id(noise.next("p", fresh)))
    assert len(seen) == 1  # nothing allocated per step: the ring (b - 1 rows) and one work array


def test_plan_steps_are_bounded():
    with pytest.raises(InvalidParameter, match="steps must be <= 8192"):
        BandedMFPlan.cyclic(steps_per_epoch=1000, epochs=9, bands=4)


def test_non_contiguous_input_gives_the_same_noise():
    c = banded_toeplitz_coefficients(steps=10, bands=3)
    a, b = BandedNoise(c), BandedNoise(c)
    rng = np.random.default_rng(0)
    for _ in range(5):
        z = rng.standard_normal((4, 6))
        np.testing.assert_allclose(a.next(0, z.copy()), b.next(0, np.asfortranarray(z.T).T))
