"""Client side: clip the update (not the model), local DP charged per client, document 003's coresets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gaussdp.budget import Ledger
from gaussdp.calibration import sigma_for
from gaussdp.errors import BudgetExhausted, InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.federated import LocalGaussian, clip_update, round_report, sanitize_coreset


def test_clip_update_clips_the_difference_not_the_parameters() -> None:
    glob = {"w": np.full((2, 2), 10.0), "b": np.array([5.0])}
    local = {"w": glob["w"] + 3.0, "b": glob["b"] - 4.0}  # delta norm sqrt(4*9 + 16) = sqrt(52)
    delta, norm = clip_update(local, glob, 1.0)
    assert norm == pytest.approx(math.sqrt(52))
    assert math.sqrt(sum(float(np.sum(v**2)) for v in delta.values())) <= 1.0
    np.testing.assert_allclose(delta["w"], np.full((2, 2), 3 / math.sqrt(52)))
    np.testing.assert_allclose(delta["b"], [-4 / math.sqrt(52)])
    # A small update is returned as is, although the parameters themselves have a large norm.
    small, n2 = clip_update([np.array([10.1, 9.9])], [np.array([10.0, 10.0])], 1.0)
    assert n2 == pytest.approx(math.sqrt(0.02)) and np.allclose(small[0], [0.1, -0.1])


def test_clip_update_refuses_mismatched_trees() -> None:
    with pytest.raises(UnsafeInput, match="shape"):
        clip_update([np.ones(3)], [np.ones(4)], 1.0)
    with pytest.raises(UnsafeInput, match="keys"):
        clip_update({"a": np.ones(3)}, {"b": np.ones(3)}, 1.0)
    with pytest.raises(UnsafeInput):
        clip_update([np.array([np.nan])], [np.array([0.0])], 1.0)


def test_clip_update_keeps_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    delta, norm = clip_update([torch.tensor([3.0, 4.0])], [torch.zeros(2)], 1.0)
    assert isinstance(delta[0], torch.Tensor) and norm == pytest.approx(5.0)


def test_local_gaussian_calibrates_for_replacement_and_charges_each_client() -> None:
    led = Ledger("memory://")
    local = LocalGaussian(
        clip_norm=0.5,
        epsilon=2.0,
        delta=1e-5,
        ledger=led,
        budget_epsilon=4.0,
        budget_delta=1e-5,
        accountant="rdp",
        noise="fast",
    )
    # Local DP hides any change of the update: sensitivity 2C, calibrated exactly (not classically).
    assert local.sigma == pytest.approx(sigma_for(epsilon=2.0, delta=1e-5, sensitivity=1.0))
    g = [np.zeros(50_000)]
    out = local.privatize([np.full(50_000, 0.01)], g, client_id=7, round_num=1)
    # The delta has norm sqrt(50000)*0.01 = 2.24 > C: clipped to 0.5, then noise of stddev sigma.
    resid = out[0] - 0.5 / math.sqrt(50_000)
    assert abs(resid.std() / local.sigma - 1) < 5 / math.sqrt(2 * 50_000)
    local.privatize([np.ones(3)], [np.zeros(3)], client_id=8, round_num=1)
    assert led.principals("client/") == ["client/7", "client/8"]
    # Client 7 spends its own budget; client 8's is untouched by it.
    with pytest.raises(BudgetExhausted):
        for r in range(2, 10):
            local.privatize([np.ones(3)], [np.zeros(3)], client_id=7, round_num=r)
    assert led.spent("client/8").epsilon < led.spent("client/7").epsilon <= 4.0
    report = round_report(led, prefix="client/")
    assert (
        "round_1" in report["expenditures_by_round"] and len(report["expenditures_by_round"]["round_1"]) == 2
    )


def test_local_gaussian_needs_a_calibration() -> None:
    with pytest.raises(InvalidParameter, match="epsilon and delta"):
        LocalGaussian(clip_norm=1.0)
    with pytest.raises(InvalidParameter, match="budget"):
        LocalGaussian(clip_norm=1.0, noise_multiplier=1.0, ledger="memory://")


def test_document_003_flow_coreset_sanitized_after_charge() -> None:
    from gaussdp.embeddings import DPConfig, EmbeddingSanitizer

    led = Ledger("memory://")
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=1.0), noise="fast")
    rng = np.random.default_rng(0)
    for rnd in (1, 2):
        for client in (0, 1, 2):
            coreset = rng.normal(size=(16, 8)).astype(np.float32)
            out = sanitize_coreset(
                san,
                coreset,
                client_id=client,
                round_num=rnd,
                ledger=led,
                budget_epsilon=10.0,
                budget_delta=1e-5,
                accountant="rdp",
            )
            assert out.shape == coreset.shape and out.dtype == np.float32
    report = round_report(led, prefix="client/")
    assert [len(v) for v in report["expenditures_by_round"].values()] == [3, 3]
    assert report["num_expenditures"] == 6
    # Tight composition of two (1, 1e-5)-calibrated releases: well below document 003's sum of 2.
    assert 1.0 < report["total_epsilon"] < 2.0
    with pytest.raises(InvalidParameter, match="disabled"):
        sanitize_coreset(
            EmbeddingSanitizer(DPConfig(enabled=False)), np.ones((2, 2)), client_id=0, round_num=1
        )


def test_local_gaussian_rows_for_the_simulator() -> None:
    led = Ledger("memory://")
    local = LocalGaussian(
        clip_norm=1.0,
        noise_multiplier=0.5,
        ledger=led,
        budget_epsilon=50.0,
        budget_delta=1e-5,
        accountant="rdp",
        noise="fast",
    )
    deltas = np.zeros((3, 40_000), dtype=np.float32)
    deltas[:, 0] = [0.5, 2.0, 9.0]
    out = local.privatize_rows(deltas, [4, 5, 6], round_num=1)
    assert out.shape == deltas.shape and out.dtype == np.float32
    # sigma = z * 2C = 1; the clipped first coordinates are 0.5, 1, 1.
    assert abs(out[:, 1:].std() - 1.0) < 5 / math.sqrt(2 * out[:, 1:].size)
    assert led.principals("client/") == ["client/4", "client/5", "client/6"]
    assert all(led.history(f"client/{c}")[0].idempotency_key == f"client/{c}#round=1" for c in (4, 5, 6))


def test_local_noise_is_one_release_over_the_tree_and_keeps_leaf_types() -> None:
    torch = pytest.importorskip("torch")
    with pytest.warns(NotPrivateWarning):
        local = LocalGaussian(clip_norm=1.0, noise_multiplier=1.0, seed=3)
    update = {"w": torch.tensor([0.3, 0.4]), "b": np.array([0.1], dtype=np.float32)}
    out = local.privatize(update, {"w": torch.zeros(2), "b": np.zeros(1, np.float32)}, client_id=1)
    assert isinstance(out["w"], torch.Tensor) and out["w"].dtype == torch.float32
    assert isinstance(out["b"], np.ndarray) and out["b"].dtype == np.float32


def test_seeded_rows_draw_fresh_noise_every_round() -> None:
    with pytest.warns(NotPrivateWarning):
        local = LocalGaussian(clip_norm=1.0, noise_multiplier=1.0, seed=3)
    deltas = np.zeros((4, 8), dtype=np.float32)
    r1 = local.privatize_rows(deltas, [0, 1, 2, 3], round_num=1)
    r2 = local.privatize_rows(deltas, [0, 1, 2, 3], round_num=2)
    assert not np.array_equal(r1, r2)


def test_calibrated_settings_are_set_once() -> None:
    """LocalGaussian's clip_norm, sensitivity and sigma, and an EmbeddingSanitizer's config and
    mechanism, were calibrated together: reassigning one (a larger clip norm, say) would release at a
    sensitivity the charge was not computed for, so it is refused (gaussdp._validate.SetOnce)."""
    from gaussdp.embeddings import DPConfig, EmbeddingSanitizer

    local = LocalGaussian(clip_norm=0.5, epsilon=2.0, delta=1e-5, noise="fast")
    for name in ("clip_norm", "sensitivity", "sigma"):
        with pytest.raises(AttributeError, match="fixed when the LocalGaussian is made"):
            setattr(local, name, 10.0)
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=1.0), noise="fast")
    bigger = DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=10.0)
    with pytest.raises(AttributeError, match="fixed when the EmbeddingSanitizer is made"):
        san.config = bigger
    with pytest.raises(AttributeError, match="mechanism"):
        san.mechanism = None
    assert local.clip_norm == 0.5 and san.config.clipping_norm == 1.0
