"""Document 004's GaussianDifferentialPrivacy on dicts of numpy arrays and torch tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import gaussdp.paramdict as paramdict
from gaussdp.calibration import epsilon_for, sigma_for
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.noise import GRID_SLACK
from gaussdp.paramdict import GaussianDifferentialPrivacy

ALPHA = 1e-6  # false-alarm rate of each statistical test (two-sided)
SLACK = 1.0 + GRID_SLACK  # the float-safe mechanism calibrates for sensitivity C * SLACK


def global_norm(d):
    return math.sqrt(sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in d.values()))


@pytest.fixture
def no_noise(monkeypatch):
    """Replace the noise by the identity to look at what was clipped (the noise is tested apart)."""
    monkeypatch.setattr(paramdict, "add_noise_to_tree", lambda mech, tree: dict(tree))


def params(scale: float = 10.0, dtype=np.float32):
    rng = np.random.default_rng(0)
    return {
        "w": (scale * rng.standard_normal((4, 3))).astype(dtype),
        "b": (scale * rng.standard_normal(3)).astype(dtype),
    }


def test_document_accessors_and_defaults():
    dp = GaussianDifferentialPrivacy()
    assert dp.clip_norm == 1.0 and dp.GetClipNorm() == 1.0
    assert dp.mechanism_name == "Gaussian" == dp.GetMechanismName()
    assert dp.privacy_budget_consumed == 0.0 == dp.GetPrivacyBudgetConsumed()
    assert dp.private


def test_apply_privacy_keeps_structure_and_charges_basic_composition():
    dp = GaussianDifferentialPrivacy(clip_norm=2.0)
    p = params()
    out = dp.apply_privacy(p, 0.5, 1e-6)
    assert set(out) == set(p)
    for k in p:
        assert out[k].shape == p[k].shape and out[k].dtype == np.float32
    dp.ApplyPrivacy(p, 0.25, 1e-6)
    assert dp.privacy_budget_consumed == pytest.approx(0.75)  # document 004: epsilons add up
    assert dp.delta_consumed == pytest.approx(2e-6)
    dp.ResetPrivacyBudget()
    assert dp.privacy_budget_consumed == 0.0 and dp.delta_consumed == 0.0
    dp.apply_privacy(p, 1.0, 1e-6)
    dp.reset_privacy_budget()
    assert dp.privacy_budget_consumed == 0.0


def test_parameters_themselves_are_clipped_without_reference(no_noise):
    dp = GaussianDifferentialPrivacy(clip_norm=1.5)
    p = params(scale=10.0, dtype=np.float64)
    out = dp.apply_privacy(p, 1.0, 1e-5)
    assert global_norm(out) <= 1.5
    factor = global_norm(out) / global_norm(p)
    for k in p:  # one global factor: the direction is kept
        np.testing.assert_allclose(out[k], p[k] * factor, rtol=1e-12)


def test_reference_clips_the_update_not_the_model(no_noise):
    """Federated learning: clip local - global; the model keeps its norm."""
    dp = GaussianDifferentialPrivacy(clip_norm=1.0)
    glob = params(scale=10.0, dtype=np.float64)
    update = {k: 0.1 * np.ones_like(v) for k, v in glob.items()}  # norm 0.1*sqrt(15) < 1: kept
    local = {k: glob[k] + update[k] for k in glob}
    out = dp.apply_privacy(local, 1.0, 1e-5, reference=glob)
    for k in glob:
        np.testing.assert_allclose(out[k], local[k], rtol=1e-12)
    big = {k: glob[k] + 100 * update[k] for k in glob}
    out = dp.apply_privacy(big, 1.0, 1e-5, reference=glob)
    delta = {k: out[k] - glob[k] for k in glob}
    assert global_norm(delta) == pytest.approx(1.0, rel=1e-9)
    # Document 004's way (no reference) would have shrunk the whole model to norm 1.
    assert global_norm(dp.apply_privacy(big, 1.0, 1e-5)) <= 1.0


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ({"w": np.zeros((4, 3))}, "keys"),
        ({"w": np.zeros((4, 3)), "b": np.zeros(4)}, "shape"),
    ],
)
def test_reference_mismatch_refused_and_nothing_charged(ref, match):
    dp = GaussianDifferentialPrivacy()
    with pytest.raises(UnsafeInput, match=match):
        dp.apply_privacy(params(), 1.0, 1e-5, reference=ref)
    assert dp.privacy_budget_consumed == 0.0


@pytest.mark.parametrize(
    ("p", "exc"),
    [
        ({"w": np.array([1.0, np.nan])}, UnsafeInput),
        ({"w": np.array([1.0, np.inf])}, UnsafeInput),
        ({}, UnsafeInput),
        ({"w": np.zeros(0)}, UnsafeInput),
        ({"w": [[1.0, 2.0], [3.0]]}, UnsafeInput),
        ({"w": np.array(["a"])}, UnsafeInput),
        ([np.zeros(3)], TypeError),
    ],
    ids=["nan", "inf", "empty-dict", "empty-leaf", "ragged", "strings", "not-a-dict"],
)
def test_bad_params_refused_and_nothing_charged(p, exc):
    dp = GaussianDifferentialPrivacy()
    with pytest.raises(exc):
        dp.apply_privacy(p, 1.0, 1e-5)
    assert dp.privacy_budget_consumed == 0.0


@pytest.mark.parametrize(
    ("eps", "delta", "name"),
    [
        (0.0, 1e-5, "epsilon"),
        (-1.0, 1e-5, "epsilon"),
        (math.nan, 1e-5, "epsilon"),
        (1.0, 0.0, "delta"),
        (1.0, 1.0, "delta"),
    ],
)
def test_bad_privacy_parameters(eps, delta, name):
    dp = GaussianDifferentialPrivacy()
    with pytest.raises(InvalidParameter, match=name):
        dp.apply_privacy(params(), eps, delta)
    assert dp.privacy_budget_consumed == 0.0


def test_bad_constructor_arguments():
    with pytest.raises(InvalidParameter, match="clip_norm"):
        GaussianDifferentialPrivacy(clip_norm=0.0)
    with pytest.raises(TypeError, match="clip_norm"):
        GaussianDifferentialPrivacy(clip_norm=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        GaussianDifferentialPrivacy(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="noise"):
        GaussianDifferentialPrivacy(noise="quick")


def test_seeded_is_reproducible_fresh_per_call_and_not_private():
    p = {"w": np.zeros(50)}
    with pytest.warns(NotPrivateWarning):
        a = GaussianDifferentialPrivacy(seed=5)
    with pytest.warns(NotPrivateWarning):
        b = GaussianDifferentialPrivacy(seed=5)
    assert not a.private
    a1, a2 = a.apply_privacy(p, 1.0, 1e-5), a.apply_privacy(p, 1.0, 1e-5)
    b1 = b.apply_privacy(p, 1.0, 1e-5)
    np.testing.assert_array_equal(a1["w"], b1["w"])
    assert not np.array_equal(a1["w"], a2["w"])  # never the same noise twice


def test_noise_level_chi_square():
    """Noise on zero parameters has sd sigma_for(eps, delta, clip_norm) (false alarm 1e-6)."""
    with pytest.warns(NotPrivateWarning):
        dp = GaussianDifferentialPrivacy(clip_norm=0.5, seed=2024)
    out = dp.apply_privacy({"w": np.zeros((200, 500))}, 2.0, 1e-5)["w"]
    sigma = sigma_for(epsilon=2.0, delta=1e-5, sensitivity=0.5 * SLACK)
    n = out.size
    stat = float(np.sum(out**2)) / sigma**2
    assert stats.chi2.ppf(ALPHA / 2, n) <= stat <= stats.chi2.isf(ALPHA / 2, n)
    wrong = 1.02 * sigma  # power: a 2% error in sigma is detected
    stat_wrong = float(np.sum(out**2)) / wrong**2
    assert not stats.chi2.ppf(ALPHA / 2, n) <= stat_wrong <= stats.chi2.isf(ALPHA / 2, n)


def test_epsilon_replace_is_the_doubled_sensitivity():
    dp = GaussianDifferentialPrivacy(clip_norm=3.0)
    sigma = sigma_for(epsilon=1.0, delta=1e-5, sensitivity=3.0 * SLACK)
    assert dp.epsilon_replace(1.0, 1e-5) == pytest.approx(
        epsilon_for(sigma=sigma, delta=1e-5, sensitivity=6.0 * SLACK), rel=1e-6
    )
    assert dp.epsilon_replace(1.0, 1e-5) > 1.0


def test_privacy_spent_is_tighter_than_basic_composition_and_matches_dp_accounting():
    dp_accounting = pytest.importorskip("dp_accounting")
    dp = GaussianDifferentialPrivacy()
    for _ in range(10):
        dp.apply_privacy({"w": np.zeros(3)}, 0.5, 1e-6)
    basic = dp.privacy_budget_consumed  # (5.0, 1e-5)
    tight = dp.privacy_spent(1e-5)
    assert tight < basic
    sigma = sigma_for(epsilon=0.5, delta=1e-6, sensitivity=SLACK)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma / SLACK), 10)
    ref = acc.get_epsilon(1e-5)
    assert tight == pytest.approx(ref, rel=0.02)
    dp.reset_privacy_budget()
    assert dp.privacy_spent(1e-5) == 0.0


def test_torch_tensors_keep_dtype_and_mix_with_numpy(no_noise):
    torch = pytest.importorskip("torch")
    dp = GaussianDifferentialPrivacy(clip_norm=1.0)
    p = {"w": torch.full((3, 4), 5.0, dtype=torch.float32), "b": np.full(2, 5.0, dtype=np.float64)}
    out = dp.apply_privacy(p, 1.0, 1e-5)
    assert isinstance(out["w"], torch.Tensor) and out["w"].dtype == torch.float32
    assert isinstance(out["b"], np.ndarray) and out["b"].dtype == np.float64
    total = math.sqrt(float((out["w"].double() ** 2).sum()) + float((out["b"] ** 2).sum()))
    assert total <= 1.0


def test_torch_noise_is_added_and_reference_works():
    torch = pytest.importorskip("torch")
    dp = GaussianDifferentialPrivacy(clip_norm=1.0)
    glob = {"w": torch.ones(1000, dtype=torch.float64)}
    out = dp.apply_privacy({"w": glob["w"] + 0.001}, 1.0, 1e-5, reference=glob)
    assert out["w"].dtype == torch.float64
    noise_sd = float((out["w"] - glob["w"]).std())
    # 1000 values: the sd estimate is within 20% (9 standard errors) except with probability < 1e-15.
    assert 0.8 * sigma_for(epsilon=1.0, delta=1e-5) < noise_sd < 1.2 * sigma_for(epsilon=1.0, delta=1e-5)
    with pytest.raises(TypeError):
        dp.apply_privacy({"w": torch.ones(3)}, 1.0, 1e-5, reference={"w": np.ones(3)})
