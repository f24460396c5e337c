"""PrivacyEngine: Opacus-shaped API, accounting after every step, Poisson batches, noise level."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp import accounting  # noqa: E402
from gaussdp.errors import (  # noqa: E402
    InvalidParameter,
    NotPrivateWarning,
    PrivacyError,
    UnsafeInput,
)
from gaussdp.torch import DPDataLoader, PrivacyEngine, split_batch  # noqa: E402
from gaussdp.torch._random import KeystreamNormal, keystream_normal_available  # noqa: E402


def _data(n=64, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def _setup(sigma=1.0, clip=1.0, batch_size=16, lr=0.1, seed=None, n=64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(seed=seed)
    loader = DataLoader(_data(n), batch_size=batch_size)
    m, o, dl = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip
    )
    return engine, m, o, dl


def test_make_private_keeps_module_and_charges_every_step():
    engine, model, opt, loader = _setup(sigma=1.1)
    assert type(model) is nn.Sequential
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert isinstance(loader, DPDataLoader)
    assert loader.sample_rate == pytest.approx(16 / 64)
    assert engine.get_epsilon(1e-5) == 0.0
    for k, (x, y) in enumerate(loader, start=1):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ref = accounting.accountant("pld").compose(
            accounting.SubsampledGaussianEvent(1.1, loader.sample_rate), count=k
        )
        assert engine.get_epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-9)
    assert engine.steps == len(loader)
    prev = engine.get_epsilon(1e-5)
    assert prev > 0 and math.isfinite(prev)


def test_empty_poisson_batches_and_fixed_denominator():
    torch.manual_seed(0)
    ds = _data(n=40)
    loader = DPDataLoader(ds, sample_rate=0.02, steps=30, generator=torch.Generator().manual_seed(3))
    sizes = [len(x) for x, _ in loader]
    assert 0 in sizes and max(sizes) > 0  # empty batches do occur at this rate
    x, y = next((x, y) for x, y in loader if len(x) == 0)
    model = nn.Linear(6, 3)
    with pytest.warns(NotPrivateWarning):
        engine = PrivacyEngine(seed=1)
        _, opt, _dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(ds, batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    before = model.weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()  # an empty batch: mean loss is NaN, grads empty
    opt.step()
    # the step still happens (noise only) and is charged
    assert engine.steps == 1 and not torch.equal(before, model.weight)
    assert torch.isfinite(model.weight).all()


def test_virtual_batches_equal_one_batch_and_divide_by_expected_size():
    ds = _data(n=48)
    updates = []
    for physical in (None, 5):
        with pytest.warns(NotPrivateWarning):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            start = [p.detach().clone() for p in model.parameters()]
            engine = PrivacyEngine(seed=5)
            _, opt, dl = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(ds, batch_size=12),
                noise_multiplier=0.0,
                max_grad_norm=0.3,
            )
        x, y = next(iter(dl))
        assert len(x) > 5
        for xb, yb in split_batch((x, y), physical or len(x)):
            nn.functional.cross_entropy(model(xb), yb).backward()
        summed = [opt.summed_grads[p].clone() for p in model.parameters()]
        opt.step()
        update = [s - p.detach() for s, p in zip(start, model.parameters(), strict=True)]
        for u, s in zip(update, summed, strict=True):
            torch.testing.assert_close(u, s / dl.expected_batch_size)  # fixed denominator q*N = 12
        updates.append(update)
    for a, b in zip(*updates, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_noise_level():
    """Noise std sigma*C/(qN) per coordinate. 5-sigma bounds on the sample std and mean: false-alarm
    rate about 1.1e-6 for this fixed seed's distribution (two two-sided normal tails at 5 SE)."""
    sigma, clip = 2.0, 0.5
    model, opt, dl = _linear_100(11, sigma, clip)
    noise = _pure_noise_update(opt, model)
    n = noise.numel()
    expected = sigma * clip / dl.expected_batch_size
    se_std = 1 / math.sqrt(2 * n)
    assert abs(float(noise.std()) / expected - 1) < 5 * se_std
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(n)


def _linear_100(seed, sigma, clip=1.0):
    """A seeded (not private) engine on nn.Linear(100, 100), 40 rows, batches of 8 (q = 0.2)."""
    model = nn.Linear(100, 100)
    with pytest.warns(NotPrivateWarning):
        _, opt, dl = PrivacyEngine(seed=seed).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randn(40, 100)), batch_size=8),
            noise_multiplier=sigma,
            max_grad_norm=clip,
        )
    return model, opt, dl


def _pure_noise_update(opt, model):
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt.step()  # no samples: the update is pure noise
    return (before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).double()


def test_noise_is_fresh_each_step_and_follows_the_noise_multiplier():
    """Independent noise between steps (sample correlation within 5 standard errors of 0, false
    alarm ~6e-7), at the new scale when the noise multiplier changes between steps (std within 5
    standard errors)."""
    model, opt, dl = _linear_100(3, 1.0)
    first, second = _pure_noise_update(opt, model), _pure_noise_update(opt, model)
    n = first.numel()
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 5 / math.sqrt(n)
    opt.noise_multiplier = 3.0
    third = _pure_noise_update(opt, model)
    expected = 3.0 / dl.expected_batch_size
    assert abs(float(third.std()) / expected - 1) < 5 / math.sqrt(2 * n)


def test_noise_added_once_per_step_over_micro_batches():
    """Clipped sums accumulated in place over two micro-batches get the noise once: its std is
    sigma*C/(qN) (not sqrt(2) times, not 0), within 5 SE. sigma is so large that the clipped data
    (norm <= C per sample) cannot move the sample std measurably."""
    sigma, clip = 1e4, 1.0
    model, opt, dl = _linear_100(8, sigma, clip)
    (x,) = next(iter(dl))
    assert len(x) > 1
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    for xb in split_batch((x,), len(x) // 2 or 1):
        model(xb[0]).sum().div(len(x)).backward()
    opt.step()
    noise = (before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).double()
    expected = sigma * clip / dl.expected_batch_size
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())


@pytest.mark.parametrize(("at_backward", "at_step", "total"), [(1.0, 3.0, 3.0), (3.0, 1.0, 3.0)])
def test_noise_drawn_during_backward_follows_a_changed_multiplier(at_backward, at_step, total):
    """The step's noise is drawn into the sums' buffers when backward forms them. A multiplier raised
    before step() gets the missing N(0, new^2 - old^2), so the total std is the new one; a lowered
    one keeps the larger noise already drawn (charged at the lower multiplier: still an upper
    bound). Zero-gradient loss: the update is the noise alone. 5 SE on the std (false alarm ~6e-7)."""
    model, opt, dl = _linear_100(4, at_backward)
    (x,) = next(iter(dl))
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    model(x).mul(0.0).sum().backward()
    assert set(opt.clipper.noised) == set(model.parameters())  # drawn during backward
    opt.noise_multiplier = at_step
    opt.step()
    assert opt.clipper.noised == {}
    noise = (before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).double()
    expected = total / dl.expected_batch_size
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())


def test_each_step_is_charged_at_the_multiplier_it_uses():
    """The optimizer's noise_multiplier may change between steps (as in Opacus): each step is charged
    at the multiplier its noise uses. Lowered to 0.5, epsilon equals one
    SubsampledGaussianEvent(0.5, q) (charging the engine's original 1.0 would under-count). NaN is
    refused with nothing charged or released; 0 makes the run non-private: warned, epsilon inf."""
    engine, model, opt, loader = _setup(sigma=1.0)
    opt.noise_multiplier = 0.5
    opt.step()
    ref = accounting.accountant("pld").compose(accounting.SubsampledGaussianEvent(0.5, loader.sample_rate))
    assert engine.get_epsilon(1e-5) == pytest.approx(ref.epsilon(1e-5), rel=1e-12)
    before = [p.detach().clone() for p in model.parameters()]
    opt.noise_multiplier = float("nan")
    with pytest.raises(InvalidParameter, match="noise_multiplier"):
        opt.step()
    assert engine.steps == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    opt.noise_multiplier = 0.0
    with pytest.warns(NotPrivateWarning, match="NOT private"):
        opt.step()
    assert engine.get_epsilon(1e-5) == math.inf


def test_max_grad_norm_set_on_the_optimizer_clips_and_scales_the_noise():
    """As in Opacus, optimizer.max_grad_norm may be changed between steps: it is the clipper's bound,
    so clipping and the noise scale change together (update std sigma * C / (qN), 5 SE). It cannot
    change while clipped sums are pending (they were clipped to the old bound), nor be set to 0."""
    model, opt, dl = _linear_100(6, 2.0, clip=1.0)
    opt.max_grad_norm = 0.25
    assert opt.clipper.max_grad_norm == 0.25
    (x,) = next(iter(dl))
    model(x).sum().backward()
    assert float(opt.clipper.last_norms.max()) > 0.25  # so the new bound clips
    with pytest.raises(InvalidParameter, match="between backward"):
        opt.max_grad_norm = 0.1
    opt.zero_grad()
    with pytest.raises(InvalidParameter, match="max_grad_norm"):
        opt.max_grad_norm = 0.0
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    (x,) = next(iter(dl))  # zero_grad() dropped the first batch with its sums: a new one
    model(x).sum().backward()  # the clipped data (norm <= C per sample) is ~0.5% of the noise's std
    opt.step()
    noise = (before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).double()
    expected = 2.0 * 0.25 / dl.expected_batch_size
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())


def test_per_layer_clipping_through_the_engine():
    """make_private(clipping="per_layer", max_grad_norm=[...]) as in Opacus: the noise std is
    sigma * sqrt(sum C_p^2) / (qN) (5 SE), and a list of the wrong length is refused by name."""
    model = nn.Linear(100, 100)
    with pytest.warns(NotPrivateWarning):
        _, opt, dl = PrivacyEngine(seed=9).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randn(40, 100)), batch_size=8),
            noise_multiplier=2.0,
            max_grad_norm=[0.3, 0.4],
            clipping="per_layer",
        )
    assert opt.max_grad_norm == pytest.approx(0.5)
    noise = _pure_noise_update(opt, model)
    expected = 2.0 * 0.5 / dl.expected_batch_size
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())
    with pytest.raises(InvalidParameter, match="max_grad_norm has 1 bounds"):
        PrivacyEngine().make_private(
            module=nn.Linear(3, 2),
            optimizer=torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=[1.0],
            clipping="per_layer",
        )


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_failed_backward_blocks_the_step_until_zero_grad(clipping):
    """NaN gradients fail the backward pass; step() then refuses (nothing released) until
    zero_grad(), even where some per-layer sums were already formed."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.warns(NotPrivateWarning):
        _, opt, dl = PrivacyEngine(seed=12).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping=clipping,
        )
    x, y = next(iter(dl))
    assert len(x) > 0
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsafeInput, match="NaN"):
        (nn.functional.cross_entropy(model(x), y) * float("nan")).backward()
    with pytest.raises(PrivacyError, match="zero_grad"):
        opt.step()
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_zero_grad_discards_accumulated_sums():
    """A batch accumulated and then dropped by zero_grad() leaves nothing in the next release: with
    negligible noise the update is the next batch's clipped sum alone."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = [p.detach().clone() for p in model.parameters()]
    xa, xb = torch.randn(8, 4) * 100, torch.randn(8, 4)
    with pytest.warns(NotPrivateWarning):
        _, opt, loader = PrivacyEngine(seed=4).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.cat([xa, xb])), batch_size=8),
            noise_multiplier=2e-4,  # the smallest accepted for fixed batches: std 2.5e-4 here
            max_grad_norm=10.0,
            poisson_sampling=False,
        )
    batches = iter(loader)
    model(next(batches)[0]).sum().div(8).backward()  # xa; a mean over the batch (loss_reduction="mean")
    opt.zero_grad()  # xa's batch is dropped with its sums
    model(next(batches)[0]).sum().div(8).backward()  # xb
    opt.step()
    ref = nn.Linear(4, 2)
    with torch.no_grad():
        for r, s0 in zip(ref.parameters(), start, strict=True):
            r.copy_(s0)
    ref(xb).sum().div(8).backward()  # unclipped: every per-sample norm here is below 10
    assert float(opt.clipper.last_norms.max()) < 10.0
    for p, r, s0 in zip(model.parameters(), ref.parameters(), start, strict=True):
        torch.testing.assert_close(s0 - p.detach(), r.grad, rtol=1e-5, atol=2e-3)  # xa would move it by ~1


def test_trainable_parameters_missing_from_optimizer_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with pytest.raises(InvalidParameter, match=r"1\.weight"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1),
            data_loader=DataLoader(_data(8, 3), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    model(torch.randn(2, 3)).sum().backward()  # no hooks were left behind
    assert model[1].weight.grad is not None


def test_step_that_moves_nothing_is_reported():
    model = nn.Linear(6, 3)
    with pytest.warns(NotPrivateWarning):
        _, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(16), batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
        )
    with pytest.raises(RuntimeError, match="no trainable parameter changed"):
        opt.step()


def test_batch_not_in_dimension_zero_fails_closed():
    ds = TensorDataset(torch.randn(64, 5, 4))
    model = nn.Linear(4, 2)
    engine = PrivacyEngine()
    _, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for (x,) in dl:
        if len(x) not in (0, 5):
            break
    model(x.transpose(0, 1)).sum().backward()  # (T, B, E): Linear sees T as the batch
    with pytest.raises(UnsafeInput, match="batch_first"):
        opt.step()
    assert engine.steps == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
    ],
)
def test_bad_parameters_named(kwargs, match):
    model = nn.Linear(6, 3)
    args = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **kwargs}
    with pytest.raises(InvalidParameter, match=match):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(16), batch_size=4),
            **args,
        )


def test_make_private_with_epsilon_reaches_target():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    engine = PrivacyEngine()
    _, opt, dl = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(64), batch_size=16),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=3,
        max_grad_norm=1.0,
    )
    for _ in range(3):
        for x, y in dl:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    eps = engine.get_epsilon(1e-5)
    assert 1.9 < eps <= 2.0 * (1 + 1e-6)


def test_two_poisson_batches_in_one_step_refused():
    engine, model, opt, loader = _setup(sigma=1.0)
    it = iter(loader)
    used = 0
    while used < 2:
        x, y = next(it)
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
            used += 1
    with pytest.raises(UnsafeInput, match="one batch"):
        opt.step()
    assert engine.steps == 0


def test_poisson_sampling_rate():
    """Total draws over 200 steps ~ Binomial(200 * 500, 0.1): mean 10000, sd 94.9. Bound 5 sd: false
    alarm about 6e-7. Each batch has no repeated index."""
    sampler = DPDataLoader(_data(500), sample_rate=0.1, steps=200).batch_sampler_
    batches = list(sampler)
    assert all(len(set(b)) == len(b) for b in batches)
    total = sum(len(b) for b in batches)
    assert abs(total - 10000) < 5 * math.sqrt(200 * 500 * 0.1 * 0.9)


def _one_pure_noise_step(engine, sigma=2.0, clip=0.5):
    """``engine`` made private on nn.Linear(60, 50) (40 rows, batches of 8: q = 0.2), then one step
    with no samples. Returns the optimizer, the update (pure noise) and its std sigma C / (qN)."""
    model = nn.Linear(60, 50)
    _, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(torch.randn(40, 60)), batch_size=8),
        noise_multiplier=sigma,
        max_grad_norm=clip,
    )
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt.step()
    noise = (before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).double()
    return opt, noise, sigma * clip / dl.expected_batch_size


def test_secure_noise_source_level():
    """As test_noise_level with the CSPRNG source: 5-SE bound on the std, false alarm ~6e-7."""
    _, noise, expected = _one_pure_noise_step(PrivacyEngine(noise="secure"))
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())
    with pytest.raises(InvalidParameter, match="noise"):
        PrivacyEngine(noise="laplace")
    # get_epsilon prints upper bounds only: the CLT approximation is refused by name
    with pytest.raises(InvalidParameter, match="accountant='gdp' is an approximation"):
        PrivacyEngine(accountant="gdp")


@pytest.mark.skipif(not keystream_normal_available(), reason="gaussdp._gauss or cryptography missing")
def test_default_noise_is_the_keystream_at_the_right_level():
    """No seed: the noise comes from the AES-CTR keystream (said in noise_stream), at std
    sigma C / (qN) per coordinate and mean 0 (5 standard errors each, false alarm ~6e-7)."""
    engine = PrivacyEngine()
    opt, noise, expected = _one_pure_noise_step(engine)
    assert isinstance(opt.generator, KeystreamNormal)
    assert "AES-128-CTR" in engine.noise_stream
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(noise.numel())


def test_seeded_or_kernel_less_engines_use_torchs_generator(monkeypatch):
    """A seed makes the noise torch.randn from that seed (warned); without the kernel (or
    cryptography) it is torch.randn from an OS-seeded generator. noise_stream says which."""
    with pytest.warns(NotPrivateWarning):
        seeded = PrivacyEngine(seed=3)
        opt, _, _ = _one_pure_noise_step(seeded)
    assert isinstance(opt.generator, torch.Generator)
    assert "Mersenne" in seeded.noise_stream
    import gaussdp.torch.engine as engine_module

    monkeypatch.setattr(engine_module, "keystream_normal_available", lambda: False)
    fallback = PrivacyEngine()
    opt, noise, expected = _one_pure_noise_step(fallback)
    assert isinstance(opt.generator, torch.Generator)
    assert "Mersenne" in fallback.noise_stream
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * noise.numel())


def test_scheduler_and_state_dict_see_the_users_optimizer():
    engine, model, opt, loader = _setup(sigma=1.0, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** len(loader))
    assert opt.state_dict()["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    engine.detach()  # hooks removed: an ordinary model again
    model(torch.randn(2, 6)).sum().backward()
    assert model[0].weight.grad is not None


def _batchnorm_model(kind):
    torch.manual_seed(0)
    if kind == "frozen":  # no trainable parameter of its own: no hook ever saw it
        bn = nn.BatchNorm1d(8)
        bn.requires_grad_(False)
    elif kind == "affine_false":
        bn = nn.BatchNorm1d(8, affine=False)
    else:  # batch statistics in eval mode too
        bn = nn.BatchNorm1d(8, track_running_stats=False)
    return nn.Sequential(nn.Linear(6, 8), bn, nn.Linear(8, 3))


@pytest.mark.parametrize("kind", ["frozen", "affine_false", "no_running_stats"])
def test_batchnorm_without_trainable_parameters_is_refused(kind):
    """Privacy bug 1 of issue 16: a BatchNorm that owns no trainable parameter mixes the samples of a
    batch (removing one record moves every other record's output, so clipping bounds nothing) and
    was accepted silently, since only modules owning trainable parameters were looked at."""
    model = _batchnorm_model(kind)
    x = torch.randn(8, 6)
    with torch.no_grad():
        assert (model(x)[1:] - model(x[1:])).abs().max() > 1e-3  # sample 0 moved the others' outputs
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(n=32), batch_size=8)
    with pytest.raises(InvalidParameter, match=r"(?s)\n  1 \(BatchNorm1d\): .*; use nn\.GroupNorm") as err:
        PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
    assert [(p.path, p.kind) for p in err.value.problems] == [("1", "BatchNorm1d")]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_accumulated_batches_without_poisson_sampling_refused():
    """Privacy bug 2 of issue 16: with poisson_sampling=False, k batches accumulated before one step
    were charged as one batch (sample rate 1/len(loader) instead of k/len(loader)) and averaged over
    one batch (a gradient k times the mean). A step may use one batch, split or not, as in Poisson
    mode; the charge is the pass's (one Gaussian release, see
    test_fixed_batches_charge_one_gaussian_per_pass), and a refused step charges nothing."""
    sigma, n, batch, k = 1.0, 128, 16, 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = PrivacyEngine()
    _, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch, shuffle=True),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    q = 1 / len(loader)
    it = iter(loader)
    x, y = next(it)
    for xb, yb in split_batch((x, y), 5):  # one batch in micro-batches: one batch's charge
        nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    one = accounting.accountant("pld").compose(accounting.GaussianEvent(sigma / 2))
    assert engine.get_epsilon(1e-5) == pytest.approx(one.epsilon(1e-5), rel=1e-9)
    for _ in range(k):  # gradient accumulation over k batches
        x, y = next(it)
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(
        UnsafeInput, match=r"64 samples were clipped since the last step, more than one batch"
    ):
        opt.step()
    assert engine.steps == 1 and engine.get_epsilon(1e-5) == pytest.approx(one.epsilon(1e-5), rel=1e-9)
    # what the k batches cost (sample rate k q) is far above what one batch's charge would have said
    poisson_one = accounting.accountant("pld").compose(accounting.SubsampledGaussianEvent(sigma, q))
    union = accounting.accountant("pld").compose(accounting.SubsampledGaussianEvent(sigma, k * q))
    assert union.epsilon(1e-5) > 1.5 * poisson_one.epsilon(1e-5)
    opt.zero_grad()
    x, y = next(it)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # after zero_grad the next single batch is a step again
    assert engine.steps == 2
    # the same pass: no second charge
    assert engine.get_epsilon(1e-5) == pytest.approx(one.epsilon(1e-5), rel=1e-9)


def test_poisson_sampling_false_needs_a_batch_size():
    model = nn.Linear(6, 3)
    loader = DataLoader(_data(32), batch_sampler=[[0, 1], [2, 3, 4]])
    with pytest.raises(InvalidParameter, match="fixed batch_size"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )


def test_deepcopy_and_pickle_of_a_private_model_give_an_ordinary_model():
    """copy.deepcopy(model) after make_private crashed (the hooks dragged the clipper and the
    optimizer along). A copy is an ordinary model: its parameters are not the ones clipped and
    stepped; the original stays private."""
    import copy
    import io

    engine, model, opt, loader = _setup()
    batches = (b for b in loader if len(b[0]))
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    released = [(p.grad, p.grad._version) for p in model.parameters()]  # left set, as in Opacus
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded):
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(p, q) and p is not q
        nn.functional.cross_entropy(other(x), y).backward()  # plain gradients, no clipper involved
        assert all(p.grad is not None for p in other.parameters())
    assert all(
        p.grad is g and g._version == v for p, (g, v) in zip(model.parameters(), released, strict=True)
    )
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()  # the original is still clipped per sample
    assert opt.clipper.samples == len(x)
    opt.step()
    assert engine.steps == 2


def test_empty_loader_refused_without_poisson_sampling():
    model = nn.Linear(6, 3)
    loader = DataLoader(_data(4), batch_size=8, drop_last=True)  # no batch at all
    with pytest.raises(InvalidParameter, match="data_loader is empty"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )


def test_sparse_embedding_trains_with_a_dense_noisy_gradient():
    """Embedding(sparse=True) trains where Opacus does (SGD); the noisy gradient is dense (noise on
    every row), so SparseAdam, which takes sparse gradients only, is refused at make_private."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(13, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    data = TensorDataset(torch.randint(0, 13, (64, 3)), torch.randint(0, 3, (64,)))
    with pytest.raises(InvalidParameter, match="SparseAdam"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SparseAdam(list(model[0].parameters())),
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    before = model[0].weight.detach().clone()
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.steps == 4 and not model[0].weight.grad.is_sparse
    assert (model[0].weight != before).all()  # every row noised, used or not


@pytest.mark.parametrize(
    ("poisson", "sigma", "accepted"),
    [
        (True, 1e-4, True),
        (True, 9.9e-5, False),
        (False, 2e-4, True),
        (False, 1.9e-4, False),
        (True, 1.1e12, False),
    ],
)
def test_noise_multiplier_outside_the_certified_domain_is_refused_at_make_private(poisson, sigma, accepted):
    """Poisson steps are charged at sigma, fixed-batch passes at sigma / 2: below 1e-4 (or above
    1e12) there, no accountant certifies a bound, and make_private says so before training starts."""
    model = nn.Linear(6, 3)

    def make():
        return PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(16), batch_size=4),
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            poisson_sampling=poisson,
        )

    if accepted:
        make()
    else:
        with pytest.raises(InvalidParameter, match="noise_multiplier must be 0 or in"):
            make()
