"""Two processes (gloo, CPU): each rank clips its own samples, the noise is added once."""

from __future__ import annotations

import math
import os
import socket
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp.torch import PerSampleClipper, PrivacyEngine  # noqa: E402

N, D = 64, 5


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, 2, (N,), generator=g))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 2))


def _wrap(model, wrap):
    """The model as given to make_private: as is, in torch's DDP, or in Opacus's DPDDP."""
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if wrap == "dpddp":
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel

        return DifferentiallyPrivateDistributedDataParallel(model)
    return model


def _worker(rank, world, port, out, wrap=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ds = _data()
    # 1) no noise: the all-reduced update must be the clipped sum over both ranks' samples
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    engine = PrivacyEngine(seed=10)
    wrapped, opt, dl = engine.make_private(
        module=_wrap(model, wrap),
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=16),
        noise_multiplier=0.0,
        max_grad_norm=0.2,
    )
    x, y = next(iter(dl))
    idx = [int(i) for i in dl.batch_sampler_.shard if any(torch.equal(ds[int(i)][0], r) for r in x)]
    nn.functional.cross_entropy(wrapped(x), y).backward()
    opt.step()
    update = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters(), strict=True)])
    for x2, y2 in dl:  # more steps through the wrapper (DDP's own reducer would fail the next forward)
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x2), y2).backward()
        opt.step()
    assert engine.steps == 1 + len(dl)
    gathered = [None] * world
    dist.all_gather_object(gathered, idx)
    # 2) noise only (no samples): std must be sigma*C/(qN), i.e. added once, not on every rank
    model2 = nn.Linear(60, 50)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model2.parameters()])
    e2 = PrivacyEngine(seed=20)
    _, opt2, dl2 = e2.make_private(
        module=model2,
        optimizer=torch.optim.SGD(model2.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=16),
        noise_multiplier=3.0,
        max_grad_norm=0.5,
    )
    opt2.step()
    noise = before - torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    if rank == 0:
        out.put(
            (
                update.tolist(),
                gathered,
                noise.tolist(),
                dl.expected_batch_size,
                dl2.expected_batch_size,
                e2.get_epsilon(1e-5),
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrap", [None, "ddp", "dpddp"])
def test_two_process_gloo(wrap):
    """Also with the model in torch's DistributedDataParallel or Opacus's DPDDP, as Opacus's
    cifar10.py wraps it: the same update, the noise once."""
    if wrap == "dpddp":
        pytest.importorskip("opacus")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, out, wrap)) for r in range(2)]
    for p in procs:
        p.start()
    update, gathered, noise, expected, expected2, eps = out.get(timeout=100)
    update, noise = torch.tensor(update), torch.tensor(noise)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert expected == pytest.approx(16.0)  # q N over both ranks
    # reference: one process clipping the union of both ranks' samples
    ds = _data()
    union = sorted(gathered[0] + gathered[1])
    assert set(gathered[0]).isdisjoint(gathered[1]) and union
    model = _model()
    clipper = PerSampleClipper(model, max_grad_norm=0.2)
    x, y = ds[union]
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    ref = torch.cat([clipper.summed[p].reshape(-1) for p in model.parameters()]) / expected
    torch.testing.assert_close(update, ref, rtol=1e-5, atol=1e-6)
    # noise added once: 3050 coordinates, sample std within 5 standard errors (false alarm ~6e-7);
    # noise added on both ranks would give sqrt(2) times the std
    std = 3.0 * 0.5 / expected2
    assert abs(float(noise.std()) / std - 1) < 5 / math.sqrt(2 * noise.numel())
    assert eps > 0
