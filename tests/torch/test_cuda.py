"""The torch engine on a CUDA device: host-drawn noise added on the device, clipped sums and steps.

Skipped where torch sees no CUDA device (CI has none). The references are computed on the host in
float64 by the per-example loop of test_torch_per_sample.py; statistical checks use 5-standard-error
bounds (false alarm about 6e-7 each).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest

torch = pytest.importorskip("torch")
from test_torch_per_sample import brute_force  # noqa: E402  (tests/torch is on sys.path under pytest)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from gaussdp import accounting  # noqa: E402
from gaussdp.errors import InvalidParameter, NotPrivateWarning  # noqa: E402
from gaussdp.noise import noise_source  # noqa: E402
from gaussdp.torch import PrivacyEngine  # noqa: E402
from gaussdp.torch._random import (  # noqa: E402
    _CHUNK,
    KeystreamNormal,
    add_standard_normal_,
    keystream_normal_available,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SOURCES = ["keystream", "generator", "secure"]
FLOAT32 = pytest.param(torch.float32, id="float32")
FLOAT64 = pytest.param(torch.float64, id="float64")


def _source(kind):
    """One of the engine's noise sources: the AES-CTR keystream, a torch.Generator, the CSPRNG."""
    if kind == "keystream":
        if not keystream_normal_available():
            pytest.skip("gaussdp._gauss or cryptography missing")
        return KeystreamNormal()
    if kind == "generator":
        return torch.Generator().manual_seed(0)
    return noise_source("secure")


# ------------------------------------------------------------------------ add_standard_normal_
@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64])
@pytest.mark.parametrize("kind", SOURCES)
def test_noise_added_in_place_on_the_device(kind, dtype):
    """dst += std N(0, 1) on a CUDA tensor of 1001 x 999 values (odd count, 16 host chunks): same
    tensor, device, shape and dtype; the added values have mean 0 and std ``std`` (5 SE each), and
    the first two chunks are not one draw repeated (correlation within 5 SE of 0)."""
    std, base = 0.37, 2.5
    dst = torch.full((1001, 999), base, dtype=dtype, device="cuda")
    ptr = dst.data_ptr()
    out = add_standard_normal_(_source(kind), dst, std)
    assert out is dst and dst.data_ptr() == ptr
    assert dst.device.type == "cuda" and dst.dtype == dtype and dst.shape == (1001, 999)
    z = (dst.double() - base).reshape(-1)
    n = z.numel()
    assert bool(torch.isfinite(z).all())
    assert abs(float(z.mean())) < 5 * std / math.sqrt(n)
    assert abs(float(z.std()) / std - 1) < 5 / math.sqrt(2 * n)
    first, second = z[:_CHUNK], z[_CHUNK : 2 * _CHUNK]
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 5 / math.sqrt(_CHUNK)


@pytest.mark.parametrize("std", [math.nan, math.inf, -math.inf, -1.0])
@pytest.mark.parametrize("kind", SOURCES)
def test_bad_std_refused_on_the_device(kind, std):
    dst = torch.ones(7, dtype=torch.float32, device="cuda")
    with pytest.raises(InvalidParameter, match="finite and >= 0"):
        add_standard_normal_(_source(kind), dst, std)
    assert bool((dst == 1).all())
    add_standard_normal_(_source(kind), dst, 0.0)  # zero noise: nothing changes
    assert bool((dst == 1).all())


# ---------------------------------------------------------------------------------- the engine
class _Tokens(nn.Module):
    """Token (with padding) and position embeddings, a two-layer nn.TransformerEncoder (batch_first,
    padded keys masked), a linear head on the mean over positions."""

    def __init__(self, vocab=23, d=16, heads=4, t=6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(t, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        h = self.encoder(self.tok(idx) + self.pos(pos), src_key_padding_mask=idx == 0)
        return self.head(h.mean(1))


def _mlp_case(d_in=10, hidden=32, d_out=4, n=32):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    return model.double(), TensorDataset(torch.randn(n, d_in, generator=g, dtype=torch.float64))


def _tokens_case(n=32, t=6, vocab=23):
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    idx = torch.randint(1, vocab, (n, t), generator=g)
    idx[::3, -2:] = 0  # padded tails (every sample keeps real tokens)
    idx[1::4, 0] = idx[1::4, 1]  # repeated tokens within a sample
    return _Tokens(vocab=vocab, t=t).double(), TensorDataset(idx)


CASES = {"mlp": _mlp_case, "transformer": _tokens_case}


def _reference(model, dataset, batch):
    """Host float64 per-example loop on the first batch: (clip, clipped sums, loss weight), with the
    clip bound at the median per-sample norm, so that some samples are clipped and some are not."""
    (x,) = dataset[:batch]
    torch.manual_seed(3)
    with torch.no_grad():
        weight = torch.randn(model(x[:1]).shape[1:], dtype=torch.float64)
    norms, _ = brute_force(model, [x], weight, 1.0)
    clip = float(norms.median())
    assert 0 < float((norms > clip).double().mean()) < 1
    _, sums = brute_force(model, [x], weight, clip)
    return clip, sums, weight


def _private_step(model, dataset, batch, weight, *, clip, sigma, device, dtype, noise="fast", seed=None):
    """``model`` (a copy, moved to ``device``/``dtype``) made private with poisson_sampling=False and
    SGD(lr=1), then one step on the first batch with loss ``sum(out * weight) / batch``.

    Returns the engine, the optimizer, the clipped sums before the step (``summed_grads``, host
    float64) and the update ``before - after`` (host float64).
    """
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    engine = PrivacyEngine(noise=noise, seed=seed)
    not_private = sigma == 0 or seed is not None
    with pytest.warns(NotPrivateWarning) if not_private else contextlib.nullcontext():
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(dataset, batch_size=batch),
            noise_multiplier=sigma,
            max_grad_norm=clip,
            poisson_sampling=False,
        )
    (x,) = next(iter(loader))
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    before = [p.detach().clone() for p in model.parameters()]
    ((model(x) * weight.to(device=device, dtype=dtype)).sum() / len(x)).backward()
    summed = opt.summed_grads
    sums = [summed[p].double().cpu() for p in model.parameters()]
    opt.step()
    assert all(p.device.type == device and p.dtype == dtype for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())  # left set, as in Opacus
    update = [(b - p.detach()).double().cpu() for b, p in zip(before, model.parameters(), strict=True)]
    return engine, opt, sums, update


@pytest.mark.parametrize("dtype", [FLOAT64, FLOAT32])
@pytest.mark.parametrize("case", ["mlp", "transformer", "transformer_recomputed"])
def test_clipped_sums_on_cuda_match_the_host(case, dtype, monkeypatch):
    """noise_multiplier=0: the clipped sums formed on CUDA equal the host float64 per-example loop
    (and, in float64, the engine's own sums on the host); the step moves each parameter by its sum
    over the batch size. ``transformer_recomputed`` turns off the captured attention path."""
    if case == "transformer_recomputed":
        import gaussdp.torch._clipper as clipper_module

        monkeypatch.setattr(clipper_module, "mha_capture", lambda *a: None)
    model, dataset = CASES[case.split("_")[0]]()
    batch = 16
    clip, ref, weight = _reference(model, dataset, batch)
    engine, opt, sums, update = _private_step(
        model, dataset, batch, weight, clip=clip, sigma=0.0, device="cuda", dtype=dtype
    )
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for s, r in zip(sums, ref, strict=True):
        torch.testing.assert_close(s, r, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(r.abs().max())))
    if dtype == torch.float64:
        _, _, host, _ = _private_step(
            model, dataset, batch, weight, clip=clip, sigma=0.0, device="cpu", dtype=dtype
        )
        for s, h in zip(sums, host, strict=True):
            torch.testing.assert_close(s, h, rtol=1e-10, atol=1e-12)
    step_tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for u, s in zip(update, sums, strict=True):
        torch.testing.assert_close(u, s / opt.expected_batch_size, **step_tol)
    assert opt.expected_batch_size == batch
    assert engine.steps == 1 and engine.get_epsilon(1e-5) == math.inf


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64])
@pytest.mark.parametrize("noise", ["fast", "secure", "seeded"])
def test_noisy_step_on_cuda(noise, dtype):
    """noise_multiplier=1 on CUDA: the parameters move, epsilon is the accountant's for one
    subsampled Gaussian step (finite, positive), and the update minus the clipped average is
    N(0, (sigma C / B)^2) per coordinate (std and mean within 5 SE, ~34k coordinates)."""
    sigma, batch = 1.0, 16
    model, dataset = _mlp_case(d_in=64, hidden=256, d_out=64, n=48)
    clip, ref, weight = _reference(model, dataset, batch)
    engine, _, _, update = _private_step(
        model,
        dataset,
        batch,
        weight,
        clip=clip,
        sigma=sigma,
        device="cuda",
        dtype=dtype,
        noise="fast" if noise == "seeded" else noise,
        seed=7 if noise == "seeded" else None,
    )
    want = {"fast": "AES-128-CTR" if keystream_normal_available() else "Mersenne", "secure": "secure"}
    assert want.get(noise, "Mersenne") in engine.noise_stream
    assert all(float(u.abs().max()) > 0 for u in update)
    eps = engine.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps > 0
    expected_eps = accounting.accountant("pld").compose(
        accounting.SubsampledGaussianEvent(sigma, 1.0 / math.ceil(len(dataset) / batch))
    )
    assert eps == pytest.approx(expected_eps.epsilon(1e-5), rel=1e-9)
    noise_values = torch.cat([(u - r / batch).reshape(-1) for u, r in zip(update, ref, strict=True)])
    n = noise_values.numel()
    expected = sigma * clip / batch
    assert abs(float(noise_values.std()) / expected - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(noise_values.mean())) < 5 * expected / math.sqrt(n)
