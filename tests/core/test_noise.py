"""Noise sources: distribution (KS, stated false-alarm rate), float-safe grid, dtypes, bad input."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy import stats

from gaussdp import InvalidParameter, NotPrivateWarning, UnsafeInput, noise_source
from gaussdp.noise import GRID_SLACK, add_gaussian, add_gaussian_rows, gaussian_like, grid_spacing

# Every statistical test below rejects at p < 1e-6: a correct sampler fails it with probability
# at most 1e-6 per run (the unseeded ones are random; the seeded ones are deterministic).
ALPHA = 1e-6
N = 200_000


def seeded(seed: int):
    with pytest.warns(NotPrivateWarning):
        return noise_source(seed=seed)


@pytest.mark.parametrize("kind", ["secure", "fast", "seeded"])
def test_standard_normal_ks(kind):
    src = seeded(1) if kind == "seeded" else noise_source(kind)
    z = src.standard_normal(N)
    assert stats.kstest(z, "norm").pvalue > ALPHA
    # Tails: chi-square of the counts in 12 bins cut at standard normal quantiles.
    edges = stats.norm.ppf(np.linspace(0, 1, 13))
    counts = np.histogram(z, bins=edges)[0]
    assert stats.chisquare(counts).pvalue > ALPHA


@pytest.mark.parametrize("norm_bounded", [True, False])
def test_release_distribution_and_grid(norm_bounded):
    sigma, x0 = 2.5, 0.3
    src = noise_source()
    x = np.full(N, x0 / math.sqrt(N)) if norm_bounded else np.full(N, x0)
    out = add_gaussian(x, sigma, sensitivity=1.0, source=src, norm_bounded=norm_bounded)
    assert out.dtype == np.float64 and out.shape == x.shape
    assert stats.kstest((out - x) / sigma, "norm").pvalue > ALPHA
    # Float safety: every output is an integer multiple of the power-of-two grid spacing g.
    g = grid_spacing(sigma, sensitivity=1.0, size=N, norm_bounded=norm_bounded)
    assert math.log2(g) == int(math.log2(g))
    k = out / g
    assert np.all(k == np.round(k))
    if not norm_bounded:
        assert g * math.sqrt(N) <= GRID_SLACK * 1.0


def test_outputs_do_not_depend_on_low_bits_of_input():
    # Two inputs in the same grid cell give identically distributed outputs: with one seed, equal.
    sigma = 1.0
    g = grid_spacing(sigma, sensitivity=1.0, size=3, norm_bounded=True)
    a = g * np.array([1000.125, -2000.125, 3000.125])
    b = a + g * 0.5 * np.sign(a)  # same trunc(x / g), different low-order bits
    out_a = add_gaussian(a, sigma, sensitivity=1.0, source=seeded(5), norm_bounded=True)
    out_b = add_gaussian(b, sigma, sensitivity=1.0, source=seeded(5), norm_bounded=True)
    np.testing.assert_array_equal(out_a, out_b)


def test_norm_bounded_rounding_keeps_sensitivity():
    # out(x) - out(0) under the same seed is the rounded input g * n: its norm stays <= C.
    rng = np.random.default_rng(3)
    for dim in (1, 7, 1000):
        x = rng.standard_normal(dim)
        x *= 0.999 / np.linalg.norm(x)
        out_x = add_gaussian(x, 0.5, sensitivity=1.0, source=seeded(9), norm_bounded=True)
        out_0 = add_gaussian(np.zeros(dim), 0.5, sensitivity=1.0, source=seeded(9), norm_bounded=True)
        n = out_x - out_0
        assert math.fsum(v * v for v in n) <= 1.0
        np.testing.assert_allclose(n, x, atol=2 * 0.5 * 2.0**-20)


def test_record_on_the_boundary_is_shrunk_not_released_as_is():
    # x = [1.0] with C = 1: trunc(x / g) sits exactly on the bound, inside the 2**-30 margin, so
    # the pass is redone with a smaller factor and fresh noise (the second draw of the source).
    out_x = add_gaussian(np.array([1.0]), 0.5, sensitivity=1.0, source=seeded(9), norm_bounded=True)
    src = seeded(9)
    first = add_gaussian(np.zeros(1), 0.5, sensitivity=1.0, source=src, norm_bounded=True)
    second = add_gaussian(np.zeros(1), 0.5, sensitivity=1.0, source=src, norm_bounded=True)
    n = out_x - second
    assert 0.999 < n[0] < 1.0
    assert out_x[0] - first[0] != n[0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("kind", ["secure", "fast"])
def test_dtype_kept(dtype, kind):
    x = np.zeros((40, 5), dtype=dtype)
    out = add_gaussian(x, 1.0, sensitivity=1.0, source=noise_source(kind))
    assert out.dtype == dtype and out.shape == x.shape
    assert gaussian_like(x, 1.0).dtype == dtype
    rows = add_gaussian_rows(x, 1.0, sensitivity=1.0, source=noise_source(kind))
    assert rows.dtype == dtype and rows.shape == x.shape


def test_integers_become_float64():
    out = add_gaussian(np.arange(5), 1.0, sensitivity=1.0)
    assert out.dtype == np.float64


def test_torch_backend():
    torch = pytest.importorskip("torch")
    for kind in ("secure", "fast"):
        x = torch.zeros(1000, dtype=torch.float32)
        out = add_gaussian(x, 2.0, sensitivity=1.0, source=noise_source(kind))
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        assert 1.8 < float(out.std()) < 2.2  # 1000 samples: sd of the estimate is about 0.045
    assert gaussian_like(torch.zeros(3, dtype=torch.float64), 1.0).dtype == torch.float64
    with pytest.raises(UnsafeInput, match="NaN"):
        add_gaussian(torch.tensor([float("nan")]), 1.0, sensitivity=1.0)
    with pytest.raises(TypeError, match="floating"):
        add_gaussian(torch.tensor([1, 2]), 1.0, sensitivity=1.0)


def test_seeded_is_reproducible_and_not_private():
    a, b = seeded(42), seeded(42)
    assert not a.private and a.float_safe
    np.testing.assert_array_equal(a.standard_normal(100), b.standard_normal(100))


def test_secure_sources_are_independent_and_private():
    a, b = noise_source(), noise_source()
    assert a.private and a.float_safe and a.name == "secure"
    assert not np.array_equal(a.words(8), b.words(8))
    fast = noise_source("fast")
    assert fast.private and not fast.float_safe


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_secure_source_rekeys_after_fork():
    src = noise_source()
    src.words(4)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.write(w, src.words(4).tobytes())
        os._exit(0)
    os.close(w)
    child = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert child != src.words(4).tobytes()


@pytest.mark.parametrize(
    ("x", "exc", "word"),
    [
        (np.array([1.0, np.nan]), UnsafeInput, "NaN"),
        (np.array([np.inf], dtype=np.float32), UnsafeInput, "NaN"),
        (np.array([]), UnsafeInput, "empty"),
        (np.array([True]), TypeError, "bool"),
        (np.array([1j]), TypeError, "complex"),
        (np.array([1e300]), UnsafeInput, "too large"),
    ],
)
def test_add_gaussian_bad_input(x, exc, word):
    with pytest.raises(exc, match=word):
        add_gaussian(x, 1.0, sensitivity=1.0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        (dict(sigma=0.0, sensitivity=1.0), InvalidParameter, "sigma"),
        (dict(sigma=math.nan, sensitivity=1.0), InvalidParameter, "sigma"),
        (dict(sigma=1.0, sensitivity=-1.0), InvalidParameter, "sensitivity"),
        (dict(sigma=1.0, sensitivity=math.inf), InvalidParameter, "sensitivity"),
        (dict(sigma=True, sensitivity=1.0), TypeError, "sigma"),
    ],
)
def test_add_gaussian_bad_parameters(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        add_gaussian(np.ones(3), **kwargs)


def test_grid_refuses_what_it_cannot_account_for():
    # 1e7 values, sigma 1e9 times the sensitivity: the grid would need sigma/g > 2**40.
    with pytest.raises(InvalidParameter, match="grid"):
        grid_spacing(1e9, sensitivity=1.0, size=10_000_000, norm_bounded=False)


def test_bad_sources():
    with pytest.raises(InvalidParameter, match="noise"):
        noise_source("urandom")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        noise_source(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed"):
        noise_source(seed=True)


def test_rows_bad_input():
    with pytest.raises(UnsafeInput, match="2-D"):
        add_gaussian_rows(np.ones(3), 1.0, sensitivity=1.0)
    with pytest.raises(UnsafeInput, match="NaN"):
        add_gaussian_rows(np.array([[np.nan]]), 1.0, sensitivity=1.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_fast_release_clips_within_bound(dtype):
    # sigma = 1e-300 is zero in float32/float16 and below an ulp of these values in float64, so the
    # output is the clipped record itself: its float64 norm must not exceed C.
    from gaussdp.noise import release_clipped

    rng = np.random.default_rng(5)
    fast = noise_source("fast")
    for dim in (1, 3, 100, 70_000):
        x = (rng.standard_normal(dim) * 7).astype(dtype)
        c = float(rng.uniform(0.5, 2.0))
        out = release_clipped(x, 1e-300, clip_norm=c, source=fast)
        assert out.dtype == dtype
        assert np.linalg.norm(out.astype(np.float64)) <= c
        assert np.linalg.norm(out.astype(np.float64)) >= c * (1 - 1e-2)


def test_secure_stream_never_overflows_its_chacha20_counter():
    """The counter starts at 0 (a random one overflowed after a few GB, issue 33); re-keyed before 2^32."""
    from gaussdp import noise as noise_module

    src = noise_source("secure")
    if src.stream != "ChaCha20":
        pytest.skip("the SHAKE-256 fallback has no block counter")
    assert src._nonce[:4] == bytes(4)
    src._used = noise_module._CHACHA_MAX_BYTES - 32  # as if 256 GiB had been drawn
    key = src._key
    assert len(src.random_bytes(64)) == 64  # would need blocks past 2^32: a new key instead
    assert src._key != key and src._used == 64 and src._nonce[:4] == bytes(4)
