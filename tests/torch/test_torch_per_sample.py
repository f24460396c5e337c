"""Per-sample norms and clipped sums of every supported layer against a per-example loop in float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from gaussdp.errors import InvalidParameter, PrivacyError, UnsafeInput  # noqa: E402
from gaussdp.torch import PerSampleClipper  # noqa: E402
from gaussdp.torch._parts import LinearPart  # noqa: E402


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def brute_force(model, inputs, weight, clip):
    """Per-example gradients by a loop of autograd calls: norms and the clipped sum."""
    params = _trainable(model)
    norms, total = [], [torch.zeros_like(p) for p in params]
    for i in range(inputs[0].shape[0]):
        out = model(*[t[i : i + 1] for t in inputs])
        loss = (out * weight).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        n = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        norms.append(n)
        f = min(1.0, clip / (float(n) + 1e-6))
        for t, g in zip(total, grads, strict=True):
            t += f * g
    return torch.stack(norms), total


def run_clipper(model, inputs, weight, clip, reduction="mean"):
    clipper = PerSampleClipper(model, max_grad_norm=clip, loss_reduction=reduction)
    out = model(*inputs)
    b = inputs[0].shape[0]
    loss = (out * weight).sum() / (b if reduction == "mean" else 1)
    loss.backward()
    clipper.check_no_plain_gradients()
    sums = [clipper.summed.get(p, torch.zeros_like(p)) for p in _trainable(model)]
    clipper.remove()
    return clipper.last_norms, sums


def check(model, inputs, *, rtol=1e-9, atol=1e-10, reduction="mean"):
    model = model.double()
    inputs = [t.double() if t.is_floating_point() else t for t in inputs]
    torch.manual_seed(1)
    with torch.no_grad():
        out_shape = model(*[t[:1] for t in inputs]).shape[1:]
    weight = torch.randn(out_shape, dtype=torch.float64)
    ref_norms, _ = brute_force(model, inputs, weight, 1.0)
    clip = float(ref_norms.median())  # about half the samples get clipped
    ref_norms, ref_sum = brute_force(model, inputs, weight, clip)
    norms, sums = run_clipper(model, inputs, weight, clip, reduction)
    torch.testing.assert_close(norms, ref_norms, rtol=rtol, atol=atol)
    for s, r in zip(sums, ref_sum, strict=True):
        torch.testing.assert_close(s.double(), r, rtol=rtol, atol=atol)
    return norms


class Seq(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def test_mlp():
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3)), [torch.randn(9, 5)])


def test_mlp_sum_reduction():
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), [torch.randn(6, 5)], reduction="sum")


@pytest.mark.parametrize(
    ("d_in", "d_out", "t", "materialised"),
    [(4, 3, 8, True), (16, 16, 3, False), (64, 48, 16, False), (64, 48, 17, False)],
)
def test_linear_sequence_both_branches(d_in, d_out, t, materialised):
    torch.manual_seed(0)
    x = torch.randn(5, t, d_in)
    part = LinearPart(x, torch.randn(5, t, d_out), torch.Size((d_out, d_in)))
    assert part.materialises() == materialised  # the cost model picks the branch under test
    check(nn.Sequential(nn.Linear(d_in, d_out), nn.GELU(), nn.Linear(d_out, 2)), [x])


def test_linear_non_contiguous_input():
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5).transpose(1, 2)  # (6, 5, 4), not contiguous
    check(nn.Sequential(nn.Linear(4, 3)), [x])


@pytest.mark.parametrize(("d_in", "d_out"), [(3, 6), (6, 3)])
@pytest.mark.parametrize("which", ["a", "g", "both"])
def test_linear_part_sum_reads_position_major_storage(d_in, d_out, which):
    """Inputs or gradients stored (T, B, d) and seen as (B, T, d) views (the packed attention
    gradient): the weighted sum, also into an accumulator, equals the per-sample loop's."""
    torch.manual_seed(0)
    b, t = 4, 5
    a, g = torch.randn(b, t, d_in, dtype=torch.float64), torch.randn(b, t, d_out, dtype=torch.float64)
    w = torch.rand(b, dtype=torch.float64)
    want = sum(w[i] * g[i].T @ a[i] for i in range(b))

    def position_major(x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    a_s = position_major(a) if which in ("a", "both") else a
    g_s = position_major(g) if which in ("g", "both") else g
    part = LinearPart(a_s, g_s, torch.Size((d_out, d_in)))
    torch.testing.assert_close(part.weighted_sum(w), want)
    acc = torch.ones(d_out, d_in, dtype=torch.float64)
    part.weighted_sum(w, out=acc)  # added in place
    torch.testing.assert_close(acc, want + 1)


class ReluSideOutput(nn.Module):
    """The ReLU output also reaches the loss directly: the second layer is not its only consumer."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 12)

    def forward(self, x):
        a = torch.relu(self.l1(x))
        return self.l2(a) + a[..., :12]


def _relu_fed_spy(monkeypatch):
    """Record, per backward pass, whether a ReluFedPart was formed."""
    import gaussdp.torch._clipper as clipper_module

    seen = []
    real = clipper_module.PerSampleClipper._relu_fed

    def spy(module, pairs, l2):
        out = real(module, pairs, l2)
        seen.append(any(isinstance(q, clipper_module.ReluFedPart) for _, q in out))
        return out

    monkeypatch.setattr(clipper_module.PerSampleClipper, "_relu_fed", staticmethod(spy))
    return seen


@pytest.mark.parametrize(
    ("make", "recomputed"),
    [
        (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12)), True),
        (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 12)), True),
        (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 12)), True),
        (ReluSideOutput, False),  # another consumer: recomputing from l2 alone would be wrong
    ],
)
def test_linear_relu_linear_output_gradient_recomputed(monkeypatch, make, recomputed):
    """Linear -> ReLU -> Linear on sequences: the first layer's output gradient is not kept but
    recomputed from the second layer's input and output gradient; norms and clipped sums match the
    per-example loop exactly, and the recomputation happens only where the ReLU output has no other
    consumer. (Sizes where both layers keep ghost-norm parts, not per-sample gradients.)"""
    seen = _relu_fed_spy(monkeypatch)
    torch.manual_seed(0)
    check(make(), [torch.randn(5, 4, 8)])
    assert any(seen) == recomputed, seen


def test_linear_relu_linear_not_recomputed_when_output_gradient_is_small(monkeypatch):
    """Without a sequence (the output gradient smaller than the weight), the recomputation is not
    even set up (no alias, no hooks: it is decided in the forward pass)."""
    seen = _relu_fed_spy(monkeypatch)
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)), [torch.randn(5, 16)])
    assert seen == []


@pytest.mark.parametrize(("layers", "want"), [(1, [True]), (2, [True]), (3, [True, True])])
def test_transformer_encoder_recomputes_feed_forward_gradient(monkeypatch, layers, want):
    """nn.TransformerEncoder (ReLU feed-forward, dropout 0): the feed-forward gradient is recomputed
    in every layer except the first when there are several (its gradient arrives last and is kept,
    see PerSampleClipper._kept_anyway); one layer alone is recomputed. Exact either way."""
    import gaussdp.torch._clipper as clipper_module

    seen = _relu_fed_spy(monkeypatch)
    kept = []
    real = clipper_module.PerSampleClipper._kept_anyway

    def spy(self, call):
        kept.append(real(self, call))
        return kept[-1]

    monkeypatch.setattr(clipper_module.PerSampleClipper, "_kept_anyway", spy)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    check(model, [torch.randn(6, 5, 8).requires_grad_()], rtol=1e-8, atol=1e-9)
    assert seen == want
    # asked once per layer, last layer first (backward order): only the first layer's is kept
    assert kept == [False] * (layers - 1) + [layers > 1]


def test_relu_fed_refuses_a_weight_changed_during_backward():
    """The second layer's weight changed in place after its backward (a user hook) and before the
    recomputation: the step fails closed instead of using the new weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12))
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    h = model[0](torch.randn(5, 4, 8))

    def bump(grad):
        with torch.no_grad():
            model[2].weight.add_(1.0)

    h.register_hook(bump)
    with pytest.raises(UnsafeInput, match="a weight was modified in place"):
        model[2](model[1](h)).square().sum().backward()
    assert clipper.poisoned and not clipper.summed


class TokenModel(nn.Module):
    """Token + position embeddings; position ids are an ``.expand()``ed (stride 0) tensor."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(13, 8, padding_idx=1)
        self.pos = nn.Embedding(6, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
        return self.head(torch.tanh(self.tok(idx) + self.pos(pos)))


def test_embedding_padding_idx_and_expanded_positions():
    torch.manual_seed(0)
    idx = torch.randint(0, 13, (7, 6))
    idx[:, -2:] = 1  # padding positions
    idx[0, :3] = 5  # repeated token within a sample
    model = TokenModel()
    check(model, [idx])
    # the padding row never receives a gradient, as in PyTorch's own Embedding
    model.double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    model(idx).sum().backward()
    assert float(clipper.summed[model.tok.weight][1].abs().max()) == 0.0


class Bags(nn.Module):
    """Bags of ``lengths[i]`` ids from row ``i`` of ``ids``, given to an ``nn.EmbeddingBag`` as one
    flat input with ``offsets`` (or, with ``flat=False``, as the 2-D rows)."""

    def __init__(self, flat=True, weighted=False, **kw):
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 5, **kw)
        self.fc = nn.Linear(5, 2)
        self.flat, self.weighted = flat, weighted

    def forward(self, ids, lengths, weights):
        if not self.flat:
            return self.fc(self.bag(ids, per_sample_weights=weights if self.weighted else None))
        n = lengths.long()
        keep = torch.arange(ids.shape[1]).unsqueeze(0) < n.unsqueeze(1)
        offsets = torch.cat((torch.zeros(1, dtype=torch.long), n.cumsum(0)))
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        psw = weights[keep] if self.weighted else None
        return self.fc(self.bag(ids[keep], offsets, per_sample_weights=psw))


@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "sum"},
        {"mode": "mean"},
        {"mode": "mean", "padding_idx": 3},
        {"mode": "sum", "weighted": True, "padding_idx": 0},
        {"mode": "sum", "include_last_offset": True},
        {"mode": "mean", "flat": False},
        {"mode": "sum", "flat": False, "weighted": True},
        pytest.param(  # the vmap fallback (functorch has no batching rule for embedding_bag)
            {"mode": "max", "flat": False},
            marks=pytest.mark.filterwarnings("ignore:There is a performance drop"),
        ),
    ],
)
def test_embedding_bag_with_offsets(kw):
    torch.manual_seed(0)
    ids = torch.randint(0, 12, (6, 7))
    ids[0, :3] = 3  # a repeated row within a bag; with padding_idx=3 an empty bag
    ids[1, :] = 5
    lengths = torch.tensor([3, 7, 1, 0, 4, 7])  # an empty bag too
    check(Bags(**kw), [ids, lengths, torch.rand(6, 7)])


class BagsThenPositions(Bags):
    """An EmbeddingBag first (1-D ids with offsets), then position ids of shape (1, T) broadcast
    against the batch: the batch size is the number of bags, not of ids."""

    def __init__(self):
        super().__init__(mode="sum")
        self.pos = nn.Embedding(4, 5)

    def forward(self, ids, lengths, weights):
        h = super().forward(ids, lengths, weights)
        p = self.pos(torch.arange(4).unsqueeze(0))  # (1, 4, 5)
        return h + self.fc(p.mean(1))


def test_embedding_bag_first_then_broadcast_positions():
    torch.manual_seed(0)
    check(
        BagsThenPositions(),
        [torch.randint(0, 12, (6, 7)), torch.tensor([3, 7, 1, 2, 4, 7]), torch.rand(6, 7)],
    )


def test_embedding_bag_without_a_rule_refused_with_offsets():
    model = Bags(mode="max")
    PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsafeInput, match=r"EmbeddingBag\(mode='max'.* with offsets has no per-sample rule"):
        model(torch.randint(0, 12, (4, 5)), torch.tensor([1, 2, 3, 4]), torch.rand(4, 5)).sum().backward()


class Tied(nn.Module):
    """An input embedding and an output layer sharing one weight (as GPT-2's wte / lm_head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.emb(idx))
        return self.head(self.mid(h) + self.mid(h * 2))  # mid is also called twice


def test_tied_and_reused_weights():
    torch.manual_seed(0)
    check(Tied(), [torch.randint(0, 11, (5, 4))])


class RecurrentHead(nn.Module):
    def __init__(self, rnn, hidden):
        super().__init__()
        self.rnn = rnn
        self.fc = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("name", ["DPLSTM", "DPGRU", "DPRNN"])
@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}])
def test_opacus_dp_rnns_one_owner_per_parameter(monkeypatch, name, kw):
    """Opacus's DP RNNs hold every weight of their inner RNNLinear maps under their own names too:
    the inner map, which uses it, is its one owner (two owners doubled every per-sample norm) and
    its linear rule is used, the layer is not recomputed per sample."""
    layers = pytest.importorskip("opacus.layers")
    from gaussdp.torch import _clipper, _rules

    torch.manual_seed(0)
    rnn = getattr(layers, name)(4, 5, batch_first=True, **kw)
    model = RecurrentHead(rnn, 10 if kw else 5)
    x = torch.randn(6, 7, 4)
    check(model, [x])
    owners = _clipper._owners(model)
    assert rnn not in owners
    owned = [id(p) for o in owners.values() for p in o.values()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert all(type(m).__name__ in ("RNNLinear", "Linear") for m in owners)

    def no_vmap(*args):
        raise AssertionError("vmap fallback used")

    monkeypatch.setattr(_clipper, "vmap_parts", no_vmap)
    monkeypatch.setattr(_rules, "vmap_parts", no_vmap)
    check(model, [x])


class RecurrentState(nn.Module):
    """A fused RNN with a learned initial state, read through its output, h_n and (LSTM) c_n."""

    def __init__(self, cls, **kw):
        super().__init__()
        self.rnn = cls(4, 5, batch_first=True, **kw)
        self.copies = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        self.init = nn.Linear(4, 5)
        self.fc = nn.Linear(5 * (2 if self.rnn.bidirectional else 1), 2)
        self.fc_state = nn.Linear(5, 2)

    def forward(self, x):
        h0 = torch.tanh(self.init(x[:, 0])).unsqueeze(0).expand(self.copies, -1, -1).contiguous()
        lstm = isinstance(self.rnn, nn.LSTM)
        out, state = self.rnn(x, (h0, torch.zeros_like(h0)) if lstm else h0)
        y = self.fc(out[:, 1:].mean(1)) + self.fc_state(state[0].sum(0) if lstm else state.sum(0))
        return y + self.fc_state(state[1][-1]) if lstm else y


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize(
    "kw", [{}, {"num_layers": 2, "bidirectional": True}, {"num_layers": 2, "bias": False}]
)
def test_fused_rnns_replayed_per_sample(monkeypatch, cls, kw):
    """nn.LSTM/GRU/RNN as they are: the recurrence is replayed unrolled to get each step's
    pre-activation gradients (they failed inside functorch before)."""
    from gaussdp.torch import _clipper

    def no_vmap(*args):
        raise AssertionError("vmap fallback used")

    monkeypatch.setattr(_clipper, "vmap_parts", no_vmap)
    torch.manual_seed(0)
    if cls is nn.RNN and "bias" in kw:
        kw = {**kw, "nonlinearity": "relu"}
    check(RecurrentState(cls, **kw), [torch.randn(6, 7, 4)])


def test_fused_rnn_with_a_frozen_weight():
    torch.manual_seed(0)
    model = RecurrentState(nn.LSTM, num_layers=2)
    model.rnn.weight_ih_l0.requires_grad_(False)
    model.rnn.bias_hh_l1.requires_grad_(False)
    check(model, [torch.randn(5, 6, 4)])


def test_fused_rnn_configurations_without_a_rule_fail_closed():
    from torch.nn.utils.rnn import pack_padded_sequence

    rnn = nn.GRU(4, 5, batch_first=True)
    PerSampleClipper(rnn, max_grad_norm=1.0)
    packed = pack_padded_sequence(torch.randn(3, 6, 4), torch.tensor([6, 4, 2]), batch_first=True)
    with pytest.raises(UnsafeInput, match="PackedSequence"):
        rnn(packed)[0].data.sum().backward()
    lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.5, batch_first=True)
    with pytest.raises(InvalidParameter, match=r"dropout=0\.5 between layers"):
        PerSampleClipper(lstm, max_grad_norm=1.0)


class AliasUsedByParent(nn.Module):
    """Holds its child's weight under its own name too, and uses it outside the child."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.alias = self.lin.weight

    def forward(self, x):
        return self.lin(x) + x @ self.alias


def test_opacus_dp_rnn_on_a_packed_sequence_fails_closed():
    layers = pytest.importorskip("opacus.layers")
    from torch.nn.utils.rnn import pack_padded_sequence

    rnn = layers.DPLSTM(4, 5, batch_first=True)
    PerSampleClipper(rnn, max_grad_norm=1.0)
    packed = pack_padded_sequence(torch.randn(3, 6, 4), torch.tensor([6, 4, 2]), batch_first=True)
    with pytest.raises(UnsafeInput, match=r"different batch sizes \[1, 2, 3\].*PackedSequence"):
        rnn(packed)[0].data.sum().backward()


def test_parent_using_its_childs_parameter_fails_closed():
    model = AliasUsedByParent()
    PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(PrivacyError, match=r"\['alias'\] received gradients outside"):
        model(torch.randn(4, 3)).sum().backward()


class Head(nn.Module):
    """A convolution (or anything) followed by tanh and a linear read-out of all its outputs."""

    def __init__(self, body):
        super().__init__()
        self.body, self.head = body, nn.LazyLinear(2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).flatten(1))


def _conv_check(conv, x):
    model = Head(conv)
    with torch.no_grad():
        model(x[:1])  # materialise the lazy read-out
    return check(model, [x])


CONVS = [
    # (module, input shape)
    (lambda: nn.Conv1d(3, 4, 3, padding=1, stride=2), (6, 3, 8)),
    (lambda: nn.Conv1d(4, 6, 2, dilation=3, groups=2, bias=False), (5, 4, 11)),
    (lambda: nn.Conv1d(2, 3, 4, padding="same", padding_mode="reflect"), (5, 2, 9)),
    (lambda: nn.Conv2d(2, 3, (3, 2), padding=(1, 0), dilation=(1, 2), stride=(2, 1)), (5, 2, 6, 6)),
    (lambda: nn.Conv2d(4, 4, 3, groups=2), (5, 4, 4, 4)),
    (lambda: nn.Conv2d(6, 3, 3, groups=3, padding=2, padding_mode="circular"), (4, 6, 5, 5)),
    (lambda: nn.Conv2d(3, 4, (2, 3), padding="same", dilation=2), (4, 3, 6, 7)),
    (lambda: nn.Conv2d(2, 4, 1), (5, 2, 3, 3)),
    (lambda: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1)), (4, 2, 4, 5, 3)),
    (
        lambda: nn.Conv3d(4, 4, 2, groups=4, dilation=(1, 2, 1), padding_mode="replicate", padding=1),
        (3, 4, 3, 4, 3),
    ),
    (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (5, 3, 6)),
    (lambda: nn.ConvTranspose1d(4, 6, 3, groups=2, dilation=2), (4, 4, 5)),
    (lambda: nn.ConvTranspose2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (4, 2, 4, 5)),
    (lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, groups=2, output_padding=1, bias=False), (4, 4, 3, 3)),
    (lambda: nn.ConvTranspose3d(2, 3, 2, stride=(1, 2, 2), padding=(0, 1, 0)), (3, 2, 3, 3, 2)),
]


@pytest.mark.parametrize(("make", "shape"), CONVS, ids=[f"conv{i}" for i in range(len(CONVS))])
@pytest.mark.parametrize(
    "route", ["model", "gram", "input-gram", "build", "keep", "build-grouped", "keep-grouped"]
)
def test_convolutions_match_the_loop(monkeypatch, make, shape, route):
    """Conv1d/2d/3d and ConvTranspose1d/2d/3d (stride, padding and padding modes, dilation, groups)
    through each route of the cost model: norms by the Gram identity, from per-sample gradients
    dropped after (sum by a weight-gradient convolution), or kept for the sum; in small chunks.
    Per-sample gradients from patches and a batched matmul, or ("-grouped") from one convolution
    with the samples as groups (in float64 torch's own convolution, not oneDNN's: see
    test_conv_grouped_per_sample_gradients_float32 for that)."""
    from gaussdp.torch._parts import ConvPart

    grouped = route.endswith("-grouped")
    monkeypatch.setattr(ConvPart, "_grouped", lambda self, a: grouped)
    route = route.removesuffix("-grouped")
    if route != "model":
        monkeypatch.setattr(ConvPart, "route", lambda self: route)
        monkeypatch.setattr(ConvPart, "_CHUNK", 1)  # one sample per chunk: the chunk loop is tested
    torch.manual_seed(0)
    _conv_check(make(), torch.randn(*shape))


@pytest.mark.parametrize(
    ("c_in", "c_out", "k", "size", "stride", "padding", "groups", "dilation"),
    [
        (1, 16, 8, 28, 2, 3, 1, 1),
        (32, 64, 3, 16, 1, 1, 1, 1),
        (8, 8, 4, 18, 1, 2, 2, 1),
        (1, 8, 5, 17, 3, 2, 1, 2),  # one input channel (a forward convolution): stride and dilation swap
        (2, 8, 3, 15, 1, 1, 2, 3),
    ],
)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "patches"])
def test_conv_grouped_per_sample_gradients_float32(
    c_in, c_out, k, size, stride, padding, groups, dilation, grouped
):
    """The float32 per-sample gradients formed by one grouped convolution (oneDNN where available,
    as chosen for layers like the mnist CNN's second and the cifar10 CNN's second), or from the
    patches (kept transposed), against a float64 per-sample loop; the norms and the kept
    gradients' weighted sum too."""
    from gaussdp.torch._parts import ConvPart

    torch.manual_seed(0)
    b = 6
    conv = nn.Conv2d(
        c_in, c_out, k, stride=stride, padding=padding, groups=groups, dilation=dilation
    ).double()
    x = torch.randn(b, c_in, size, size, dtype=torch.float64)
    g = torch.randn_like(conv(x))
    ref = torch.stack(
        [
            torch.ops.aten.convolution_backward(
                g[i : i + 1], x[i : i + 1], conv.weight, None, conv.stride, conv.padding,
                conv.dilation, False, (0, 0), groups, (False, True, False),
            )[1]
            for i in range(b)
        ]
    )  # fmt: skip
    part = ConvPart(
        x.float(), g.float(), conv.weight.shape, stride=conv.stride, padding=conv.padding,
        dilation=conv.dilation, groups=groups,
    )  # fmt: skip
    patch, per_group = k * k * c_in // groups, c_out // groups
    big = patch * per_group >= 4096 and part._dims()[0] >= 64
    assert part._grouped(part.a) == (patch >= 64 and (big or c_in // groups == 1))
    part._grouped = lambda a: grouped  # type: ignore[method-assign]
    part.route = lambda: "keep"  # type: ignore[method-assign]
    sq = part.sq_norms()
    torch.testing.assert_close(sq.double(), ref.flatten(1).square().sum(1), rtol=1e-5, atol=1e-6)
    assert part._ps is not None and part._ps.dtype == torch.float32 and part._ps_t == (not grouped)
    # float32 sums of up to 256 products of unit normals (entries of size about 16)
    torch.testing.assert_close(part.materialise().double(), ref, rtol=1e-4, atol=1e-4)
    w = torch.rand(b, dtype=torch.float64)
    torch.testing.assert_close(part.weighted_sum(w.float()).double(), (w.view(-1, 1, 1, 1, 1) * ref).sum(0),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_conv_cost_model_routes():
    """The cost model: per-sample gradients kept where no larger than input and gradient, else the
    cheapest of the Gram identity on the patches or on the input, and building them."""
    from gaussdp.torch._parts import ConvPart

    def part(c_in, c_out, k, size, stride=1, dtype=torch.float32):
        x = torch.randn(2, c_in, size, size, dtype=dtype)
        out = (size - k) // stride + 1
        g = torch.randn(2, c_out, out, out, dtype=dtype)
        w = torch.Size((c_out, c_in, k, k))
        return ConvPart(x, g, w, stride=(stride, stride), padding=(0, 0), dilation=(1, 1), groups=1)

    assert part(3, 8, 3, 32).route() == "keep"  # small weight: kept
    assert part(64, 128, 3, 6).route() == "input-gram"  # few positions, big weight: Gram of the input
    assert part(16, 32, 4, 13, stride=2).route() == "gram"  # stride 2: the input has 4x more positions
    # in float32 on the CPU the grouped convolution builds per-sample gradients at about twice the
    # flop rate of the Gram products: preferred where it is not twice the flops
    grouped = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    assert part(32, 64, 3, 12).route() == ("build" if grouped else "input-gram")
    assert part(32, 64, 3, 12, dtype=torch.float64).route() == "input-gram"


def test_conv_transpose_output_padding_beyond_stride_refused():
    conv = nn.ConvTranspose1d(2, 2, 3, stride=1, dilation=3, output_padding=2)
    model = Head(conv)
    x = torch.randn(3, 2, 5)
    with torch.no_grad():
        model(x[:1])
    PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsafeInput, match="output_padding"):
        model(x).sum().backward()


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "per-sample"])
def test_norm_layers(monkeypatch, chunk):
    """LayerNorm, RMSNorm, GroupNorm; GroupNorm's input normalised whole or one sample at a time."""
    import gaussdp.torch._rules as rules

    if chunk is not None:
        monkeypatch.setattr(rules, "_NORM_CHUNK", chunk)
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)), [torch.randn(5, 3, 4)])
    check(nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6, eps=1e-6), nn.Linear(6, 2)), [torch.randn(5, 3, 4)])
    check(
        nn.Sequential(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 2)),
        [torch.randn(5, 2, 3, 3)],
    )


@pytest.mark.parametrize(
    ("norm", "conv", "shape"),
    [
        (lambda: nn.InstanceNorm1d(4, affine=True), lambda: nn.Conv1d(2, 4, 2), (5, 2, 6)),
        (lambda: nn.InstanceNorm2d(4, affine=True, eps=1e-3), lambda: nn.Conv2d(2, 4, 2), (5, 2, 4, 3)),
        (lambda: nn.InstanceNorm3d(4, affine=True), lambda: nn.Conv3d(2, 4, 2), (4, 2, 3, 4, 3)),
    ],
)
@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "per-sample"])
def test_instance_norm_affine(monkeypatch, norm, conv, shape, chunk):
    import gaussdp.torch._clipper as clipper_mod
    import gaussdp.torch._rules as rules

    def no_vmap(*a, **k):
        raise AssertionError("the closed-form rule was expected")

    monkeypatch.setattr(clipper_mod, "vmap_parts", no_vmap)
    if chunk is not None:
        monkeypatch.setattr(rules, "_NORM_CHUNK", chunk)
    torch.manual_seed(0)
    _conv_check(nn.Sequential(conv(), norm()), torch.randn(*shape))


class Scale(nn.Module):
    """A custom layer: ``y = x * weight + shift`` elementwise over the last dimension."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.shift


def scale_rule(module, args, kwargs, grad_outputs):
    x, g = args[0], grad_outputs[0]
    b = x.shape[0]
    return {
        "weight": (x * g).reshape(b, -1, x.shape[-1]).sum(1),
        "shift": g.reshape(b, -1, g.shape[-1]).sum(1),
    }


def test_registered_rule_for_a_custom_layer(monkeypatch):
    """A custom layer's registered rule is used (not torch.func) and its per-sample gradients are
    clipped and summed exactly; a subclass inherits it; removing it restores the fallback."""
    import gaussdp.torch
    import gaussdp.torch._clipper as clipper_mod

    calls = []

    def counted(module, args, kwargs, grad_outputs):
        calls.append(type(module))
        return scale_rule(module, args, kwargs, grad_outputs)

    handle = gaussdp.torch.register_rule(Scale, counted)
    try:
        with monkeypatch.context() as mp:
            mp.setattr(clipper_mod, "vmap_parts", None)  # would fail if called
            torch.manual_seed(0)
            check(nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2)), [torch.randn(6, 3)])
            check(nn.Sequential(Scale(3), nn.Linear(3, 2)), [torch.randn(5, 4, 3)])

            class SubScale(Scale):
                pass

            check(nn.Sequential(SubScale(3), nn.Linear(3, 2)), [torch.randn(5, 3)])
        assert Scale in calls and SubScale in calls
        with pytest.raises(InvalidParameter, match="registered for Scale already"):
            gaussdp.torch.register_rule(Scale, scale_rule)
        gaussdp.torch.register_rule(Scale, scale_rule, replace=True)
    finally:
        handle.remove()  # the replacement is not this handle's: it stays
    from gaussdp.torch._rules import _REGISTERED

    assert _REGISTERED.get(Scale) is scale_rule
    _REGISTERED.pop(Scale)
    n = len(calls)
    torch.manual_seed(0)
    check(nn.Sequential(Scale(3), nn.Linear(3, 2)), [torch.randn(5, 3)])  # torch.func again
    assert len(calls) == n


def test_registered_rule_is_checked_and_takes_precedence():
    import gaussdp.torch

    with pytest.raises(TypeError, match="module_type"):
        gaussdp.torch.register_rule(int, scale_rule)
    with pytest.raises(TypeError, match="rule must be callable"):
        gaussdp.torch.register_rule(Scale, 3)

    def wrong(module, args, kwargs, grad_outputs):
        return {"weight": scale_rule(module, args, kwargs, grad_outputs)["weight"]}  # no "shift"

    handle = gaussdp.torch.register_rule(Scale, wrong)
    try:
        model = nn.Sequential(Scale(3), nn.Linear(3, 2))
        PerSampleClipper(model, max_grad_norm=1.0)
        with pytest.raises(UnsafeInput, match=r"gave nothing for its trainable parameter 'shift'"):
            model(torch.randn(4, 3)).sum().backward()
    finally:
        handle.remove()

    class Doubled(nn.Linear):
        """A linear layer whose registered rule replaces the built-in one."""

    seen = []

    def linear_rule(module, args, kwargs, grad_outputs):
        seen.append(module)
        x, g = args[0], grad_outputs[0]
        return {"weight": g.unsqueeze(2) * x.unsqueeze(1), "bias": g}

    handle = gaussdp.torch.register_rule(Doubled, linear_rule)
    try:
        torch.manual_seed(0)
        check(nn.Sequential(Doubled(3, 4), nn.Tanh(), nn.Linear(4, 2)), [torch.randn(5, 3)])
        assert seen
    finally:
        handle.remove()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask):
        out, _ = self.attn(x, x, x, key_padding_mask=mask, need_weights=False)
        return self.head(out)


def test_multihead_attention_as_is():
    torch.manual_seed(0)
    mask = torch.zeros(5, 4, dtype=torch.bool)
    mask[:, -1] = True
    model = Attention()
    keys = list(model.state_dict())
    check(model, [torch.randn(5, 4, 8), mask])
    assert list(model.state_dict()) == keys  # not swapped or wrapped


class Scaled(nn.Module):
    """A raw parameter used by its own module: the torch.func fallback."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_custom_parameter_vmap_fallback():
    torch.manual_seed(0)
    check(nn.Sequential(Scaled(), nn.Tanh(), nn.Linear(4, 2)), [torch.randn(6, 4)])


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_get_no_gradient():
    torch.manual_seed(0)
    check(WithUnused(), [torch.randn(4, 3)])


def test_frozen_parameters_are_not_clipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    model[0].requires_grad_(False)
    norms = check(model, [torch.randn(6, 5)])
    assert norms.shape == (6,)


def test_bf16_norms_accumulate_in_float32():
    torch.manual_seed(0)
    model64 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()
    x = torch.randn(8, 5, 16, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64)
    ref, _ = brute_force(model64, [x], weight, 1.0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model.load_state_dict(model64.state_dict())
    model = model.bfloat16()
    norms, sums = run_clipper(model, [x.bfloat16()], weight.bfloat16(), 1.0)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms.double(), ref, rtol=0.05, atol=0.0)
    assert all(s.dtype == torch.float32 for s in sums)


class Leaky(nn.Module):
    """Uses a child's weight outside the child's forward: it cannot be clipped per sample."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight


def test_gradient_outside_owner_fails_closed():
    model = Leaky()
    PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(PrivacyError, match=r"lin\.weight"):
        model(torch.randn(4, 3)).sum().backward()


def test_second_backward_on_same_samples_refused():
    model = nn.Linear(3, 2)
    PerSampleClipper(model, max_grad_norm=1.0)
    out = model(torch.randn(4, 3))
    out.sum().backward(retain_graph=True)
    with pytest.raises(PrivacyError, match="already clipped"):
        out.sum().backward()


def test_hooks_removed_leave_module_unchanged():
    model = nn.Linear(3, 2)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.remove()
    model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None


class SelfAttentionBlock(nn.Module):
    """Self-attention whose input needs a gradient (as after an embedding): the captured path."""

    def __init__(self, e=8):
        super().__init__()
        self.inp = nn.Linear(e, e)
        self.attn = nn.MultiheadAttention(e, 2, batch_first=True)
        self.head = nn.Linear(e, 3)

    def forward(self, x, mask):
        h = self.inp(x)
        out, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        return self.head(out).mean(1)


@pytest.mark.parametrize(("t", "e"), [(4, 8), (17, 64)])
@pytest.mark.parametrize("layout", ["split", "packed", "heads"])
def test_multihead_attention_from_its_graph_matches_brute_force(monkeypatch, layout, t, e):
    """The attention's own saved output and the gradients of its input projections replace the
    recomputation: three projections of one weight's chunks (the input passed as three aliases, the
    default), the packed q/k/v projection (where the input is not split), or, where neither node
    is found, the q/k/v gradients in head layout. The norms and clipped sums still match the
    per-example loop, and the captured path is the one taken. At 17 positions and width 64 the
    norms are ghost norms from split Grams, and the split q/k/v share one Gram of their input."""
    import gaussdp.torch._clipper as clipper_module
    import gaussdp.torch._mha as mha_module
    import gaussdp.torch._parts as parts_module

    layouts, blocks = [], []
    real, real_norms = clipper_module.mha_captured_parts, parts_module._ghost_sq_norms

    def spy(*args):
        layouts.append(args[-1].layout)
        return real(*args)

    def spy_norms(a, gs):
        blocks.append(len(gs))
        return real_norms(a, gs)

    monkeypatch.setattr(clipper_module, "mha_captured_parts", spy)
    monkeypatch.setattr(parts_module, "_ghost_sq_norms", spy_norms)
    if layout != "split":
        monkeypatch.setattr(clipper_module, "_split_self_attention", lambda *a: None)
    if layout == "heads":
        monkeypatch.setattr(mha_module, "_packed_projection", lambda *a: None)
    torch.manual_seed(0)
    mask = torch.zeros(5, t, dtype=torch.bool)
    mask[:2, -1] = True
    check(SelfAttentionBlock(e), [torch.randn(5, t, e), mask])
    assert layouts and set(layouts) == {layout}, layouts
    assert (3 in blocks) == (layout == "split" and t > 4), blocks


class AttentionTwice(SelfAttentionBlock):
    def forward(self, x):
        h = self.inp(x)
        h = self.attn(h, h, h, need_weights=False)[0]
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(h).mean(1)


def test_multihead_attention_called_twice():
    """One attention module applied twice: its two calls' split q/k/v parts are combined per sample."""
    torch.manual_seed(0)
    check(AttentionTwice(32), [torch.randn(5, 17, 32)])


def test_batch_first_self_attention_gets_three_gemm_input_projections():
    """Batch-first self-attention is given its input as three aliases stored position-major (same
    values): the input projections are then three GEMMs (q, k, v; not T batched ones), backward
    pads no q/k/v gradient to the packed shape (no ``select_backward``), and the output is the same
    up to float rounding (the GEMMs of the weight's chunks may block their sums differently)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(5, 4, 8, requires_grad=True)
    want, _ = attn(x, x, x, need_weights=False)
    clipper = PerSampleClipper(attn, max_grad_norm=1.0)
    with Ops() as ops:
        got, _ = attn(x, x, x, need_weights=False)
        got.square().sum().backward()
    forward = ops.names[: next(i for i, n in enumerate(ops.names) if "scaled_dot_product" in n)]
    assert forward.count("aten.addmm") == 3 and "aten.bmm" not in forward, forward
    assert "aten.select_backward" not in ops.names, ops.names
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert x.grad is not None and set(clipper.summed) == set(attn.parameters())


def test_transformer_encoder_layer_captured_and_recomputed_agree(monkeypatch):
    """Float32 TransformerEncoderLayer: captured and recomputed attention give the same clipped sums."""
    import gaussdp.torch._clipper as clipper_module

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    x = torch.randn(6, 5, 16, requires_grad=True)

    def run():
        clipper = PerSampleClipper(layer, max_grad_norm=295.0)  # norms are 275..306: some clipped
        layer(x).square().sum().backward()
        out = [clipper.summed[p].clone() for p in layer.parameters()], clipper.last_norms
        clipper.remove()
        return out

    fast_sums, fast_norms = run()
    monkeypatch.setattr(clipper_module, "mha_capture", lambda *a: None)
    slow_sums, slow_norms = run()
    assert float((slow_norms > 295.0).float().mean()) not in (0.0, 1.0)
    torch.testing.assert_close(fast_norms, slow_norms, rtol=1e-5, atol=0.0)
    for a, b in zip(fast_sums, slow_sums, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


class CrossAttention(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, **kw)
        self.head = nn.Linear(8, 3)

    def forward(self, x, mem):
        causal = torch.triu(torch.ones(x.shape[1], mem.shape[1], dtype=torch.bool), diagonal=1)
        out, w = self.attn(x, mem, mem, attn_mask=causal, need_weights=True)
        return self.head(out) + w.sum(-1, keepdim=True)


@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 5}, {"bias": False}])
def test_multihead_attention_cross_masks_and_weights(kw):
    torch.manual_seed(0)
    d_mem = kw.get("kdim", 8)
    check(CrossAttention(**kw), [torch.randn(5, 4, 8), torch.randn(5, 4, d_mem)])


def test_multihead_attention_batch_second_refused():
    model = nn.MultiheadAttention(8, 2)
    PerSampleClipper(model, max_grad_norm=1.0)
    x = torch.randn(4, 3, 8)
    with pytest.raises(PrivacyError, match="batch_first"):
        model(x, x, x)[0].sum().backward()


def test_hugging_face_conv1d_transposed_weight():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    check(nn.Sequential(pytorch_utils.Conv1D(6, 4), nn.Tanh(), nn.Linear(6, 2)), [torch.randn(5, 3, 4)])


class InPlaceAfterUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(x)
        out = self.lin(h)
        h.mul_(2.0)  # changes the kept input of lin after its call
        return out + h


def test_input_modified_in_place_after_use_fails_closed():
    from gaussdp.errors import UnsafeInput

    model = InPlaceAfterUse()
    PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsafeInput, match="in place"):
        model(torch.randn(4, 3)).sum().backward()


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def test_hugging_face_gpt2_full_fine_tuning():
    """Conv1D projections, LayerNorm, tied wte/lm_head, and position ids of shape (1, T) that
    broadcast over the batch (their lookup is made per sample)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=30,
        n_positions=8,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    check(_Logits(model), [torch.randint(0, 30, (4, 8))], rtol=1e-8, atol=1e-9)


def _per_layer_brute_force(model, x, bounds, loss):
    params = _trainable(model)
    ref = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model(x[i : i + 1])), params, allow_unused=True)
        for r, g, b in zip(ref, grads, bounds, strict=True):
            if g is not None:
                r += g * min(1.0, b / (float(g.double().norm()) + 1e-6))
    return ref


@pytest.mark.parametrize(
    "make, make_input",
    [
        (
            lambda: nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)),
            lambda: torch.randn(7, 4, 5),
        ),
        (
            lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
            lambda: torch.randn(6, 5, 8, requires_grad=True),  # attention read from its graph
        ),
        (Tied, lambda: torch.randint(0, 11, (6, 4))),  # a tied weight and a layer called twice
    ],
)
def test_per_layer_clipping_matches_brute_force(make, make_input):
    """Per-layer clipping: each parameter's per-sample gradient clipped to its own bound (summed
    during backward, or at its end for the tied weight), against the per-example loop in float64."""
    torch.manual_seed(0)
    model = make().double()
    x = make_input()
    x = x.double().detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x
    n = len(_trainable(model))
    bounds = [0.05 * (k + 1) for k in range(n)]

    def loss(out):
        return out.square().sum()

    clipper = PerSampleClipper(model, max_grad_norm=bounds, clipping="per_layer", loss_reduction="sum")
    loss(model(x)).backward()
    sums = [clipper.summed.get(p, torch.zeros_like(p)) for p in _trainable(model)]
    clipper.remove()
    ref = _per_layer_brute_force(model, x, bounds, loss)
    assert clipper.max_grad_norm == pytest.approx(sum(b * b for b in bounds) ** 0.5)
    for s, r in zip(sums, ref, strict=True):
        torch.testing.assert_close(s, r, rtol=1e-9, atol=1e-10)


def test_per_layer_bounds_refused_when_wrong():
    model = nn.Linear(3, 2)
    with pytest.raises(InvalidParameter, match="2 trainable parameters"):
        PerSampleClipper(model, max_grad_norm=[1.0], clipping="per_layer")
    with pytest.raises(InvalidParameter, match=r"max_grad_norm\[1\]"):
        PerSampleClipper(model, max_grad_norm=[1.0, -1.0], clipping="per_layer")
    with pytest.raises(InvalidParameter, match="clipping"):
        PerSampleClipper(model, max_grad_norm=1.0, clipping="per_sample")
    shared = PerSampleClipper(model, max_grad_norm=2.0, clipping="per_layer")
    assert shared.max_grad_norm == pytest.approx(2.0)  # C / sqrt(2) for each of the two parameters


def test_first_layer_output_joins_the_graph_in_place_only_when_fresh():
    """A first layer's output that needs no gradient is made to need one in place (no copy) when it
    is a fresh tensor; a view of the input is left alone (a copy joins the graph instead)."""

    class Narrow(nn.Module):  # owns a parameter its output does not depend on: a view of the input
        def __init__(self):
            super().__init__()
            self.unused = nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return x.narrow(1, 0, 2)

    torch.manual_seed(0)
    x = torch.randn(5, 3)
    model = nn.Sequential(Narrow(), nn.Linear(2, 2))
    PerSampleClipper(model, max_grad_norm=1.0)
    version = x._version
    model(x).sum().backward()
    assert x._version == version  # the input was not marked as modified
    conv = nn.Conv1d(2, 3, 2)
    PerSampleClipper(conv, max_grad_norm=1.0)
    y = conv(torch.randn(4, 2, 5))
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_TapBackward"


class TimeMajor(nn.Module):
    """A fused RNN made with batch_first=False, fed (T, B, in) inside a batch-first model."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn
        self.fc = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 2)

    def forward(self, x):  # x (B, T, in)
        out, _ = self.rnn(x.transpose(0, 1))
        return self.fc(out.mean(0))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_fused_rnns_with_batch_first_false_replayed_per_sample(monkeypatch, cls):
    """make_private's docstring said batch_first=False supports nn.LSTM; it was refused. The layer's
    own batch_first says where its batch is; the replay runs batch-first."""
    from gaussdp.torch import _clipper

    def no_vmap(*args):
        raise AssertionError("vmap fallback used")

    monkeypatch.setattr(_clipper, "vmap_parts", no_vmap)
    torch.manual_seed(0)
    check(TimeMajor(cls(4, 5, num_layers=2, bidirectional=True)), [torch.randn(6, 7, 4)])


@pytest.mark.parametrize("kind", ["nn.LSTM", "DPLSTM"])
def test_batch_first_false_recurrent_model_matches_the_loop(kind):
    """The whole model batch-second (Opacus's batch_first=False): ids (T, B), an embedding, a
    recurrent layer made with batch_first=False (fused, or Opacus's DPLSTM, whose maps get one
    time step (B, D) at a time) and a linear read-out of every step (T, B, C)."""
    torch.manual_seed(0)
    if kind == "DPLSTM":
        layers = pytest.importorskip("opacus.layers")
        rnn = layers.DPLSTM(4, 5, batch_first=False)
    else:
        rnn = nn.LSTM(4, 5, batch_first=False)
    model = nn.ModuleDict({"emb": nn.Embedding(11, 4), "rnn": rnn, "fc": nn.Linear(5, 3)}).double()

    def forward(ids):
        return model["fc"](model["rnn"](model["emb"](ids))[0])

    ids = torch.randint(0, 11, (7, 6))  # (T, B)
    weight = torch.randn(7, 1, 3, dtype=torch.float64)
    params = list(model.parameters())
    norms, total = [], [torch.zeros_like(p) for p in params]
    for i in range(ids.shape[1]):
        grads = torch.autograd.grad((forward(ids[:, i : i + 1]) * weight).sum(), params)
        n = torch.sqrt(sum((g**2).sum() for g in grads))
        norms.append(n)
        for t, g in zip(total, grads, strict=True):
            t += min(1.0, 0.5 / (float(n) + 1e-6)) * g
    clipper = PerSampleClipper(model, max_grad_norm=0.5, batch_first=False, loss_reduction="sum")
    (forward(ids) * weight).sum().backward()
    clipper.check_no_plain_gradients()
    torch.testing.assert_close(clipper.last_norms, torch.stack(norms), rtol=1e-9, atol=1e-10)
    for p, r in zip(params, total, strict=True):
        torch.testing.assert_close(clipper.summed[p].double(), r, rtol=1e-9, atol=1e-10)


class SparseTokens(nn.Module):
    def __init__(self, cls=nn.Embedding, **kw):
        super().__init__()
        self.emb = cls(11, 4, sparse=True, **kw)
        self.fc = nn.Linear(4, 2)

    def forward(self, ids):
        h = self.emb(ids)
        return self.fc(torch.tanh(h if h.dim() == 2 else h.mean(1)))


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(nn.Embedding, {}), (nn.Embedding, {"padding_idx": 0}), (nn.EmbeddingBag, {"mode": "mean"})],
)
def test_sparse_embeddings_use_an_exact_per_sample_rule(cls, kw):
    """Embedding(sparse=True) crashed in the vmap fallback (aten::view on SparseCPU) where Opacus
    trains. sparse only changes how autograd stores the summed gradient, never formed here: the
    per-sample rule is the dense layer's."""
    torch.manual_seed(0)
    check(SparseTokens(cls, **kw), [torch.randint(0, 11, (6, 5))])
