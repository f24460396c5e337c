"""Hook placement, removal, output handling and per-row clipping of HiddenStatePrivatizer."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from gaussdp.calibration import epsilon_for, sigma_for  # noqa: E402
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput  # noqa: E402
from gaussdp.inference import HiddenStatePrivatizer, find_last_block, resolve_layer  # noqa: E402


def _not_private(model, layer=None, **kw):
    with pytest.warns(NotPrivateWarning):
        return HiddenStatePrivatizer(model, layer, noise=False, **kw)


def _capture_after(module):
    """A hook registered after the privatizer's: it sees what the privatizer returned."""
    seen = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o))
    return seen, handle


def test_find_last_block_by_name(tiny_gpt2, tiny_llama):
    assert find_last_block(tiny_gpt2)[0] == "transformer.h.1"
    assert find_last_block(tiny_gpt2)[1] is tiny_gpt2.transformer.h[-1]
    assert find_last_block(tiny_llama)[0] == "model.layers.1"
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=50
    )
    neox = transformers.GPTNeoXForCausalLM(config)
    assert find_last_block(neox)[1] is neox.gpt_neox.layers[-1]


def test_resolve_layer_forms(tiny_llama):
    assert resolve_layer(tiny_llama, 0) == ("model.layers.0", tiny_llama.model.layers[0])
    assert resolve_layer(tiny_llama, -1)[1] is tiny_llama.model.layers[1]
    assert resolve_layer(tiny_llama, "model.norm")[1] is tiny_llama.model.norm
    assert resolve_layer(tiny_llama, tiny_llama.model.layers[0])[0] == "model.layers.0"
    with pytest.raises(LookupError):
        resolve_layer(tiny_llama, 7)
    with pytest.raises(LookupError):
        resolve_layer(tiny_llama, "model.nope")
    with pytest.raises(LookupError):
        resolve_layer(tiny_llama, nn.Linear(2, 2))
    with pytest.raises(LookupError, match="layer="):
        resolve_layer(nn.Sequential(nn.Linear(4, 4)), None)


@pytest.mark.parametrize("model_name", ["tiny_gpt2", "tiny_llama"])
def test_hook_placed_on_last_block_and_removed(model_name, prompt, request):
    model = request.getfixturevalue(model_name)
    block = find_last_block(model)[1]
    with torch.no_grad():
        clean = model(prompt).logits
    with _not_private(model, clip_norm=0.05) as priv:
        assert priv.attached and priv.module is block
        seen, handle = _capture_after(block)
        with torch.no_grad():
            hooked = model(prompt).logits
        handle.remove()
        out = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
        norms = torch.linalg.vector_norm(out.double(), dim=-1)
        assert norms.max().item() <= 0.05  # the rest of the model saw the clipped state
        assert priv.last_release is not None and priv.last_release.rows == prompt.numel()
    assert not priv.attached
    assert len(block._forward_hooks) == 0
    with torch.no_grad():
        after = model(prompt).logits
    assert torch.equal(after, clean)  # removal restores the clean forward pass exactly
    seen_clean, handle = _capture_after(block)
    with torch.no_grad():
        model(prompt)
    handle.remove()
    clean_out = seen_clean[0][0] if isinstance(seen_clean[0], tuple) else seen_clean[0]
    assert torch.linalg.vector_norm(clean_out.double(), dim=-1).min().item() > 0.05  # it did clip
    assert not torch.equal(hooked, clean)
    priv.remove()  # idempotent


class _TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), {"aux": 1}


class _TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_TupleBlock(), _TupleBlock()])

    def forward(self, x):
        extras = []
        for block in self.blocks:
            x, extra = block(x)
            extras.append(extra)
        return x, extras


def test_tuple_outputs_keep_their_other_elements():
    torch.manual_seed(1)
    model = _TupleModel()
    x = torch.randn(3, 5, 8) * 10
    with _not_private(model, clip_norm=1.0) as priv:
        assert priv.layer_path == "blocks.1"
        out, extras = model(x)
    assert extras == [{"aux": 1}, {"aux": 1}]
    assert torch.linalg.vector_norm(out.double(), dim=-1).max().item() <= 1.0


def test_mapping_output_and_plain_module_path():
    class WithMapping(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)

        def forward(self, x):
            return {"last_hidden_state": self.enc(x) * 100, "other": 3}

    model = nn.Sequential()
    model.add_module("inner", WithMapping())
    with _not_private(model, "inner", clip_norm=2.0):
        out = model(torch.randn(2, 4))
    assert out["other"] == 3
    assert torch.linalg.vector_norm(out["last_hidden_state"].double(), dim=-1).max().item() <= 2.0


def test_bad_output_type_refused():
    class Weird(nn.Module):
        def forward(self, x):
            return "not a tensor"

    w = Weird()
    with _not_private(None, w, clip_norm=1.0), pytest.raises(TypeError, match="hooked layer returned"):
        w(torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_bound_per_token(dtype):
    torch.manual_seed(2)
    lin = nn.Linear(16, 16).to(dtype)
    x = torch.randn(4, 7, 16, dtype=dtype) * torch.logspace(-3, 3, 7, dtype=dtype)[None, :, None]
    with _not_private(None, lin, clip_norm=0.25) as priv:
        y = lin(x)
    assert y.dtype == dtype
    raw = nn.functional.linear(x, lin.weight, lin.bias)
    raw_norms = torch.linalg.vector_norm(raw.double(), dim=-1)
    norms = torch.linalg.vector_norm(y.double(), dim=-1)
    assert norms.max().item() <= 0.25
    small = raw_norms <= 0.25
    assert torch.equal(y[small], raw[small])  # rows inside the ball are untouched
    # rows outside keep their direction
    cos = torch.nn.functional.cosine_similarity(y[~small].double(), raw[~small].double(), dim=-1)
    assert cos.min().item() > 1 - 1e-6
    assert priv.last_release.rows == 28
    assert priv.last_release.fraction_clipped == pytest.approx(float((~small).double().mean()))


def test_clipping_bound_per_sequence():
    lin = nn.Linear(16, 16)
    x = torch.randn(3, 5, 16) * 50
    with _not_private(None, lin, clip_norm=1.0, per="sequence") as priv:
        y = lin(x)
    assert priv.last_release.rows == 3 and priv.last_release.dim == 5 * 16
    seq_norms = torch.linalg.vector_norm(y.double().reshape(3, -1), dim=-1)
    assert seq_norms.max().item() <= 1.0


def test_non_finite_hidden_state_refused_and_nothing_released():
    lin = nn.Linear(4, 4)
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0]])
    with _not_private(None, lin, clip_norm=1.0) as priv, pytest.raises(UnsafeInput):
        lin(x)
    assert priv.last_release is None


def test_parameter_validation(tiny_gpt2):
    with pytest.raises(InvalidParameter, match="either sigma"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=1.0, epsilon=1.0, delta=1e-5)
    with pytest.raises(InvalidParameter, match="either sigma"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0)
    with pytest.raises(InvalidParameter, match="sigma"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=0.0)
    # a noise multiplier outside what the accountants certify is refused before any release
    with pytest.raises(InvalidParameter, match=r"sigma=1e-05.*clip_norm=1\.0"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=1e-5)
    with pytest.raises(InvalidParameter, match=r"sigma=10000000000000\.0"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=1e13)  # above 2e12
    HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=2e-4)  # the smallest accepted (sensitivity 2)
    with pytest.raises(InvalidParameter, match="delta"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, epsilon=1.0)
    with pytest.raises(InvalidParameter, match="clip_norm"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=-1.0, sigma=1.0)
    with pytest.raises(InvalidParameter, match="per"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, sigma=1.0, per="word")
    with pytest.raises(InvalidParameter, match="ledger"):
        HiddenStatePrivatizer(tiny_gpt2, clip_norm=1.0, noise=False, ledger=object())
    # nothing was left attached by the failed constructions
    assert all(len(m._forward_hooks) == 0 for m in tiny_gpt2.modules())


def test_calibration_follows_the_stated_relation():
    replace = HiddenStatePrivatizer(None, nn.Linear(2, 2), clip_norm=1.0, epsilon=1.0, delta=1e-5)
    assert replace.sensitivity == 2.0
    assert replace.sigma == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=2.0))
    assert replace.noise_multiplier == pytest.approx(replace.sigma / 2.0)
    assert replace.epsilon_per_row <= 1.0 + 1e-9
    addrm = HiddenStatePrivatizer(
        None, nn.Linear(2, 2), clip_norm=1.0, sigma=4.8448, delta=1e-5, neighbouring="add_remove"
    )
    # document 000's sigma at Delta_f = C = 1 really buys epsilon 0.751 per row (not 1.0) ...
    assert addrm.epsilon_per_row == pytest.approx(epsilon_for(sigma=4.8448, delta=1e-5), rel=1e-9)
    # ... and under replace-one (any two hidden states) the same sigma buys more than 1.0.
    doc_replace = HiddenStatePrivatizer(None, nn.Linear(2, 2), clip_norm=1.0, sigma=4.8448, delta=1e-5)
    assert doc_replace.epsilon_per_row > 1.0


def test_noise_level_matches_sigma():
    # 20000 noise coordinates on a zero hidden state: the sample variance / sigma^2 is
    # chi2(n)/n; a two-sided 1e-6 false-alarm band is about +-5 sd = +-5*sqrt(2/n) = +-5%.
    lin = nn.Linear(100, 100)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)
    with pytest.warns(NotPrivateWarning):
        priv = HiddenStatePrivatizer(None, lin, clip_norm=1.0, sigma=3.0, seed=11)
    assert not priv.private
    with priv:
        y = lin(torch.zeros(200, 100))
    var = y.double().var(unbiased=False).item()
    assert abs(var / 9.0 - 1.0) < 5 * math.sqrt(2 / y.numel())
    assert abs(y.double().mean().item()) < 5 * 3.0 / math.sqrt(y.numel())
    assert priv.last_release.mean_noise_norm == pytest.approx(3.0 * math.sqrt(100), rel=0.02)


def test_secure_noise_is_fresh_each_call():
    lin = nn.Linear(10, 10)
    priv = HiddenStatePrivatizer(None, lin, clip_norm=1.0, sigma=1.0)
    assert priv.private
    x = torch.zeros(1, 10)
    with priv:
        a, b = lin(x), lin(x)
    assert not torch.equal(a, b)
    assert np.isfinite(a.detach().numpy()).all()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    dim=st.integers(1, 40),
    log_scale=st.floats(-20, 20),
    clip=st.floats(1e-3, 1e3),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_clipping_never_exceeds_the_bound_nor_grows_a_row(rows, dim, log_scale, clip, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    h = (torch.randn(rows, dim, generator=g, dtype=torch.float64) * 10.0**log_scale).to(dt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        priv = HiddenStatePrivatizer(None, nn.Identity(), clip_norm=clip, noise=False)
    out = priv.privatize(h)
    assert out.dtype == dt and out.shape == h.shape
    before = torch.linalg.vector_norm(h.double(), dim=-1)
    after = torch.linalg.vector_norm(out.double(), dim=-1)
    assert (after <= clip).all()
    assert (after <= before).all()
