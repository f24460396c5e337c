"""One record's influence on the clipped sum, and the independence probe of make_private (issue 28).

For models make_private accepts, the measured influence of one record on the clipped sum is within
the bound the noise is calibrated to (``C`` under add/remove, ``2 C`` under replace-one). Each misuse
the issue found is refused (by the probe, the validator or the per-step batch check); with those
checks switched off the same models move the clipped sum past the bound, which is why they are
refused.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp.errors import InvalidParameter, UnsafeInput  # noqa: E402
from gaussdp.torch import PerSampleClipper, PrivacyEngine, SampleMixing, UnsupportedModule  # noqa: E402

CLIP = 1e-3  # small: every per-sample gradient is clipped, so the bounds are nearly met


# ------------------------------------------------------------------------------------ models
class Center(nn.Module):
    """A parameter-free module that mixes the batch: ``x - x.mean(0)``."""

    def forward(self, x):
        return x - x.mean(0)


class SeqFirst(nn.Module):
    """Takes ``(B, T, E)`` and runs its layers on ``(T, B, E)``: the sequence in dimension 0 while
    the engine is told ``batch_first=True``. Each layer is per position and per sample, so the
    outputs do not mix; but the rows the clipper sees are positions, each holding every sample."""

    def __init__(self, e=4, h=6, c=3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(e, h), nn.Linear(h, c)

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x.transpose(0, 1))))  # (T, B, c)
        return y.mean(0)


class FunctionalBatchNorm(nn.Module):
    """Batch statistics in train mode without a BatchNorm module (invisible to the validator)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = nn.functional.batch_norm(self.fc1(x), None, None, training=True)
        return self.fc2(torch.tanh(h))


class Recurrent(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = nn.LSTM(4, 5, batch_first=batch_first)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):  # x (B, T, 4)
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.fc(out[:, -1] if self.batch_first else out[-1])


class Tokens(nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.emb = nn.Embedding(13, 4, sparse=sparse)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)).mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(48, 3)
    )


def _data(kind, n, seed=0, t=8):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    if kind == "vec":
        return TensorDataset(torch.randn(n, 5, generator=g), y)
    if kind == "seq":
        return TensorDataset(torch.randn(n, t, 4, generator=g), y)
    if kind == "img":
        return TensorDataset(torch.randn(n, 1, 6, 6, generator=g), y)
    return TensorDataset(torch.randint(0, 13, (n, 7), generator=g), y)


# ----------------------------------------------------------------------------- measurement
def _outlier(data):
    """A record far from the others (float inputs scaled up), as an attacker would choose."""
    x, y = data.tensors[0][-1], data.tensors[1][-1]
    return (x * 30 if x.is_floating_point() else x), y


def clipped_sum(clipper, model, x, y):
    """The clipped per-sample gradient sum of a mean cross-entropy on (x, y), flattened."""
    clipper.reset()
    nn.functional.cross_entropy(model(x), y).backward()
    clipper.check_no_plain_gradients()
    s = torch.cat([clipper.summed.get(p, torch.zeros_like(p)).reshape(-1).double() for p in clipper.params])
    clipper.reset()
    return s


def influence(model, x, y, *, outlier, clip=CLIP):
    """Largest movement of the clipped sum, in units of the clip bound, when one record of the batch
    is removed (add/remove) or replaced (replace-one): removal of each record of the batch with
    ``outlier`` in it, replacement of each record of ``(x, y)`` by ``outlier``."""
    model.eval()  # dropout would draw other masks for a smaller batch
    clipper = PerSampleClipper(model, max_grad_norm=clip)

    def total(xs, ys):
        torch.manual_seed(0)
        return clipped_sum(clipper, model, xs, ys)

    try:
        with_outlier = (torch.cat([outlier[0][None], x[1:]]), torch.cat([outlier[1].reshape(1), y[1:]]))
        removed = replaced = 0.0
        for i in range(len(x)):
            keep = [j for j in range(len(x)) if j != i]
            full = total(*with_outlier)
            removed = max(removed, float((full - total(with_outlier[0][keep], with_outlier[1][keep])).norm()))
            xr, yr = x.clone(), y.clone()
            xr[i], yr[i] = outlier
            replaced = max(replaced, float((total(x, y) - total(xr, yr)).norm()))
    finally:
        clipper.remove()
    return removed / clip, replaced / clip


def _private(model, data, *, batch=8, poisson=True, probe=True, **kw):
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=CLIP,
        poisson_sampling=poisson,
        independence_probe=probe,
        **kw,
    )
    return (engine, *out)


# ------------------------------------------------------------------- accepted: within bounds
ACCEPTED = {
    "mlp": (_mlp, "vec", {}),
    "cnn+groupnorm+dropout": (_cnn, "img", {}),
    "lstm batch_first": (lambda: Recurrent(True), "seq", {}),
    "lstm batch_first=False": (lambda: Recurrent(False), "seq", {}),
    "embedding sparse": (lambda: Tokens(sparse=True), "ids", {}),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_models_move_the_clipped_sum_within_the_bound(name):
    make, kind, kw = ACCEPTED[name]
    torch.manual_seed(0)
    model = make()
    data = _data(kind, 32)
    engine, model, _, _ = _private(model, data, **kw)
    report = engine.probe_report
    assert report.skipped is None and report.samples == 2  # a quarter of the batch
    assert report.output_change < 1e-6 and report.gradient_change < 1e-6, report
    engine.detach()
    x, y = data.tensors[0][:6], data.tensors[1][:6]
    removed, replaced = influence(model, x, y, outlier=_outlier(data))
    assert removed <= 1.0 + 1e-6, removed  # add/remove: C
    assert replaced <= 2.0 + 1e-6, replaced  # replace-one: 2 C
    assert removed > 0.99  # every gradient is clipped to C: the bound is met, not loose


# ---------------------------------------------------------------- misuse: refused, and why
def test_batch_mixing_module_refused_by_the_probe_and_past_the_bound_without_it():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(5, 6), Center(), nn.Tanh(), nn.Linear(6, 3))  # noqa: E731
    data = _data("vec", 32)
    with pytest.raises(SampleMixing, match=r"outputs of other samples moved .*x - x\.mean\(0\)"):
        _private(make(), data)
    model = make()
    assert all(not m._forward_hooks for m in model.modules())  # a refusal leaves no hooks
    x, y = data.tensors[0][:8], data.tensors[1][:8]
    removed, replaced = influence(model, x, y, outlier=_outlier(data))
    assert removed > 1.2 and replaced > 2.1, (removed, replaced)  # bounds: 1 and 2
    _private(make(), data, probe=False)  # accepted only with the probe switched off


@pytest.mark.parametrize("poisson", [False, True])
def test_sequence_in_dimension_zero_refused_by_the_probe(poisson):
    torch.manual_seed(0)
    data = _data("seq", 64, t=8)
    # the probe's batch of 8 == T: 8 rows, but each holds every sample
    with pytest.raises(SampleMixing, match=r"per-sample gradients of other samples moved"):
        _private(SeqFirst(), data, batch=32, poisson=poisson)
    with pytest.raises(SampleMixing, match=r"batch of 4 records and the hooked layers saw 8 rows"):
        _private(SeqFirst(), data, batch=16, poisson=poisson)


def test_sequence_in_dimension_zero_with_fixed_batches_refused_at_the_step_without_the_probe():
    """The fixed-size check was "clipped <= batch size": 8 positions of a batch of 16 passed."""
    torch.manual_seed(0)
    data = _data("seq", 64, t=8)
    _, model, opt, loader = _private(SeqFirst(), data, batch=16, poisson=False, probe=False)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    assert opt.clipper.samples == 8
    with pytest.raises(UnsafeInput, match=r"8 samples were clipped .*batch from the data loader holds 16"):
        opt.step()


def test_sequence_in_dimension_zero_slips_past_the_batch_check_when_batch_equals_length():
    """Batch size == sequence length (fixed batches, or a Poisson batch of that size): the rows
    number the samples, so only the probe tells; the clipped sum then moves past the bound."""
    torch.manual_seed(0)
    data = _data("seq", 64, t=8)
    _, model, opt, loader = _private(SeqFirst(), data, batch=8, poisson=False, probe=False)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # passes the per-step check: 8 rows for 8 samples
    model = SeqFirst()
    torch.manual_seed(0)
    removed, replaced = influence(model, x, y, outlier=_outlier(data))
    assert removed > 1.2 and replaced > 2.1, (removed, replaced)  # bounds: 1 and 2


def test_batchnorm_in_train_mode_refused_module_or_functional():
    torch.manual_seed(0)
    data = _data("vec", 32)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    with pytest.raises(UnsupportedModule, match=r"1 \(BatchNorm1d\)"):
        _private(model, data)
    with pytest.raises(SampleMixing, match="outputs of other samples moved"):
        _private(FunctionalBatchNorm(), data)
    x, y = data.tensors[0][:8], data.tensors[1][:8]
    removed, replaced = influence(FunctionalBatchNorm(), x, y, outlier=_outlier(data))
    assert removed > 1.2 and replaced > 2.1, (removed, replaced)


# ------------------------------------------------------------------------------ the probe
class Counting(nn.Module):
    """An MLP with dropout, a buffer its forward updates, and a count of the rows it ran."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(5, 6), nn.Linear(6, 3), nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros(()))
        self.rows = 0

    def forward(self, x):
        self.calls += 1
        self.rows += len(x)
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_probe_costs_half_a_batch_and_leaves_no_trace():
    """Two runs of a quarter of a batch each (half a forward and backward of a batch); random state
    (also what a dataset's random transform drew), buffers, train/eval flags and gradients as they
    were; dropout (train mode) does not fool it."""
    torch.manual_seed(0)
    model = Counting()
    model.fc2.eval()  # a mixed mode, kept
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)  # a gradient left by the user
    grad = model.fc1.weight.grad

    class Jittered(torch.utils.data.Dataset):  # a random transform: draws from torch's generator
        def __init__(self, base):
            self.base = base

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return x + 0.01 * torch.rand(x.shape), y

    state = torch.get_rng_state()
    engine, *_ = _private(model, Jittered(_data("vec", 100)), batch=20, poisson=False)
    assert model.rows == 2 * 5 and engine.probe_report.samples == 5
    assert engine.probe_report.seconds > 0 and engine.probe_report.gradient_change < 1e-6
    assert torch.equal(torch.get_rng_state(), state)
    assert float(model.calls) == 0.0
    assert model.training and model.fc1.training and not model.fc2.training
    assert model.fc1.weight.grad is grad and model.fc2.weight.grad is None


def test_probe_ways_of_running_a_batch():
    """A tuple (*inputs, target): module(*batch[:-1]), else module(batch[0]); a dict without its
    target keys; a function for anything else; a module that cannot run refused by name."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x, scale):
            return self.fc(x) * scale[:, None]

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, input_ids, mask=None):
            return self.fc(input_ids) * mask[:, None]

    class DictData(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randn(5, generator=g), "mask": torch.tensor(1.0), "labels": i % 3}

    torch.manual_seed(0)
    x, y = _data("vec", 16).tensors
    _private(TwoInputs(), TensorDataset(x, torch.rand(16) + 0.5, y))  # module(x, scale)
    _private(_mlp(), TensorDataset(x, torch.rand(16), y))  # module(x, extra) fails: module(x)
    _private(Keywords(), DictData())
    with pytest.raises(InvalidParameter, match=r"independence_probe: .*module\(batch\[0\]\): RuntimeError"):
        _private(nn.Linear(3, 3), TensorDataset(x, y))
    calls = []
    _private(nn.Linear(3, 3), TensorDataset(x, y), probe=lambda m, b: calls.append(1) or m(b[0][:, :3]))
    assert calls == [1, 1]
    with pytest.raises(TypeError, match="independence_probe must be"):
        _private(nn.Linear(5, 3), TensorDataset(x, y), probe="yes")


def test_probe_skipped_without_a_record_to_change():
    x = torch.ones(16, 5)  # every record the same: nothing to change
    engine, *_ = _private(_mlp(), TensorDataset(x, torch.arange(16) % 3))
    assert engine.probe_report.samples == 0 and "differs from record 0" in engine.probe_report.skipped


def test_probe_batch_keeps_padding_shapes():
    """A collate padding to the longest record: the replacement has record 0's length, so the
    batch's padded shape, and a model that averages over it, are unchanged (no false refusal)."""
    from torch.nn.utils.rnn import pad_sequence

    lengths = [3, 5, 4, 6, 3, 7, 5, 3, 4, 6, 5, 3]
    records = [
        (torch.randint(1, 13, (n,), generator=torch.Generator().manual_seed(i)), i % 3)
        for i, n in enumerate(lengths)
    ]

    def collate(rows):
        return pad_sequence([r[0] for r in rows], batch_first=True), torch.tensor([r[1] for r in rows])

    model = Tokens()
    engine = PrivacyEngine()
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(records, batch_size=8, collate_fn=collate),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert engine.probe_report.samples == 2 and engine.probe_report.skipped is None
    assert math.isfinite(engine.probe_report.output_change)
