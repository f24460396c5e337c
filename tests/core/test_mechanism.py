"""GaussianMechanism: calibration, release semantics, dtypes, seeds, fail-closed input checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from gaussdp import (
    GaussianMechanism,
    InvalidParameter,
    NotPrivateWarning,
    PrivacyError,
    UnsafeInput,
    epsilon_for,
    sigma_for,
)
from gaussdp.noise import GRID_SLACK

ALPHA = 1e-6  # false-alarm rate of each statistical check below


def seeded_mechanism(seed: int = 0, **kwargs):
    with pytest.warns(NotPrivateWarning):
        return GaussianMechanism(seed=seed, **kwargs)


def test_calibration_matches_core_and_accounts_for_the_grid():
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=2.0)
    assert mech.accounted_sensitivity == 2.0 * (1 + GRID_SLACK)
    assert mech.sigma == sigma_for(epsilon=1.0, delta=1e-5, sensitivity=2.0 * (1 + GRID_SLACK))
    assert mech.sigma == pytest.approx(2 * 3.7306316, rel=1e-5)
    assert mech.noise_multiplier == mech.sigma / 2.0
    assert mech.epsilon(1e-5) <= 1.0 + 1e-9
    assert mech.delta(1.0) <= 1e-5 * (1 + 1e-9)
    fast = GaussianMechanism(epsilon=1.0, delta=1e-5, noise="fast")
    assert fast.sigma == sigma_for(epsilon=1.0, delta=1e-5) and not fast.float_safe


def test_sigma_constructor_reports_what_it_buys():
    mech = GaussianMechanism(sigma=4.8448, sensitivity=1.0)
    assert mech.target is None
    assert mech.epsilon(1e-5) == pytest.approx(epsilon_for(sigma=4.8448, delta=1e-5), rel=1e-5)
    assert mech.epsilon(1e-5) >= epsilon_for(sigma=4.8448, delta=1e-5)  # the grid slack is charged


def test_classical_method_checked():
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5, method="classical")
    assert mech.sigma == pytest.approx(4.8448053, rel=1e-5)
    with pytest.raises(InvalidParameter, match="true delta"):
        GaussianMechanism(epsilon=10.0, delta=1e-5, method="classical")


def test_event_for_the_accountant():
    accounting = pytest.importorskip("gaussdp.accounting")
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5)
    event = mech.event
    assert isinstance(event, accounting.GaussianEvent)
    assert event.noise_multiplier == pytest.approx(mech.sigma / mech.accounted_sensitivity)
    eps = accounting.accountant("pld").compose(event).epsilon(1e-5)
    assert eps == pytest.approx(1.0, abs=0.02)


def test_release_shapes_and_dtypes():
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5)
    out = mech.release(0.5)
    assert isinstance(out, float)
    for x in (np.float32(0.5), np.zeros(3, np.float32), np.zeros((2, 3), np.float32)):
        y = mech.release(x)
        assert y.dtype == np.float32 and np.shape(y) == np.shape(x)
    assert mech.release(np.zeros(4, np.float16)).dtype == np.float16
    assert mech.release([1, 2, 3]).dtype == np.float64
    assert mech.release_rows(np.zeros((5, 3), np.float32)).dtype == np.float32
    assert isinstance(mech.add_noise(3.0), float)


def test_release_clips_to_the_sensitivity():
    # Under one seed, release(x) - release(0) is the clipped, grid-rounded record.
    x = np.array([300.0, 400.0])
    diff = seeded_mechanism(7, sigma=1.0, sensitivity=2.0).release(x) - seeded_mechanism(
        7, sigma=1.0, sensitivity=2.0
    ).release(np.zeros(2))
    assert np.linalg.norm(diff) <= 2.0
    np.testing.assert_allclose(diff, [1.2, 1.6], atol=1e-5)
    # add_noise does not clip.
    big = seeded_mechanism(7, sigma=1.0).add_noise(np.array([1000.0]))
    assert abs(big[0] - 1000.0) < 10


def test_release_noise_level():
    mech = GaussianMechanism(sigma=3.0, sensitivity=1.0)
    out = mech.release_rows(np.zeros((100_000, 1), np.float32))
    assert stats.kstest(out[:, 0] / 3.0, "norm").pvalue > ALPHA


def test_seeded_is_marked_not_private_and_reproducible():
    a = seeded_mechanism(3, epsilon=1.0, delta=1e-5)
    b = seeded_mechanism(3, epsilon=1.0, delta=1e-5)
    assert not a.private and "private=False" in repr(a)
    np.testing.assert_array_equal(a.release(np.ones(5)), b.release(np.ones(5)))
    assert GaussianMechanism(epsilon=1.0, delta=1e-5).private


def test_bad_data_refused_before_any_noise_is_drawn():
    a = seeded_mechanism(11, sigma=1.0)
    for bad in (np.array([1.0, np.nan]), np.array([np.inf]), np.array([]), [[1.0], [2.0, 3.0]]):
        with pytest.raises(UnsafeInput):
            a.release(bad)
        with pytest.raises(UnsafeInput):
            a.add_noise(bad)
    for bad in (np.array([True]), np.array([1j]), True, "x"):
        with pytest.raises(TypeError):
            a.release(bad)
    with pytest.raises(UnsafeInput):
        a.release_rows(np.array([[0.0], [np.nan]]))
    # Nothing was drawn: the next release equals the first release of a fresh mechanism.
    b = seeded_mechanism(11, sigma=1.0)
    np.testing.assert_array_equal(a.release(np.ones(3)), b.release(np.ones(3)))


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        (dict(epsilon=0.0, delta=1e-5), InvalidParameter, "epsilon"),
        (dict(epsilon=-1.0, delta=1e-5), InvalidParameter, "epsilon"),
        (dict(epsilon=math.nan, delta=1e-5), InvalidParameter, "epsilon"),
        (dict(epsilon=math.inf, delta=1e-5), InvalidParameter, "epsilon"),
        (dict(epsilon=1.0, delta=0.0), InvalidParameter, "delta"),
        (dict(epsilon=1.0, delta=1.0), InvalidParameter, "delta"),
        (dict(epsilon=1.0, delta=-0.1), InvalidParameter, "delta"),
        (dict(epsilon=1.0, delta=1e-5, sensitivity=0.0), InvalidParameter, "sensitivity"),
        (dict(epsilon=1.0, delta=1e-5, sensitivity=math.nan), InvalidParameter, "sensitivity"),
        (dict(sigma=0.0), InvalidParameter, "sigma"),
        (dict(sigma=-1.0), InvalidParameter, "sigma"),
        (dict(sigma=1.0, epsilon=1.0, delta=1e-5), InvalidParameter, "not both"),
        (dict(epsilon=1.0), InvalidParameter, "delta"),
        (dict(), InvalidParameter, "sigma"),
        (dict(epsilon=True, delta=1e-5), TypeError, "epsilon"),
        (dict(epsilon=1j, delta=1e-5), TypeError, "epsilon"),
        (dict(sigma=1.0, noise="quantum"), InvalidParameter, "noise"),
        (dict(epsilon=1.0, delta=1e-5, method="nope"), InvalidParameter, "method"),
    ],
)
def test_bad_parameters(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        GaussianMechanism(**kwargs)


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        GaussianMechanism(epsilon=1.0, delta=2.0)
    assert issubclass(UnsafeInput, PrivacyError)


def test_torch_release():
    torch = pytest.importorskip("torch")
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5)
    out = mech.release(torch.full((3, 4), 10.0))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (3, 4)
    fast = GaussianMechanism(epsilon=1.0, delta=1e-5, noise="fast")
    assert fast.release(torch.zeros(3, dtype=torch.float64)).dtype == torch.float64


def test_calibrated_parameters_are_read_only():
    """Releasing at a sensitivity other than the one the cost is computed for would print a wrong
    epsilon: sigma, sensitivity, accounted_sensitivity and source cannot be reassigned."""
    mech = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    for name, value in [
        ("sigma", 0.1),
        ("sensitivity", 10.0),
        ("accounted_sensitivity", 0.1),
        ("source", None),
    ]:
        with pytest.raises(AttributeError):
            setattr(mech, name, value)
    assert mech.sensitivity == 1.0 and mech.epsilon(1e-5) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-300, -1.0])
def test_check_nonnegative_refuses_what_a_noise_scale_cannot_be(bad):
    """The one validator for noise multipliers and noise stds (engine, optimizer, noise kernel)."""
    from gaussdp._validate import check_nonnegative

    with pytest.raises(InvalidParameter, match="std must be finite and >= 0"):
        check_nonnegative("std", bad)
    with pytest.raises(TypeError, match="real number"):
        check_nonnegative("std", True)
    assert check_nonnegative("std", 0) == 0.0 and check_nonnegative("std", 2.5) == 2.5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sigma=5e-324, sensitivity=5e-324),
        dict(sigma=1.0, sensitivity=1e-300),
        dict(epsilon=1.0, delta=1e-5, sensitivity=1e-300),
    ],
)
def test_subnormal_scales_are_refused_before_any_release(kwargs):  # type: ignore[no-untyped-def]
    # their float-safe noise grid would underflow to 0 (a release failing after its charge)
    from gaussdp import GaussianMechanism, InvalidParameter

    with pytest.raises(InvalidParameter, match=r"sigma|sensitivity"):
        GaussianMechanism(**kwargs)


@pytest.mark.parametrize("noise", ["secure", "fast"])
@pytest.mark.parametrize(("epsilon", "delta"), [(8.0, 1e-5), (1.0, 1e-5), (3.0, 1e-6), (0.5, 1e-9)])
def test_a_budget_of_exactly_the_requested_epsilon_pays_for_the_release(noise, epsilon, delta) -> None:
    """The release's own event fits a budget equal to its target: the rounded division
    sigma / accounted_sensitivity once put the PLD accountant 2e-15 above epsilon=8 (refused)."""
    from gaussdp.budget import Budget, Ledger

    mech = GaussianMechanism(epsilon=epsilon, delta=delta, noise=noise)
    ledger = Ledger("memory://")
    ledger.open("p", Budget(epsilon, delta))
    ledger.charge("p", mech.event)
    assert ledger.spent("p").epsilon <= epsilon
    exact = GaussianMechanism(epsilon=epsilon, delta=delta, noise=noise, method="analytic")
    assert mech.sigma == exact.sigma  # deterministic, and never below the exact analytic sigma
    assert mech.sigma >= sigma_for(epsilon=epsilon, delta=delta, sensitivity=mech.accounted_sensitivity)
    assert mech.sigma <= sigma_for(epsilon=epsilon, delta=delta, sensitivity=mech.accounted_sensitivity) * (
        1 + 1e-13
    )
