"""The torch engine's default noise: AES-128-CTR keystream + the compiled Box-Muller kernel.

The engine's use of it (level, fallback, seeded runs) is tested in test_torch_engine.py."""

from __future__ import annotations

import math
import multiprocessing

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cryptography")
_gauss = pytest.importorskip("gaussdp._gauss", reason="the C kernel was not built (optional)")
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: E402
from scipy import stats  # noqa: E402

import gaussdp.torch._random as _random  # noqa: E402
from gaussdp.errors import InvalidParameter  # noqa: E402
from gaussdp.torch._random import KeystreamNormal  # noqa: E402


def _box_muller_reference(words: np.ndarray, width: int) -> np.ndarray:
    """The kernel's mapping, in float64 numpy, block by block (512 pairs per block)."""
    out = np.empty(words.size)
    for lo in range(0, words.size, 1024):
        w = words[lo : lo + 1024]
        m = w.size // 2
        if width == 4:
            # as the kernel does in float32: a word near 2^32 rounds to u1 = 1, radius 0
            u1 = ((w[:m].astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)).astype(np.float64)
            u2 = (w[m:] >> 8).astype(np.float64) * 2.0**-24
        else:
            u1 = ((w[:m] >> 11).astype(np.float64) + 0.5) * 2.0**-53
            u2 = (w[m:] >> 11).astype(np.float64) * 2.0**-53
        r = np.sqrt(-2 * np.log(u1))
        out[lo : lo + m] = r * np.cos(2 * np.pi * u2)
        out[lo + m : lo + 2 * m] = r * np.sin(2 * np.pi * u2)
    return out


@pytest.mark.parametrize(
    ("words_dtype", "float_dtype", "tol"), [(np.uint32, np.float32, 2e-5), (np.uint64, np.float64, 1e-12)]
)
def test_kernel_is_the_box_muller_map_of_its_words(words_dtype, float_dtype, tol):
    """Every deviate matches the float64 reference map of the same words (odd tail block included),
    and scale multiplies them."""
    words = np.random.default_rng(1).integers(0, np.iinfo(words_dtype).max, 3000, dtype=words_dtype)
    words[:2] = [0, np.iinfo(words_dtype).max]  # extreme words: the largest radius, and u2 near 1
    expected = _box_muller_reference(words, words.itemsize)
    buf = words.copy()
    _gauss.normal_inplace(buf, words.itemsize, 2.5)
    got = buf.view(float_dtype).astype(np.float64)
    np.testing.assert_allclose(got, 2.5 * expected, rtol=tol, atol=tol)
    assert np.isfinite(got).all()


@pytest.mark.parametrize(("words_dtype", "float_dtype"), [(np.uint32, np.float32), (np.uint64, np.float64)])
@pytest.mark.parametrize("n", [1, 7, 1024, 3001])
def test_kernel_adds_the_same_deviates_to_a_destination(words_dtype, float_dtype, n):
    """normal_add(dst, words) is dst + normal_inplace(words) to the last (odd) value, up to the last
    bit (the add may be fused: one rounding instead of two); the words are left untouched."""
    rng = np.random.default_rng(n)
    words = rng.integers(0, np.iinfo(words_dtype).max, n + n % 2, dtype=words_dtype)
    dst = rng.standard_normal(n).astype(float_dtype)
    deviates = words.copy()
    _gauss.normal_inplace(deviates, words.itemsize, 0.5)
    expected = dst + deviates.view(float_dtype)[:n]
    kept = words.copy()
    _gauss.normal_add(dst, words, words.itemsize, 0.5)
    ulp = np.finfo(float_dtype).eps
    np.testing.assert_allclose(dst, expected, rtol=2 * ulp, atol=8 * ulp)
    np.testing.assert_array_equal(words, kept)


def test_kernel_refuses_odd_lengths_and_wrong_widths():
    with pytest.raises(ValueError, match="even number"):
        _gauss.normal_inplace(np.zeros(3, np.uint32), 4, 1.0)
    with pytest.raises(ValueError, match="itemsize"):
        _gauss.normal_inplace(np.zeros(4, np.uint16), 2, 1.0)
    with pytest.raises(TypeError):
        _gauss.normal_inplace(b"\0" * 8, 4, 1.0)  # read-only
    words = np.zeros(4, np.uint32)
    with pytest.raises(ValueError, match="rounded up to a pair"):
        _gauss.normal_add(np.zeros(2, np.float32), words, 4, 1.0)  # words too long for dst
    with pytest.raises(ValueError, match="rounded up to a pair"):
        _gauss.normal_add(np.zeros(5, np.float32), words, 4, 1.0)  # too short
    with pytest.raises(ValueError, match="overlap"):
        _gauss.normal_add(words.view(np.float32), words, 4, 1.0)


def test_loading_the_kernel_leaves_subnormals_alone():
    """-ffast-math is a compile flag only: linking it would pull in crtfastmath.o, which switches the
    process to flush-to-zero on load and would change every float result near the underflow."""
    assert np.float32(1e-39) / np.float32(2) != 0
    assert float(torch.tensor([1e-39], dtype=torch.float32)[0] / 2) != 0


def test_fill_is_aes_ctr_keystream_through_the_kernel(monkeypatch):
    """With the key and nonce fixed, fill_ is exactly AES-128-CTR's keystream (from counter block
    nonce || 2, as GCM produces it) mapped by the kernel, and consecutive fills continue the stream."""
    key, nonce = bytes(range(16)), bytes(range(16, 28))
    it = iter([key, nonce])
    monkeypatch.setattr(_random.secrets, "token_bytes", lambda n: next(it))
    source = KeystreamNormal()
    enc = Cipher(algorithms.AES(key), modes.CTR(nonce + (2).to_bytes(4, "big"))).encryptor()
    for dtype, width in [(torch.float32, 4), (torch.float64, 8), (torch.float32, 4)]:
        got = source.fill_(torch.empty(1000, dtype=dtype))
        expected = np.frombuffer(enc.update(bytes(1000 * width)), dtype=np.uint8).copy()
        _gauss.normal_inplace(expected, width, 1.0)
        want = torch.from_numpy(expected.view(np.float32 if width == 4 else np.float64))
        assert torch.equal(got, want)
    # fill_ in place, a chunk of 2**16 values at a time (whole blocks: the same pairing), scaled
    got = source.fill_(torch.empty(70_000), 0.5)
    expected = np.frombuffer(enc.update(bytes(4 * 70_000)), dtype=np.uint8).copy()
    _gauss.normal_inplace(expected, 4, 0.5)
    assert torch.equal(got, torch.from_numpy(expected.view(np.float32)))
    # add_ goes through the stream in chunks of 2**16 values, each rounded up to a pair of words
    n = (1 << 16) + 5
    base = torch.randn(n)
    got = source.add_(base.clone(), 0.25)
    want = base.clone().numpy()
    for lo, m in [(0, 1 << 16), (1 << 16, 6)]:
        words = np.frombuffer(enc.update(bytes(4 * m)), dtype=np.uint32)
        _gauss.normal_add(want[lo : lo + min(m, n - lo)], words, 4, 0.25)
    assert torch.equal(got, torch.from_numpy(want))  # same kernel, same words: bit for bit


def test_fresh_key_before_one_nonce_runs_out(monkeypatch):
    """A key and nonce serve at most _REKEY_BYTES of keystream (64 GiB would repeat the counter):
    the draw that would pass it first takes a fresh key and nonce from the OS CSPRNG."""
    draws = []

    def token_bytes(n):
        draws.append(n)
        return bytes([len(draws)]) * n

    monkeypatch.setattr(_random.secrets, "token_bytes", token_bytes)
    monkeypatch.setattr(_random, "_REKEY_BYTES", 3000)
    source = KeystreamNormal()
    first = source.fill_(torch.empty(500)).clone()  # 2000 bytes: one key
    assert draws == [16, 12]
    second = source.fill_(torch.empty(500))  # 2000 more would pass 3000: re-keyed first
    assert draws == [16, 12, 16, 12]
    enc = Cipher(algorithms.AES(bytes([3]) * 16), modes.CTR(bytes([4]) * 12 + (2).to_bytes(4, "big")))
    words = np.frombuffer(enc.encryptor().update(bytes(2000)), dtype=np.uint8).copy()
    _gauss.normal_inplace(words, 4, 1.0)
    assert torch.equal(second, torch.from_numpy(words.view(np.float32)))
    assert not torch.equal(first, second)


def test_fill_refuses_what_it_cannot_fill():
    source = KeystreamNormal()
    with pytest.raises(ValueError, match="even"):
        source.fill_(torch.empty(5))
    with pytest.raises(TypeError, match="float32 or float64"):
        source.fill_(torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        source.add_(torch.empty(4, 4).t(), 1.0)
    dst = torch.zeros(4)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(InvalidParameter, match="std"):
            source.add_(dst, bad)
        with pytest.raises(InvalidParameter, match="std"):
            _random.add_standard_normal_(torch.Generator(), dst, bad)
    assert torch.equal(dst, torch.zeros(4))  # nothing was added


def test_deviates_are_standard_normal():
    """200k float32 deviates from a fresh key: Kolmogorov-Smirnov against N(0, 1) at alpha 1e-6, mean
    and std within 5 standard errors (each a false alarm below 1e-6)."""
    z = KeystreamNormal().fill_(torch.empty(200_000)).double().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-6
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.std() - 1) < 5 / math.sqrt(2 * z.size)
    assert np.abs(z).max() < 6.8  # the float32 radius stops at sqrt(2 ln 2^33) = 6.76


def _child_draw(source, queue):
    queue.put(source.fill_(torch.empty(64)).numpy().tobytes())


def test_forked_child_does_not_replay_the_parents_stream():
    """A fork copies the cipher state: without re-keying, the child's next draw would equal the
    parent's."""
    source = KeystreamNormal()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_draw, args=(source, queue))
    child.start()
    child_bytes = queue.get(timeout=60)
    child.join(timeout=60)
    assert child_bytes != source.fill_(torch.empty(64)).numpy().tobytes()
