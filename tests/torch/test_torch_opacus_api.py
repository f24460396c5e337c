"""Opacus's API on gaussdp's engine (issue 16, "not a drop-in"): each test fails on the engine
before this change (TypeError, missing attribute, or a wrong number)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler, TensorDataset  # noqa: E402

from gaussdp import accounting, calibration  # noqa: E402
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyError, UnsafeInput  # noqa: E402
from gaussdp.torch import DPLoss, PrivacyEngine  # noqa: E402
from gaussdp.torch.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402


def _data(n=64, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _private(engine=None, *, sigma=1.0, clip=1.0, n=64, batch=16, model=None, **kw):
    engine = engine or PrivacyEngine()
    model = model or _model()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        **kw,
    )
    return (engine, *out)


def _train(model, opt, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def _pld(event, count):
    return accounting.accountant("pld").compose(event, count=count).epsilon(1e-5)


# ------------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("secure_mode", [True, False])
def test_secure_mode_accepted_and_accountant_get_epsilon(secure_mode):
    engine, model, opt, loader = _private(PrivacyEngine(secure_mode=secure_mode), sigma=1.1)
    assert engine.accountant.get_epsilon(delta=1e-5) == 0.0
    _train(model, opt, loader, 3)
    ref = _pld(accounting.SubsampledGaussianEvent(1.1, loader.sample_rate), 3)
    assert engine.accountant.get_epsilon(delta=1e-5) == pytest.approx(ref, rel=1e-9)
    assert engine.get_epsilon(1e-5) == engine.accountant.get_epsilon(1e-5)
    assert len(engine.accountant) == 3 and engine.steps == 3
    assert "OS" in engine.noise_stream or "keystream" in engine.noise_stream.lower()


def test_secure_mode_refuses_a_seed_and_a_noise_generator():
    with pytest.raises(InvalidParameter, match="secure_mode=True cannot take a seed"):
        PrivacyEngine(secure_mode=True, seed=1)
    with pytest.raises(InvalidParameter, match="noise_generator"):
        _private(PrivacyEngine(secure_mode=True), noise_generator=torch.Generator())
    with pytest.raises(TypeError, match="secure_mode must be a bool"):
        PrivacyEngine(secure_mode="yes")


def test_prv_is_accepted_and_computed_with_pld():
    engine, model, opt, loader = _private(PrivacyEngine(accountant="prv"), sigma=0.9)
    assert "computed with 'pld'" in repr(engine.accountant)
    assert engine.accountant.mechanism() == "pld"
    _train(model, opt, loader, 4)
    ref = _pld(accounting.SubsampledGaussianEvent(0.9, loader.sample_rate), 4)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref, rel=1e-9)
    with pytest.raises(InvalidParameter, match="gdp"):
        PrivacyEngine(accountant="gdp")


# ------------------------------------------------------------------------ BatchMemoryManager
def test_batch_memory_manager_charges_and_noises_once_per_poisson_batch():
    """Physical batches of 3: each Poisson batch is one release (one charge, the noise once), and
    the update is the one of the whole batch at once."""
    results = []
    for physical in (None, 3):
        with pytest.warns(NotPrivateWarning):
            engine, model, opt, loader = _private(PrivacyEngine(seed=5), sigma=1e-4, clip=0.5)
        start = [p.detach().clone() for p in model.parameters()]
        if physical is None:
            batches = loader
        else:
            manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt)
            batches = manager.__enter__()
        sizes = []
        for x, y in batches:
            sizes.append(len(x))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert engine.steps == len(loader)  # one charge per Poisson batch
        event = accounting.SubsampledGaussianEvent(1e-4, loader.sample_rate)
        assert engine.accountant.history == ((event, len(loader)),)
        if physical is not None:
            assert max(sizes) <= physical and len(sizes) > len(loader)
        results.append([s - p.detach() for s, p in zip(start, model.parameters(), strict=True)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_signal_skip_step_keeps_sums_and_releases_nothing():
    engine, model, opt, loader = _private(sigma=1.0)
    x, y = next(b for b in loader if len(b[0]) >= 2)
    opt.signal_skip_step(do_skip=True)
    nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()  # after a skipped step: the sums stay
    assert engine.steps == 0 and engine.get_epsilon(1e-5) == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert opt.clipper.samples == 1
    nn.functional.cross_entropy(model(x[1:]), y[1:]).backward()
    opt.step()
    assert engine.steps == 1 and opt.clipper.samples == 0


def test_batch_memory_manager_arguments():
    _, model, opt, loader = _private()
    with pytest.raises(InvalidParameter, match="max_physical_batch_size must be > 0"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=0, optimizer=opt)
    with pytest.raises(TypeError, match="DPOptimizer"):
        BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=4, optimizer=torch.optim.SGD(model.parameters())
        )


# ---------------------------------------------------------------------- criterion, modes
def test_ghost_mode_returns_the_criterion_as_opacus_does():
    engine, model, opt, criterion, loader = _private(
        grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss()
    )
    assert isinstance(criterion, DPLoss)
    x, y = next(b for b in loader if len(b[0]))
    loss = criterion(model(x), y)
    loss.backward()
    opt.step()
    assert engine.steps == 1
    with pytest.raises(InvalidParameter, match="reduction='sum' but loss_reduction='mean'"):
        _private(grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"))
    # any other mode: (module, optimizer, data_loader), as Opacus (here after the engine)
    assert len(_private(grad_sample_mode="hooks", criterion=nn.CrossEntropyLoss())) == 4


@pytest.mark.parametrize("mode", ["no_op", "ghost_tp", "bogus"])
def test_unsupported_grad_sample_modes_refused(mode):
    with pytest.raises(InvalidParameter, match=f"grad_sample_mode='{mode}' is not supported"):
        _private(grad_sample_mode=mode)


def test_ghost_fsdp_mode_on_an_unsharded_module_is_ghost():
    """Opacus's FSDP examples with FSDP removed pass grad_sample_mode="ghost_fsdp" (examples/
    fsdp_llama3.py): the criterion comes back, and the step is the "ghost" step, noise and all."""
    updates = []
    for mode in ("ghost", "ghost_fsdp"):
        with pytest.warns(NotPrivateWarning):  # the seed (to compare the noise)
            engine, model, opt, criterion, loader = _private(
                PrivacyEngine(seed=5), grad_sample_mode=mode, criterion=nn.CrossEntropyLoss()
            )
        assert isinstance(criterion, DPLoss)
        start = [p.detach().clone() for p in model.parameters()]
        x, y = next(b for b in loader if len(b[0]))  # the same Poisson batch: same seed
        criterion(model(x), y).backward()
        opt.step()
        assert engine.steps == 1
        updates.append([s - p.detach() for s, p in zip(start, model.parameters(), strict=True)])
    for a, b in zip(*updates, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("mode", ["ghost_fsdp", "hooks"])
def test_module_sharded_by_fsdp_refused(mode):
    """Each rank of an FSDP-sharded module holds a shard of each parameter: a per-sample norm over a
    shard is below the sample's norm, so clipping it bounds nothing. Refused in every mode."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = _model()
        fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(InvalidParameter, match=r"'0\.weight' is a DTensor \(sharded by FSDP\)"):
            _private(model=model, grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
    finally:
        dist.destroy_process_group()


def test_unknown_make_private_arguments_refused():
    with pytest.raises(TypeError, match="unsupported arguments"):
        _private(rand_on_empty=True)


# ----------------------------------------------------------------------------- noise_generator
def test_noise_generator_is_used_and_marks_the_run_not_private():
    updates = []
    for _ in range(2):
        with pytest.warns(NotPrivateWarning, match="noise_generator"):
            engine, model, opt, _ = _private(sigma=1.0, noise_generator=torch.Generator().manual_seed(3))
        assert "NOT private" in engine.noise_stream
        start = [p.detach().clone() for p in model.parameters()]
        opt.step()  # no samples: the update is the noise alone
        updates.append([s - p.detach() for s, p in zip(start, model.parameters(), strict=True)])
    for a, b in zip(*updates, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0
    with pytest.raises(TypeError, match=r"noise_generator must be a torch\.Generator"):
        _private(noise_generator=3)


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_restores_the_spend(tmp_path):
    path = tmp_path / "ckpt.pt"
    engine, model, opt, loader = _private(sigma=1.2)
    _train(model, opt, loader, 3)
    engine.save_checkpoint(path=path, module=model, optimizer=opt, checkpoint_dict={"epoch": 7})
    fresh = PrivacyEngine()
    other = _model(seed=1)
    _, model2, opt2, loader2 = _private(fresh, sigma=1.2, model=other)
    rest = fresh.load_checkpoint(path=path, module=model2, optimizer=opt2)
    assert rest == {"epoch": 7}
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert fresh.steps == 3
    assert fresh.get_epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-12)
    _train(model2, opt2, loader2, 2)
    ref = _pld(accounting.SubsampledGaussianEvent(1.2, loader.sample_rate), 5)
    assert fresh.get_epsilon(1e-5) == pytest.approx(ref, rel=1e-9)
    with pytest.raises(ValueError, match="charged already"):
        fresh.load_checkpoint(path=path, module=model2)


# ----------------------------------------------------------------------------- grad_sample
def _per_sample_grads(model, x, y):
    out = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    return [torch.stack(g) for g in zip(*out, strict=True)]


def test_grad_sample_set_only_when_asked():
    x, y = _data(8).tensors
    ref = _per_sample_grads(_model(), x, y)
    _, model, opt, _ = _private(keep_grad_sample=True)
    nn.functional.cross_entropy(model(x), y).backward()
    for p, g in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad_sample, g, rtol=1e-5, atol=1e-6)
    opt.zero_grad()
    assert all(p.grad_sample is None for p in model.parameters())
    _, model, opt, _ = _private()
    nn.functional.cross_entropy(model(x), y).backward()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


# ----------------------------------------------------------------------------- p.grad
def test_grad_left_set_after_step_and_plain_gradient_still_refused():
    _, model, opt, loader = _private(sigma=1.0)
    x, y = next(b for b in loader if len(b[0]))
    nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for b, p in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(b - p.detach(), 0.1 * p.grad)  # SGD(lr=0.1) took the noisy grad
    nn.functional.cross_entropy(model(x), y).backward()  # without zero_grad: clipped, not refused
    opt.zero_grad()
    model[0].weight.sum().backward()  # a plain gradient, outside the module's forward
    with pytest.raises(PrivacyError, match=r"0\.weight"):
        opt.step()
    _, model, opt, loader = _private(sigma=1.0)
    opt.step()
    (model[0].weight * 2).sum().backward()  # added to the gradient the step left
    with pytest.raises(PrivacyError, match=r"0\.weight"):
        opt.step()


# ----------------------------------------------------------------------------- batch_first
class _SeqModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(11, 5)
        self.lin = nn.Linear(5, 3)

    def forward(self, ids):  # ids (T, B) with batch_first=False, (B, T) otherwise
        return self.lin(torch.tanh(self.emb(ids)))


def test_batch_first_false_gives_the_sums_of_the_transposed_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (6, 4), generator=g)  # (B=6, T=4)
    target = torch.randn(6, 4, 3, generator=g)
    sums = []
    for batch_first in (True, False):
        model = _SeqModel()

        def run(module, batch, batch_first=batch_first):  # the loop below's way with a batch
            return module(batch[0] if batch_first else batch[0].T)

        with pytest.warns(NotPrivateWarning):
            engine = PrivacyEngine(seed=1)
            model, opt, loader = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(ids, target), batch_size=6),
                noise_multiplier=0.0,
                max_grad_norm=0.3,
                batch_first=batch_first,
                independence_probe=run,
            )
        assert engine.probe_report.samples == 2 and engine.probe_report.skipped is None
        x, y = next(iter(loader))
        out = run(model, (x, y))
        if not batch_first:
            out = out.transpose(0, 1)
        ((out - y) ** 2).sum(dim=(1, 2)).mean().backward()
        assert opt.clipper.samples == len(x)
        sums.append(opt.summed_grads)
    for (p, a), b in zip(sums[0].items(), sums[1].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str(p.shape))
        assert a.abs().sum() > 0


def test_batch_first_false_refuses_other_layers_by_name():
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))  # 2-D inputs: no batch in dimension 1
    with pytest.raises(UnsafeInput, match=r"batch_first=False: Linear \(input shape \(4, [46]\)\)"):
        _private(model=model, batch_first=False)  # the probe's batch of 4 reaches the refusal
    _, model, _, _ = _private(model=model, batch_first=False, independence_probe=False)
    with pytest.raises(UnsafeInput, match=r"batch_first=False: Linear \(input shape \(5, [46]\)\)"):
        model(torch.randn(5, 6)).sum().backward()


# ----------------------------------------------------------------------------- adaptive
def _adaptive(**kw):
    args = dict(
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.5,
        max_clipbound=100.0,
        min_clipbound=0.01,
        unclipped_num_std=4.0,
    )
    args.update(kw)
    return args


def test_adaptive_clipping_charges_both_releases_at_the_given_multiplier():
    """The count's noise is paid by the gradient's (Andrew et al. 2021, Theorem 1): the step is
    charged at z, the gradient noised at z_g = (z^-2 - (2 s)^-2)^-1/2; the bound falls toward the
    median norm when every sample starts unclipped."""
    z, s = 1.0, 4.0
    engine, model, opt, loader = _private(
        sigma=z, clip=50.0, n=256, batch=64, clipping="adaptive", **_adaptive()
    )
    z_g = (z**-2 - (2 * s) ** -2) ** -0.5
    assert opt._std() == pytest.approx(z_g * 50.0 / opt.expected_batch_size, rel=1e-12)
    _train(model, opt, loader, 8)
    ref = _pld(accounting.SubsampledGaussianEvent(z, loader.sample_rate), 8)
    assert engine.get_epsilon(1e-5) == pytest.approx(ref, rel=1e-9)
    assert opt.max_grad_norm < 50.0 * math.exp(-0.5 * 0.2 * 8)  # moved down at every step
    opt.noise_multiplier = 8.0  # as large as the count's budget: refused before any charge
    with pytest.raises(InvalidParameter, match="noise_multiplier < 2"):
        opt.step()
    assert engine.steps == 8
    with pytest.raises(InvalidParameter, match="noise_multiplier < 2 \\* unclipped_num_std"):
        _private(sigma=2.0, clipping="adaptive", **_adaptive(unclipped_num_std=1.0))
    with pytest.raises(TypeError, match="needs the arguments"):
        _private(clipping="adaptive", target_unclipped_quantile=0.5)
    with pytest.raises(TypeError, match="unsupported arguments"):
        _private(clipping="flat", **_adaptive())


# ----------------------------------------------------------------------------- DDP
def test_ddp_and_dpddp_wrapped_models_are_accepted(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

        for wrap in (nn.parallel.DistributedDataParallel, DPDDP):
            wrapped = wrap(_model())
            engine, model, opt, loader = _private(model=wrapped, sigma=1.0)
            assert model is wrapped
            _train(model, opt, loader, 3)  # DDP's own reducer would fail the second forward
            assert engine.steps == 3
            assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- poisson_sampling=False
def _fixed(sigma, n=64, batch=16, shuffle=True, **kw):
    engine = PrivacyEngine(**kw)
    model = _model()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch, shuffle=shuffle),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    return (engine, *out)


def test_fixed_batches_charge_one_gaussian_per_pass():
    """Each pass over a shuffled fixed-size loader is one Gaussian release of sensitivity 2C
    (replace-one): 3 passes are sqrt(3) * 2 / sigma-GDP, the closed form of gaussdp.calibration."""
    sigma = 1.5
    engine, model, opt, loader = _fixed(sigma)
    for epoch in range(1, 4):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            closed = calibration.epsilon_for_mu(mu=math.sqrt(epoch) * 2 / sigma, delta=1e-5)
            assert engine.get_epsilon(1e-5) == pytest.approx(closed, rel=1e-3)
            assert engine.get_epsilon(1e-5) >= closed * (1 - 1e-9)  # an upper bound
    exact = _pld(accounting.GaussianEvent(sigma / 2), 3)
    assert engine.get_epsilon(1e-5) == pytest.approx(exact, rel=1e-9)
    # far above what Poisson amplification would have claimed for the same steps
    assert engine.get_epsilon(1e-5) > 2 * _pld(accounting.SubsampledGaussianEvent(sigma, 0.25), 12)


def test_fixed_batches_new_pass_and_lower_sigma_are_charged():
    sigma = 2.0
    engine, model, opt, loader = _fixed(sigma)
    for _ in range(2):  # two partial passes: each may hold a record again
        x, y = next(iter(loader))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.get_epsilon(1e-5) == pytest.approx(_pld(accounting.GaussianEvent(sigma / 2), 2), rel=1e-9)
    it = iter(loader)
    for s in (2.0, 1.0):  # a smaller sigma later in the pass: mu^2 topped up to 4 / 1.0^2
        opt.noise_multiplier = s
        x, y = next(it)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mu = math.sqrt(2 * (2 / sigma) ** 2 + (2 / 1.0) ** 2)
    assert engine.get_epsilon(1e-5) == pytest.approx(calibration.epsilon_for_mu(mu=mu, delta=1e-5), rel=1e-3)


def test_fixed_batches_refuse_a_sampler_with_replacement():
    model = _model()
    data = _data(32)
    loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data, replacement=True))
    with pytest.raises(InvalidParameter, match="at most once per pass"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )


def test_fixed_batches_make_private_with_epsilon_meets_the_target():
    engine = PrivacyEngine()
    model = _model()
    _, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(64), batch_size=16, shuffle=True),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
    _train(model, opt, loader, 8)
    assert 2.9 < engine.get_epsilon(1e-5) <= 3.0


def test_fixed_batches_with_batch_memory_manager():
    """imdb.py's loader (poisson_sampling=False) split by BatchMemoryManager: one step per batch of
    the loader, the pass charged once; two batches in one step are still refused."""
    sigma = 1.0
    engine, model, opt, loader = _fixed(sigma)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as batches:
        assert len(batches) == 4 * 4
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert engine.steps == 4
    assert engine.get_epsilon(1e-5) == pytest.approx(_pld(accounting.GaussianEvent(sigma / 2), 1), rel=1e-9)
    it = iter(loader)
    for _ in range(2):
        opt.signal_skip_step(do_skip=True)
        x, y = next(it)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    x, y = next(it)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsafeInput, match="more than one batch"):
        opt.step()


def test_adaptive_clipping_count_noise_has_the_stated_std():
    """The noisy count is released through the bound's update: with no samples the count is its
    noise alone, N(0, unclipped_num_std^2), read back from C'/C. 400 draws: the sample std within
    5 standard errors (false alarm about 6e-7)."""
    s, lr = 3.0, 0.01
    model = nn.Linear(2, 1)
    engine, _, opt, _ = _private(
        model=model,
        sigma=1.0,
        clip=1.0,
        independence_probe=False,  # no data reaches the model here
        clipping="adaptive",
        **_adaptive(unclipped_num_std=s, clipbound_learning_rate=lr, max_clipbound=1e9, min_clipbound=1e-9),
    )
    draws = []
    for _ in range(400):
        c = opt.max_grad_norm
        opt.step()  # no samples
        fraction = 0.5 - math.log(opt.max_grad_norm / c) / lr
        draws.append((fraction - 0.5) * opt.expected_batch_size)
    mean = sum(draws) / len(draws)
    std = math.sqrt(sum((d - mean) ** 2 for d in draws) / (len(draws) - 1))
    assert abs(std / s - 1) < 5 / math.sqrt(2 * len(draws)), std
    assert abs(mean) < 5 * s / math.sqrt(len(draws))
    assert engine.steps == 400
