"""The loaders make_private returns: every batch they (or their batch sampler) hand out is recorded
with its pass, each step is checked against the batch it used, and each pass of fixed-size
batches is charged (issue 28: Opacus's BatchMemoryManager, participation said, not guessed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
opacus_bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from gaussdp import accounting  # noqa: E402
from gaussdp.errors import InvalidParameter, UnsafeInput  # noqa: E402
from gaussdp.torch import PrivacyEngine  # noqa: E402
from gaussdp.torch.data import DrawnBatches  # noqa: E402

OpacusBMM = opacus_bmm.BatchMemoryManager


def _data(n=64, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g))


def _private(*, poisson=True, n=64, batch=16, shuffle=False, workers=0, sigma=1.0, model=None, **kw):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(n), batch_size=batch, shuffle=shuffle, num_workers=workers),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        poisson_sampling=poisson,
        **kw,
    )
    return (engine, *out)


def _pld(event, count):
    return accounting.accountant("pld").compose(event, count=count).epsilon(1e-5)


def _step_on(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_drawn_batches_take_in_order_and_forget_an_abandoned_pass():
    drawn = DrawnBatches()
    p1 = drawn.begin_pass()
    drawn.add(p1, 3)
    drawn.add(p1, 0)
    drawn.add(p1, 5)
    assert (drawn.samples_served, drawn.batches_served, len(drawn)) == (8, 2, 3)
    assert drawn.take() == (1, 3) and drawn.current == (1, 3)
    assert not drawn.take_prefix(4) and len(drawn) == 2  # 0 + 5 never sums to 4
    assert drawn.take_prefix(5) and len(drawn) == 0  # the empty batch and the one of 5
    drawn.add(p1, 2)
    assert drawn.begin_pass() == 2 and len(drawn) == 0  # prefetched and never used: forgotten
    assert drawn.take() is None and drawn.current is None


def test_opacus_batch_memory_manager_with_poisson_batches():
    """Opacus's own BatchMemoryManager builds a DataLoader around the loader's batch_sampler: the
    Poisson sampler records what it draws there too (it was refused: "served 0 samples")."""
    engine, model, opt, loader = _private(n=256, batch=64)
    sizes = []
    with OpacusBMM(data_loader=loader, max_physical_batch_size=10, optimizer=opt) as physical:
        for x, y in physical:
            sizes.append(len(x))
            _step_on(model, opt, x, y)
    assert max(sizes) <= 10 and len(sizes) > 4
    assert engine.steps == 4 and sum(sizes) == loader.samples_served
    assert engine.get_epsilon(1e-5) == pytest.approx(
        _pld(accounting.SubsampledGaussianEvent(1.0, 0.25), 4), rel=1e-9
    )


def test_opacus_batch_memory_manager_checks_rows_against_the_batch():
    """Through Opacus's loader too, a step whose rows are not the batch's samples is refused."""

    class Doubled(nn.Module):  # two rows per sample
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(torch.cat([x, x])).view(2, -1, 3).sum(0)

    engine, model, opt, loader = _private(model=Doubled(), independence_probe=False)
    with OpacusBMM(data_loader=loader, max_physical_batch_size=100, optimizer=opt) as physical:
        x, y = next(x for x in physical if len(x[0]))
        nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(UnsafeInput, match=rf"{2 * len(x)} samples were clipped .* holds {len(x)}"):
            opt.step()
    assert engine.steps == 0


def test_opacus_batch_memory_manager_with_fixed_batches_charges_every_pass():
    """poisson_sampling=False through Opacus's BatchMemoryManager: its loader iterates the batch
    sampler only, which now records the passes. Two passes cut short (a record can be in a batch
    of each) are two charges; before, passes were counted by steps, and these 2 x 2 steps of 4
    per pass were charged as one pass."""
    sigma = 2.0
    engine, model, opt, loader = _private(poisson=False, shuffle=True, sigma=sigma)
    for _ in range(2):
        with OpacusBMM(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as physical:
            assert len(physical) == 13  # Opacus's ceil(4 * 16 / 5), from the sampler's batch_size
            for i, (x, y) in enumerate(physical):
                assert len(x) == 4  # Opacus splits a batch of 16 evenly: 4, 4, 4, 4
                _step_on(model, opt, x, y)
                if i == 7:  # two batches of the pass
                    break
    assert engine.steps == 4 and loader.passes == 2
    assert engine.get_epsilon(1e-5) == pytest.approx(_pld(accounting.GaussianEvent(sigma / 2), 2), rel=1e-9)


@pytest.mark.parametrize("poisson", [True, False])
def test_prefetching_workers_keep_each_step_on_its_batch(poisson):
    """Workers draw batches ahead of the steps (and a loop broken early leaves some drawn): each
    step is still checked against its own batch, in order."""
    engine, model, opt, loader = _private(poisson=poisson, n=96, batch=16, workers=2)
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            _step_on(model, opt, x, y)
            if epoch == 0 and i == 1:
                break
    assert engine.steps == 2 + 6


def test_a_step_without_a_batch_of_the_loader_is_refused():
    engine, model, opt, _ = _private(poisson=False)
    opt.step()  # no samples: noise only, allowed
    nn.functional.cross_entropy(model(torch.randn(16, 6)), torch.zeros(16, dtype=torch.long)).backward()
    with pytest.raises(UnsafeInput, match="handed out no batch for it"):
        opt.step()
    assert engine.steps == 1


@pytest.mark.parametrize(
    ("sampler", "message"),
    [
        (lambda d: SubsetRandomSampler([0, 1, 2, 2, 3]), "repeats some of its indices"),
        (
            lambda d: DistributedSampler(d, num_replicas=3, rank=0, shuffle=False),
            r"pads 2 records .*drop_last=True",
        ),
    ],
)
def test_fixed_batches_refuse_samplers_that_repeat_a_record_in_a_pass(sampler, message):
    data = _data(64)
    model = nn.Linear(6, 3)
    with pytest.raises(InvalidParameter, match=message):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8, sampler=sampler(data)),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    ok = DistributedSampler(data, num_replicas=3, rank=0, shuffle=False, drop_last=True)
    PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8, sampler=ok),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
    )
