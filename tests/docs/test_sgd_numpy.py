"""Document 001's PrivacyManager and DPSGDTrainer on numpy gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import gaussdp.paramdict
import gaussdp.sgd as sgd
from gaussdp.clipping import clip_tree
from gaussdp.errors import BudgetExhausted, InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.sgd import DPSGDTrainer, PrivacyManager

ALPHA = 1e-6  # false-alarm rate of each statistical test (two-sided)


def tree_norm(d):
    if isinstance(d, np.ndarray):
        return float(np.linalg.norm(d.astype(np.float64)))
    return math.sqrt(sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in d.values()))


@pytest.fixture
def no_noise(monkeypatch):
    """Identity noise, to look at what was clipped and averaged (the noise is tested apart)."""
    monkeypatch.setattr(sgd, "add_noise_to_tree", lambda mech, tree: dict(tree))


# ---- calibration of the whole run ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("epsilon", "delta", "rounds", "q"),
    [(1.0, 1e-5, 10, 1.0), (8.0, 1e-5, 300, 0.01), (3.0, 1e-6, 200, 0.05)],
)
def test_whole_run_epsilon_matches_the_accountant_and_dp_accounting(epsilon, delta, rounds, q):
    """The run's noise multiplier makes the whole run (epsilon, delta)-DP, checked independently."""
    dp_accounting = pytest.importorskip("dp_accounting")
    pm = PrivacyManager(epsilon, delta, 1.0, rounds, sample_rate=q)
    ours = pm.whole_run_epsilon()
    assert ours <= epsilon * (1 + 1e-9)
    assert ours >= 0.97 * epsilon  # not wastefully over-noised
    # Independent reference: Google's PLD accountant on the same Poisson-subsampled Gaussian.
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(pm.noise_multiplier))
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(event, rounds)
    ref = acc.get_epsilon(delta)
    assert ours == pytest.approx(ref, rel=0.02)
    assert ref <= epsilon * 1.02


def test_document_001_split_is_not_what_we_do():
    """Document 001 noises each round for epsilon/sqrt(T) with the classical formula; our run is
    certified at epsilon by the accountant and uses less noise than that split."""
    from gaussdp.calibration import classical_sigma

    eps, delta, rounds = 1.0, 1e-5, 100
    pm = PrivacyManager(eps, delta, 1.0, rounds)
    doc_sigma = classical_sigma(epsilon=eps / math.sqrt(rounds), delta=delta)
    assert pm.get_noise_scale() < doc_sigma
    assert pm.whole_run_epsilon() <= eps


def test_rounds_are_charged_and_refused_after_num_rounds():
    pm = PrivacyManager(2.0, 1e-5, 1.0, 3)
    g = np.ones(5)
    for i in range(3):
        pm.apply_privacy(g)
        assert pm.rounds_used == i + 1
    status = pm.get_privacy_status()
    assert status["budget_exhausted"] and status["rounds_remaining"] == 0
    assert status["epsilon_spent"] == pytest.approx(pm.whole_run_epsilon(), rel=1e-9)
    assert status["epsilon_spent"] <= 2.0
    with pytest.raises(BudgetExhausted, match="3 rounds"):
        pm.apply_privacy(g)
    with pytest.raises(BudgetExhausted):
        pm.add_gaussian_noise(g)
    assert pm.rounds_used == 3


def test_status_keys_and_budget_view():
    pm = PrivacyManager(1.0, 1e-5, 0.5, 10)
    s = pm.get_privacy_status()
    assert s["epsilon_spent"] == 0.0 and s["epsilon_remaining"] == 1.0 and s["rounds_used"] == 0
    assert s["noise_scale"] == pytest.approx(pm.noise_multiplier * 0.5, rel=1e-5)
    assert s["private"] is True and s["accountant"] == "pld"
    pm.apply_privacy(np.ones(3))
    assert 0.0 < pm.privacy_budget.epsilon_remaining() < 1.0
    assert pm.privacy_budget.get_status()["rounds_remaining"] == 9
    assert pm.privacy_budget.get_status()["rounds_used"] == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "name"),
    [
        ((0.0, 1e-5), {}, InvalidParameter, "epsilon"),
        ((1.0, 1.5), {}, InvalidParameter, "delta"),
        ((1.0, 1e-5, -1.0), {}, InvalidParameter, "clip_norm"),
        ((1.0, 1e-5, 1.0, 0), {}, InvalidParameter, "num_rounds"),
        ((1.0, 1e-5, 1.0, 2.5), {}, InvalidParameter, "num_rounds"),
        ((1.0, 1e-5), {"sample_rate": 0.0}, InvalidParameter, "sample_rate"),
        ((1.0, 1e-5), {"noise": "loud"}, InvalidParameter, "noise"),
        ((1.0, 1e-5), {"accountant": "nonsense"}, InvalidParameter, "nonsense"),
        ((True, 1e-5), {}, TypeError, "epsilon"),
    ],
)
def test_bad_parameters(args, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        PrivacyManager(*args, **kwargs)


# ---- clipping ------------------------------------------------------------------------------------


def test_clip_gradients_dict_global_norm():
    pm = PrivacyManager(1.0, 1e-5, 1.0, 1)
    g = {"w": np.full((3, 4), 10.0, dtype=np.float32), "b": np.array([30.0, 40.0])}
    c = pm.clip_gradients(g)
    assert tree_norm(c) <= 1.0 and c["w"].dtype == np.float32 and c["b"].dtype == np.float64
    factor = tree_norm(c) / tree_norm(g)
    np.testing.assert_allclose(c["b"], g["b"] * factor, rtol=1e-6)  # one factor (up to the ulp guard)
    small = {"w": np.full(3, 0.1)}
    np.testing.assert_array_equal(pm.clip_gradients(small)["w"], small["w"])


def test_clip_gradients_array_document_example():
    pm = PrivacyManager(1.0, 1e-5, 1.0, 1)
    c = pm.clip_gradients(np.array([10.0, 20.0, 30.0]))  # norm about 37.4
    assert tree_norm(c) == pytest.approx(1.0, rel=1e-12) and tree_norm(c) <= 1.0
    np.testing.assert_allclose(c, np.array([10.0, 20.0, 30.0]) / math.sqrt(1400), rtol=1e-12)


def test_per_example_clipping_matches_a_loop():
    rng = np.random.default_rng(4)
    b = 16
    g = {"w": rng.standard_normal((b, 3, 2)) * 3, "b": rng.standard_normal((b, 2)) * 3}
    g["w"][0] *= 0.01  # one example already inside the ball
    pm = PrivacyManager(1.0, 1e-5, 1.5, 1)
    c = pm.clip_gradients(g, per_example=True)
    for i in range(b):
        expected, _ = clip_tree({"w": g["w"][i], "b": g["b"][i]}, 1.5)
        # Same scaling up to the clippers' last-ulp guards (relative 2**-20 at most).
        np.testing.assert_allclose(c["w"][i], expected["w"], rtol=2e-6)
        np.testing.assert_allclose(c["b"][i], expected["b"], rtol=2e-6)
        # clip_rows guarantees the norm in its own summation order; summing leaf by leaf may
        # round differently in the last bit.
        assert tree_norm({"w": c["w"][i], "b": c["b"][i]}) <= 1.5 * (1 + 1e-12)
    mixed = {"w": g["w"].astype(np.float32), "b": g["b"]}
    cm = pm.clip_gradients(mixed, per_example=True)
    assert cm["w"].dtype == np.float32 and cm["b"].dtype == np.float64
    for i in range(b):
        assert tree_norm({"w": cm["w"][i], "b": cm["b"][i]}) <= 1.5 * (1 + 1e-12)
    x = rng.standard_normal((8, 5)) * 4
    cx = pm.clip_gradients(x, per_example=True)
    # Within one ulp: clip_rows bounds its own (einsum) row sums; np.linalg.norm sums differently.
    assert np.all(np.linalg.norm(cx, axis=1) <= 1.5 * (1 + 1e-12))


def test_per_example_step_is_the_noisy_mean(no_noise):
    rng = np.random.default_rng(5)
    g = {"w": rng.standard_normal((10, 4)) * 5, "b": rng.standard_normal((10, 1))}
    pm = PrivacyManager(1.0, 1e-5, 1.0, 2)
    out = pm.apply_privacy(g, per_example=True)
    clipped = pm.clip_gradients(g, per_example=True)
    for k in g:
        assert out[k].shape == g[k].shape[1:]
        np.testing.assert_allclose(out[k], clipped[k].mean(axis=0), rtol=1e-12)
    pm2 = PrivacyManager(1.0, 1e-5, 1.0, 1, expected_batch_size=20)
    out2 = pm2.apply_privacy(g, per_example=True)
    np.testing.assert_allclose(out2["w"], clipped["w"].sum(axis=0) / 20, rtol=1e-12)


@pytest.mark.parametrize(
    ("g", "exc"),
    [
        ({"w": np.zeros((4, 2)), "b": np.zeros((3, 2))}, UnsafeInput),
        ({"w": np.float64(1.0)}, UnsafeInput),
    ],
    ids=["batch-mismatch", "scalar-no-batch"],
)
def test_per_example_shape_errors(g, exc):
    pm = PrivacyManager(1.0, 1e-5, 1.0, 1)
    with pytest.raises(exc):
        pm.apply_privacy(g, per_example=True)
    assert pm.rounds_used == 0


@pytest.mark.parametrize(
    ("g", "exc"),
    [
        (np.array([1.0, np.nan]), UnsafeInput),
        ({"w": np.array([np.inf])}, UnsafeInput),
        ({}, UnsafeInput),
        (np.zeros(0), UnsafeInput),
        (np.array([1 + 1j]), TypeError),
        (np.array([True]), TypeError),
    ],
    ids=["nan", "inf", "empty-dict", "empty", "complex", "bool"],
)
def test_bad_gradients_release_nothing(g, exc):
    pm = PrivacyManager(1.0, 1e-5, 1.0, 1)
    with pytest.raises(exc):
        pm.apply_privacy(g)
    with pytest.raises(exc):
        pm.add_gaussian_noise(g)
    assert pm.rounds_used == 0


# ---- noise ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", ["secure", "fast"])
def test_noise_level_chi_square(noise):
    """add_gaussian_noise on zeros has sd get_noise_scale() (two-sided chi-square, false alarm 1e-6)."""
    with pytest.warns(NotPrivateWarning):
        pm = PrivacyManager(1.0, 1e-5, 0.5, 10, noise=noise, seed=99)
    out = pm.add_gaussian_noise({"w": np.zeros((400, 250)), "b": np.zeros(1000, dtype=np.float32)})
    assert out["b"].dtype == np.float32
    x = np.concatenate([out["w"].ravel(), out["b"].astype(np.float64)])
    n, sigma = x.size, pm.get_noise_scale()
    stat = float(np.dot(x, x)) / sigma**2
    assert stats.chi2.ppf(ALPHA / 2, n) <= stat <= stats.chi2.isf(ALPHA / 2, n)
    assert stats.kstest(x[:20000] / sigma, "norm").pvalue > ALPHA


def test_seeded_runs_repeat_and_unseeded_do_not():
    with pytest.warns(NotPrivateWarning):
        a = PrivacyManager(1.0, 1e-5, 1.0, 2, seed=1)
    with pytest.warns(NotPrivateWarning):
        b = PrivacyManager(1.0, 1e-5, 1.0, 2, seed=1)
    g = np.zeros(20)
    a1, b1 = a.apply_privacy(g), b.apply_privacy(g)
    np.testing.assert_array_equal(a1, b1)
    assert not np.array_equal(a1, a.apply_privacy(g))
    assert a.get_privacy_status()["private"] is False
    c = PrivacyManager(1.0, 1e-5, 1.0, 2)
    assert not np.array_equal(c.apply_privacy(g), PrivacyManager(1.0, 1e-5, 1.0, 2).apply_privacy(g))


# ---- trainer -------------------------------------------------------------------------------------


def test_trainer_stats():
    pm = PrivacyManager(4.0, 1e-5, 1.0, 5)
    tr = DPSGDTrainer(pm)
    tr.clip_and_noise_gradients({"w": np.full(4, 10.0)})
    tr.clip_and_noise_gradients({"w": np.full((6, 4), 0.1)}, per_example=True)
    s = tr.get_stats()
    assert s["gradients_clipped"] == 7 and s["gradients_over_norm"] == 1
    assert s["noise_added"] == 2 and s["training_steps"] == 2
    assert s["privacy_budget"]["rounds_used"] == 2
    with pytest.raises(TypeError):
        DPSGDTrainer(object())  # type: ignore[arg-type]


def test_trainer_trains_a_linear_model():
    """DP-SGD on a least-squares problem still learns (utility sanity check, fixed seeds)."""
    rng = np.random.default_rng(0)
    n, d = 2000, 5
    w_true = rng.standard_normal(d)
    x = rng.standard_normal((n, d))
    y = x @ w_true
    with pytest.warns(NotPrivateWarning):
        pm = PrivacyManager(
            8.0, 1e-5, 1.0, 200, sample_rate=0.1, expected_batch_size=200, noise="fast", seed=0
        )
    tr = DPSGDTrainer(pm)
    w = np.zeros(d)
    sampler = np.random.default_rng(1)
    for _ in range(200):
        idx = np.flatnonzero(sampler.random(n) < 0.1)
        per_example = (x[idx] @ w - y[idx])[:, None] * x[idx]
        w -= 0.5 * tr.clip_and_noise_gradients(per_example, per_example=True)
    assert np.linalg.norm(w - w_true) < 0.5 * np.linalg.norm(w_true)
    assert tr.get_stats()["privacy_budget"]["epsilon_spent"] <= 8.0


# ---- YAML configuration --------------------------------------------------------------------------

DOC_001_YAML = """\
privacy:
  use_differential_privacy: true
  epsilon: 1.0
  delta: 1e-5
  clip_norm: 1.0
  composition: "advanced"  # or "basic"
  num_rounds: 50
"""


def test_from_yaml_document_block(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "fl_config.yaml"
    path.write_text(DOC_001_YAML)
    pm = PrivacyManager.from_yaml(path)
    assert pm is not None
    assert (pm.epsilon, pm.delta, pm.clip_norm, pm.num_rounds) == (1.0, 1e-5, 1.0, 50)
    assert pm.get_privacy_status()["composition_requested"] == "advanced"
    assert pm.accountant_name == "pld"
    assert pm.whole_run_epsilon() <= 1.0


def test_from_yaml_disabled_and_errors(tmp_path):
    pytest.importorskip("yaml")
    off = tmp_path / "off.yaml"
    off.write_text("privacy:\n  use_differential_privacy: false\n")
    assert PrivacyManager.from_yaml(off) is None
    typo = tmp_path / "typo.yaml"
    typo.write_text("privacy:\n  epsilom: 1.0\n  delta: 1.0e-5\n")
    with pytest.raises(InvalidParameter, match="epsilom"):
        PrivacyManager.from_yaml(typo)
    missing = tmp_path / "missing.yaml"
    missing.write_text("privacy:\n  epsilon: 1.0\n")
    with pytest.raises(InvalidParameter, match="delta"):
        PrivacyManager.from_yaml(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("privacy:\n  epsilon: lots\n  delta: 1.0e-5\n")
    with pytest.raises(TypeError, match="epsilon"):
        PrivacyManager.from_yaml(bad)
    comp = tmp_path / "comp.yaml"
    comp.write_text("privacy:\n  epsilon: 1.0\n  delta: 1.0e-5\n  composition: moments\n")
    with pytest.raises(InvalidParameter, match="composition"):
        PrivacyManager.from_yaml(comp)


def test_document_004_class_is_reexported():
    assert sgd.GaussianDifferentialPrivacy is gaussdp.paramdict.GaussianDifferentialPrivacy


def test_clip_norm_and_noise_multiplier_cannot_be_changed_after_calibration():
    """The noise was calibrated for clip_norm: clipping to a larger bound afterwards would release
    gradients with too little noise, so both are read-only."""
    pm = PrivacyManager(epsilon=1.0, delta=1e-5, clip_norm=1.0, num_rounds=10)
    with pytest.raises(AttributeError):
        pm.clip_norm = 10.0
    with pytest.raises(AttributeError):
        pm.noise_multiplier = 0.1
    assert pm.clip_norm == 1.0
    assert pm.get_noise_scale() == pytest.approx(pm.noise_multiplier * pm.clip_norm, rel=1e-5)
