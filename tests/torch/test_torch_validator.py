"""Modules that mix the samples of a batch (or keep unnoised aggregates of them) are refused, trainable
or not; ModuleValidator.fix replaces them by per-sample modules that the engine accepts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from test_torch_per_sample import check  # noqa: E402  (tests/torch is on sys.path under pytest)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp.errors import InvalidParameter  # noqa: E402
from gaussdp.torch import ModuleValidator, PerSampleClipper, PrivacyEngine, UnsupportedModule  # noqa: E402


def test_instance_norm_running_statistics_refused():
    """Its forward is per sample in train mode, but running_mean/var average every training sample
    without noise and are saved with the model."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Unflatten(1, (2, 4)), nn.InstanceNorm1d(2, track_running_stats=True), nn.Flatten()
    )
    x = torch.randn(8, 6)
    model(x)
    assert not torch.equal(model[2].running_mean, torch.zeros(2))  # the data left a trace
    with pytest.raises(UnsupportedModule, match=r"2 \(InstanceNorm1d\): track_running_stats=True"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(32, 6)), batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm2d(4),
        lambda: nn.BatchNorm3d(4, affine=False),
        lambda: nn.SyncBatchNorm(4),
        lambda: nn.LazyBatchNorm1d(),
        lambda: nn.InstanceNorm2d(4, track_running_stats=True),
        lambda: nn.LSTM(4, 4, num_layers=2, dropout=0.1),
        lambda: nn.GRU(4, 4, num_layers=2, dropout=0.1),
        lambda: nn.RNN(4, 4, num_layers=2, dropout=0.1),
    ],
)
def test_validate_lists_every_refused_module_by_path(make):
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Identity(), make()))
    problems = ModuleValidator.validate(model)
    assert [p.path for p in problems] == ["1.1"]
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedModule, match=r"1\.1 \("):
        ModuleValidator.validate(model, strict=True)
    assert (
        ModuleValidator.validate(nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4), nn.InstanceNorm1d(4)))
        == []
    )


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.bn.requires_grad_(False)  # a frozen, pretrained BatchNorm
        self.inorm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.fc = nn.Linear(6 * 4 * 4, 8)
        self.bn1 = nn.BatchNorm1d(8, affine=False)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = torch.tanh(self.inorm(self.bn(self.conv(x))))
        return self.out(self.bn1(self.fc(x.flatten(1))))


def test_fix_replaces_with_per_sample_modules_of_the_same_shape():
    torch.manual_seed(0)
    model = ConvNet()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.validate(fixed) == []
    # the original is left as it was
    assert isinstance(model.bn, nn.BatchNorm2d) and model.inorm.track_running_stats
    assert isinstance(fixed.bn, nn.GroupNorm) and (fixed.bn.num_groups, fixed.bn.num_channels) == (6, 6)
    torch.testing.assert_close(fixed.bn.weight, model.bn.weight)  # affine parameters kept, frozen kept
    assert not fixed.bn.weight.requires_grad and not fixed.bn.bias.requires_grad
    assert isinstance(fixed.bn1, nn.GroupNorm) and fixed.bn1.num_groups == 1 and not fixed.bn1.affine
    assert isinstance(fixed.inorm, nn.InstanceNorm2d) and not fixed.inorm.track_running_stats
    assert fixed.inorm.affine and fixed.inorm.weight.requires_grad
    x = torch.randn(5, 3, 6, 6)
    assert fixed(x).shape == model(x).shape
    with torch.no_grad():  # every sample's output is its own: removing one leaves the others
        torch.testing.assert_close(fixed(x)[1:], fixed(x[1:]))
    # per-sample norms and clipped sums of the fixed model equal a float64 per-example loop
    check(ModuleValidator.fix(ConvNet()), [torch.randn(5, 3, 6, 6)])
    engine = PrivacyEngine()
    _, opt, loader = engine.make_private(
        module=fixed,
        optimizer=torch.optim.SGD(fixed.parameters(), lr=0.1),
        data_loader=DataLoader(
            TensorDataset(torch.randn(20, 3, 6, 6), torch.randint(0, 2, (20,))), batch_size=5
        ),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    xb, yb = next(x for x in loader if len(x[0]))
    nn.functional.cross_entropy(fixed(xb), yb).backward()
    opt.step()
    assert engine.steps == 1 and engine.get_epsilon(1e-5) > 0


@pytest.mark.parametrize(("channels", "groups"), [(6, 6), (32, 32), (64, 32), (48, 24), (7, 7), (37, 1)])
def test_fix_groups_divide_the_channels(channels, groups):
    fixed = ModuleValidator.fix(nn.BatchNorm2d(channels))
    assert isinstance(fixed, nn.GroupNorm) and fixed.num_groups == groups


def test_fix_refuses_what_it_cannot_replace():
    with pytest.raises(InvalidParameter, match="max_groups"):
        ModuleValidator.fix(nn.BatchNorm2d(4), max_groups=0)
    with pytest.raises(InvalidParameter, match=r"0 \(LazyBatchNorm2d\) is not initialised"):
        ModuleValidator.fix(nn.Sequential(nn.LazyBatchNorm2d()))
    with pytest.raises(TypeError, match="module must be"):
        ModuleValidator.validate("model")


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize(
    "kw",
    [
        {"batch_first": False, "num_layers": 2, "dropout": 0.5},
        {"batch_first": True, "num_layers": 2, "dropout": 0.5},
    ],
)
def test_fix_replaces_listed_recurrent_layers_by_opacus_layers_with_the_same_weights(cls, kw):
    pytest.importorskip("opacus")
    torch.manual_seed(0)
    rnn = cls(4, 5, bidirectional=True, **kw)
    assert len(ModuleValidator.validate(rnn)) == 1
    fixed = ModuleValidator.fix(rnn)
    assert type(fixed).__name__ == "DP" + cls.__name__ and ModuleValidator.validate(fixed) == []
    x = torch.randn(3, 7, 4)
    rnn.eval(), fixed.eval()
    torch.testing.assert_close(fixed(x)[0], rnn(x)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidParameter, match="proj_size=2: DPLSTM has no projection"):
        ModuleValidator.fix(nn.LSTM(4, 5, proj_size=2, batch_first=True))


class Recurrent(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (
            nn.LSTM(4, 5, num_layers=2, dropout=0.3),
            r"rnn \(LSTM\): dropout=0\.3 .*; use dropout=0, or opacus\.layers\.DPLSTM",
        ),
        (
            nn.GRU(4, 5, 2, batch_first=True, dropout=0.1),
            r"rnn \(GRU\): dropout=0\.1 .*; use dropout=0, or opacus\.layers\.DPGRU",
        ),
        (nn.LSTM(4, 6, batch_first=True, proj_size=5), r"rnn \(LSTM\): proj_size=5 .*; use proj_size=0"),
        (
            type("MyRNN", (nn.RNN,), {})(4, 5, batch_first=True),
            r"rnn \(MyRNN\): a subclass .*; use opacus\.layers\.DPRNN",
        ),
    ],
)
def test_fused_rnns_the_replay_cannot_follow_are_refused_naming_the_replacement(layer, message):
    """They failed inside functorch (the vmap fallback) at the first backward pass."""
    model = Recurrent(layer)
    with pytest.raises(UnsupportedModule, match=message):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(8, 3, 4)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_trainable_batchnorm_refused_naming_groupnorm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2))
    with pytest.raises(UnsupportedModule, match=r"1 \(BatchNorm2d\): .*; use nn\.GroupNorm"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(8, 3, 4, 4)), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_the_clipper_alone_refuses_a_frozen_batchnorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4).requires_grad_(False))
    with pytest.raises(UnsupportedModule, match=r"1 \(BatchNorm1d\)"):
        PerSampleClipper(model, max_grad_norm=1.0)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_frozen_fused_rnn_in_any_configuration_is_accepted():
    """Only the per-sample gradients of its own weights need the replay; frozen, it is per sample."""
    rnn = nn.LSTM(4, 5, num_layers=2, dropout=0.2)  # batch_first=False and dropout
    assert len(ModuleValidator.validate(rnn)) == 1
    rnn.requires_grad_(False)
    assert ModuleValidator.validate(nn.Sequential(rnn)) == []


@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_max_norm_refused_and_fixed(cls, frozen):
    """max_norm renormalises the looked-up rows in place, without noise: after one batch the weights
    show which rows the data used, whether the layer is trained or frozen."""
    torch.manual_seed(0)
    emb = cls(10, 4, max_norm=0.5).requires_grad_(not frozen)
    with torch.no_grad():
        emb.weight.mul_(10)
    before = emb.weight.detach().clone()
    emb(torch.tensor([[1, 2]]))
    touched = (emb.weight != before).any(1).nonzero().flatten().tolist()
    assert touched == [1, 2]  # the data's rows, visible in the weights
    problems = ModuleValidator.validate(nn.Sequential(emb))
    assert [(p.path, p.kind) for p in problems] == [("0", cls.__name__)]
    assert "max_norm=0.5 renormalises" in problems[0].reason
    fixed = ModuleValidator.fix(nn.Sequential(emb))
    assert fixed[0].max_norm is None and torch.equal(fixed[0].weight, emb.weight)
    assert ModuleValidator.validate(fixed) == [] and emb.max_norm == 0.5
