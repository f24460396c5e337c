"""make_private(..., noise_mechanism="banded-mf"): accounting, correlated noise, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp import accounting  # noqa: E402
from gaussdp.errors import InvalidParameter  # noqa: E402
from gaussdp.mf import BandedMFPlan, toeplitz_matrix  # noqa: E402
from gaussdp.torch import PrivacyEngine  # noqa: E402


def _data(n=64, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def _private(*, sigma=1.0, bands=3, epochs=3, n=64, batch_size=16, shuffle=True, width=8, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))
    engine = PrivacyEngine()
    m, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch_size, shuffle=shuffle),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        poisson_sampling=False,
        noise_mechanism="banded-mf",
        bands=bands,
        epochs=epochs,
        **kw,
    )
    return engine, m, opt, dl


def _train_epoch(model, opt, loader, zero_loss=False):
    for x, y in loader:
        opt.zero_grad()
        out = model(x)
        loss = (out * 0.0).sum() if zero_loss else nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()


def test_engine_epsilon_equals_the_mf_accountant():
    engine, model, opt, loader = _private(sigma=1.3, bands=3, epochs=3)
    plan = BandedMFPlan.cyclic(steps_per_epoch=4, epochs=3, bands=3)
    for epoch in range(3):
        _train_epoch(model, opt, loader)
        prefix = accounting.accountant("pld").compose(plan.event(1.3, upto=4 * (epoch + 1)))
        assert engine.get_epsilon(1e-5) >= prefix.epsilon(1e-5)
        assert engine.get_epsilon(1e-5) == pytest.approx(prefix.epsilon(1e-5), rel=1e-12)
    assert engine.steps == 12
    # the whole run: the existing MF accounting of the same strategy and participation
    whole = accounting.banded_matrix_factorization_event(
        1.3, toeplitz_matrix(plan.coefficients, 12), bands=3, min_separation=4, max_participations=3
    )
    want = accounting.accountant("pld").compose(whole).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert engine.get_epsilon(1e-5) >= want


def test_charge_happens_before_the_epochs_first_release():
    engine, model, opt, loader = _private(sigma=2.0, bands=2, epochs=2)
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    plan = BandedMFPlan.cyclic(steps_per_epoch=4, epochs=2, bands=2)
    first = accounting.accountant("pld").compose(plan.event(2.0, upto=4)).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(first, rel=1e-12)


def test_steps_past_the_plan_are_refused():
    engine, model, opt, loader = _private(bands=2, epochs=1)
    _train_epoch(model, opt, loader)
    eps = engine.get_epsilon(1e-5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidParameter, match="planned for 4 steps"):
        _train_epoch(model, opt, loader)
    assert engine.get_epsilon(1e-5) == eps
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_batches_are_the_same_every_epoch():
    _, _, _, loader = _private(bands=2, epochs=3, shuffle=True)
    first = [x.clone() for x, _ in loader]
    second = [x.clone() for x, _ in loader]
    assert len(first) == 4
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_skipping_a_batch_is_refused():
    _, model, opt, loader = _private(bands=2, epochs=2)
    it = iter(loader)
    next(it)  # handed out, never used
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(InvalidParameter, match="must use the next batch"):
        opt.step()


def test_noise_multiplier_change_is_refused():
    _, model, opt, loader = _private(bands=2, epochs=2)
    opt.noise_multiplier = 0.5
    with pytest.raises(InvalidParameter, match="same noise_multiplier"):
        _train_epoch(model, opt, loader)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poisson_sampling": True}, "needs poisson_sampling=False"),
        ({"bands": None}, "needs bands and epochs"),
        ({"bands": 5}, r"bands must be <= the steps per epoch \(len\(data_loader\) = 4\)"),
        ({"noise_mechanism": "tree"}, "noise_mechanism"),
    ],
)
def test_refusals_name_the_argument(kwargs, match):
    model = nn.Linear(6, 3)
    args = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": DataLoader(_data(64), batch_size=16),
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "poisson_sampling": False,
        "noise_mechanism": "banded-mf",
        "bands": 2,
        "epochs": 2,
    }
    args.update(kwargs)
    with pytest.raises(InvalidParameter, match=match):
        PrivacyEngine().make_private(**args)


def test_bands_without_mf_refused():
    model = nn.Linear(6, 3)
    with pytest.raises(InvalidParameter, match="bands and epochs are arguments"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(64), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            bands=2,
        )


def _whitened_noise_ok() -> bool:
    """With zero gradients, p.grad after each step is the noise alone: whitened by C (and the
    batch's std) it must be independent N(0, 1) across steps (Bonferroni, false alarm < 1e-6)."""
    sigma, bands, epochs, batch = 1.5, 3, 2, 16
    engine, model, opt, loader = _private(
        sigma=sigma, bands=bands, epochs=epochs, batch_size=batch, width=800
    )
    noises = []
    for _ in range(epochs):
        for x, _ in loader:
            opt.zero_grad()
            (model(x) * 0.0).sum().backward()
            opt.step()
            noises.append(torch.cat([p.grad.detach().flatten() for p in model.parameters()]).double().numpy())
    y = np.stack(noises)  # (steps, coordinates)
    n, d = y.shape
    std = sigma * 1.0 / batch
    w = toeplitz_matrix(engine.mf.plan.coefficients, n) @ y / std  # should be iid N(0, 1)
    emp = w @ w.T / d
    z = stats.norm.isf(1e-6 / 2 / (n * (n + 1) / 2))
    se = np.sqrt((np.ones((n, n)) + np.eye(n)) / d)
    return bool(np.all(np.abs(emp - np.eye(n)) <= z * se))


def test_gradient_noise_is_correlated_as_the_strategy():
    assert _whitened_noise_ok()


def test_noise_check_catches_independent_noise(monkeypatch):
    from gaussdp.mf import BandedNoise

    monkeypatch.setattr(BandedNoise, "next", lambda self, key, fresh: fresh)  # DP-SGD's noise
    assert not _whitened_noise_ok()


def test_make_private_with_epsilon_meets_the_target():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    engine = PrivacyEngine()
    _, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(64), batch_size=16),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=3,
        max_grad_norm=1.0,
        poisson_sampling=False,
        noise_mechanism="banded-mf",
        bands=2,
    )
    for _ in range(3):
        _train_epoch(model, opt, loader)
    assert 1.999 < engine.get_epsilon(1e-5) <= 2.0 * (1 + 1e-12)
    with pytest.raises(InvalidParameter, match="banded-mf"):
        engine.save_checkpoint(path="/dev/null", module=model)


def test_convolutions_train_with_mf_noise():
    """Per-sample sums of a convolution can be non-contiguous: the noise is drawn contiguous."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    data = TensorDataset(torch.randn(32, 1, 6, 6), torch.randint(0, 3, (32,)))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        noise_mechanism="banded-mf",
        bands=2,
        epochs=2,
    )
    for _ in range(2):
        _train_epoch(model, opt, loader)
    assert engine.steps == 8 and all(torch.isfinite(p).all() for p in model.parameters())


def test_noise_outside_the_certified_domain_is_refused_at_make_private():
    model = nn.Linear(6, 3)
    with pytest.raises(InvalidParameter, match=r"noise_multiplier=0\.0003 over the strategy's sensitivity"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(64), batch_size=16),
            noise_multiplier=3e-4,
            max_grad_norm=1.0,
            poisson_sampling=False,
            noise_mechanism="banded-mf",
            bands=4,
            epochs=16,
        )


def test_noise_memory_is_bands_times_the_trainable_parameters():
    _, model, opt, loader = _private(bands=3, epochs=2, width=50)
    _train_epoch(model, opt, loader)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ring = opt.correlated.buffered_values()
    work = sum(opt.correlated.scratch(p).numel() for p in model.parameters())
    assert ring == 2 * trainable and work == trainable  # (b - 1) + 1 = b x parameters


def test_frozen_parameters_have_no_buffer():
    """Only trainable parameters are noised, so adapters (LoRA) keep the buffer small."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 200), nn.ReLU(), nn.Linear(200, 3))
    model[0].requires_grad_(False)
    _, opt, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(_data(64), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        noise_mechanism="banded-mf",
        bands=4,
        epochs=1,
    )
    _train_epoch(model, opt, loader)
    assert opt.correlated.buffered_values() == 3 * (200 * 3 + 3)
