"""Where the randomness comes from, and how Gaussian noise is added without floating-point leaks.

Sources (:func:`noise_source`):

* ``"secure"`` (the default): a cryptographic keystream keyed with 32 bytes from the OS CSPRNG
  (``secrets.token_bytes``), one key per source, re-keyed after ``fork()``. The stream is ChaCha20
  (RFC 8439, via the ``cryptography`` package when it is installed) and otherwise SHAKE-256 of
  ``key || counter`` (FIPS 202, standard library ``hashlib``) -- both are vetted cryptographic
  constructions, unlike numpy's PCG64/Philox/SFC64, whose outputs can be predicted from enough
  earlier outputs. Normal deviates are made from the stream's 64-bit words by Marsaglia's polar
  method in float64. Releases through this source are floating-point safe (below).
* ``"fast"``: numpy's ``default_rng()`` (PCG64, seeded from OS entropy), ``x + sigma * Z`` computed
  in the data's dtype. Fast (bulk DP-SGD noise) but *not* floating-point safe: the low-order bits of
  ``x + sigma * Z`` depend on ``x`` (Mironov 2012) and the generator is not cryptographic.
* ``seed=<int>``: reproducible (numpy PCG64 from the seed), for tests and experiments only. Anyone
  who knows the seed can subtract the noise: ``source.private`` is ``False`` and creating one warns
  :class:`~gaussdp.errors.NotPrivateWarning`. It uses the same float-safe arithmetic as "secure".

Floating-point safety (the default release). ``x + sigma * Z`` in floating point leaks: the set of
floats it can produce depends on ``x`` (Mironov 2012), and an audit of the naive path finds epsilon
lower bounds far above the claim (Jin et al., S&P 2022; ``tests/core/test_audit.py``). gaussdp
instead releases on an integer grid of spacing ``g`` (a power of two):

1. ``n = round(x / g)`` -- exact, since ``g`` is a power of two; ``n`` is an integer vector;
2. ``K = rint(S * Z)`` with ``S = sigma / g`` and ``Z`` standard normal: integer noise, drawn
   without looking at ``x``;
3. output ``(n + K) * g`` -- integer addition and a power-of-two scaling, exact in float64 (both
   checked to stay below 2**52), then cast to the input's dtype (post-processing).

Since ``n`` is an integer, ``n + rint(S Z) = rint(n + S Z)``: the output is post-processing of the
ideal Gaussian mechanism applied to ``n * g``, so its guarantee is the exact Gaussian profile for the
L2 sensitivity of ``n * g`` -- and the output carries no low-order bits of ``x``. The rounding is what
costs privacy, and it is accounted for:

* norm-bounded releases (``GaussianMechanism.release``: the record is clipped to L2 norm ``C``):
  ``n = trunc(x * f / g)`` with the clip factor ``f = min(1, C / ||x||)`` rounds toward zero, which
  never increases a norm, and ``||n|| g <= C`` is then checked in float64 with a 2**-30 margin (the
  whole pass is redone with a smaller factor if not; nothing from a failed pass is returned). Any
  map from ``x`` into the integer ball of radius ``C / g`` has sensitivity ``C`` (add/remove of the
  record, whose absence is ``n = 0``), so there is no discretisation cost. The grid is
  ``g = 2**(floor(log2 sigma) - 20)``: the rounding error is below ``sigma * 2**-20`` per value.
* arbitrary aggregates (``add_noise``, sensitivity ``Delta`` claimed by the caller): nearest
  rounding can move two neighbouring inputs apart by up to ``g`` per coordinate, i.e. by
  ``g sqrt(d)`` in L2. ``g`` is chosen per call so that ``g sqrt(d) <= 2**-20 Delta``
  (:data:`GRID_SLACK`), and the mechanism accounts for the sensitivity ``Delta (1 + 2**-20)``
  (calibrating sigma for it). A call that cannot meet this (``sigma / g`` above 2**40) is refused.

What is *not* formally bounded: the sampler of ``Z`` is float64 arithmetic on 32-bit uniforms
(polar method), so ``K`` follows the rounded Gaussian only approximately: the deviates lie on a
fine lattice (relative spacing about 1e-9) and the tails stop at 9.4 sigma (mass below 1e-20 per
value), and ``log``/``sqrt`` round in the last bit. These errors do not
depend on ``x``: they cannot produce the input-dependent supports that Mironov's and Jin et al.'s
attacks exploit, but the reported (epsilon, delta) is that of the ideal rounded Gaussian. A fully
exact alternative is the discrete Gaussian of Canonne, Kamath & Steinke (2020) as OpenDP implements
it, three orders of magnitude slower (``benchmarks/bench_noise.py``: 0.011 M values/s for OpenDP,
about 27 M values/s here, on the same 2-core machine).

References:
    Mironov, I. (2012). On Significance of the Least Significant Bits for Differential Privacy. CCS.
    Jin, J., McMurtry, E., Rubinstein, B. & Ohrimenko, O. (2022). Are We There Yet? Timing and
    Floating-Point Attacks on Differential Privacy Systems. IEEE S&P.
    Canonne, C., Kamath, G. & Steinke, T. (2020). The Discrete Gaussian for Differential Privacy.
    Marsaglia, G. & Bray, T. A. (1964). A Convenient Method for Generating Normal Variables.
    Bernstein, D. J. (2008). ChaCha, a variant of Salsa20; RFC 8439.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import warnings
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from gaussdp._validate import check_positive
from gaussdp.clipping import _MAX_SHRINKS, shrink_factor
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput

__all__ = [
    "GRID_SLACK",
    "NoiseSource",
    "add_gaussian",
    "add_gaussian_rows",
    "gaussian_like",
    "grid_spacing",
    "noise_source",
    "release_clipped",
]

#: Relative sensitivity cost of rounding an arbitrary aggregate to the float-safe grid.
GRID_SLACK = 2.0**-20
# Values per chunk: the float64 temporaries of one chunk stay in the L2 cache (measured: 2**14 is
# about twice as fast as 2**16 here) and memory stays bounded.
_CHUNK = 1 << 14
# The fast path has fewer temporaries and numpy's generator prefers longer runs.
_FAST_CHUNK = 1 << 16
# Integers below this are exact in float64 with room for the sum n + K.
_EXACT = 2.0**51
_MAX_SCALE = 2.0**40
_LOG_2_62 = 62.0 * math.log(2.0)
_ZMAX = 10.0  # |Z| from the polar method with 32-bit uniforms stays below sqrt(124 ln 2) < 9.3

SourceKind = Literal["secure", "fast"]


class NoiseSource:
    """Base class of the noise sources. Use :func:`noise_source` to make one.

    Attributes:
        name: ``"secure"``, ``"fast"`` or ``"seeded"``.
        private: False for a seeded source (its noise can be reproduced by anyone with the seed).
        float_safe: True when releases use the exact integer-grid arithmetic.
    """

    name: str = "base"
    private: bool = True
    float_safe: bool = True

    def words(self, n: int) -> NDArray[np.uint32]:
        """``n`` independent uniform 32-bit words."""
        raise NotImplementedError

    def standard_normal(self, n: int, dtype: Any = np.float64) -> NDArray[Any]:
        """``n`` standard normal deviates (polar method on :meth:`words`), in ``dtype``."""
        out = np.empty(n, dtype=np.float64)
        self.normal_fill(out)
        return out if np.dtype(dtype) == np.float64 else out.astype(dtype)

    def normal_fill(self, out: NDArray[np.float64]) -> None:
        """Fill a float64 array with standard normal deviates (Marsaglia's polar method).

        A pair of signed 32-bit words ``(a, b)`` is the point ``(a, b) * 2**-31`` of the square
        ``[-1, 1)^2``; points with ``0 < s < 1`` (``s = (a^2 + b^2) * 2**-62``) are kept -- the
        kept region is symmetric, since ``a = -2**31`` implies ``s >= 1`` -- and give the two
        deviates ``a * sqrt(-2 ln(s) / (a^2 + b^2))`` and ``b * sqrt(...)``, the polar method with
        the 2**-31 scalings folded in.
        """
        n = out.size
        filled = 0
        while filled < n:
            need = n - filled
            pairs = int(need * 0.66) + 64  # acceptance pi/4, two deviates per accepted pair
            ab = self.words(2 * pairs).view(np.int32).astype(np.float64).reshape(2, pairs)
            r2 = ab[0] * ab[0]
            r2 += ab[1] * ab[1]
            idx = np.flatnonzero((r2 < 2.0**62) & (r2 > 0.0))
            r2 = r2[idx]
            f = np.log(r2)
            f -= _LOG_2_62  # ln s = ln(a^2 + b^2) - 62 ln 2
            f *= -2.0
            f /= r2
            np.sqrt(f, out=f)
            for row in (ab[0], ab[1]):  # 1-D takes: much faster than one 2-D fancy index
                take = min(idx.size, n - filled)
                if take <= 0:
                    break
                np.multiply(row.take(idx[:take]), f[:take], out=out[filled : filled + take])
                filled += take

    def __repr__(self) -> str:
        return f"<NoiseSource {self.name} private={self.private} float_safe={self.float_safe}>"


# Bytes one ChaCha20 key and nonce can produce: 2^32 blocks of 64 bytes (256 GiB).
_CHACHA_MAX_BYTES = (1 << 32) * 64


class _SecureSource(NoiseSource):
    name = "secure"
    private = True
    float_safe = True

    def __init__(self) -> None:
        self._rekey()

    def _rekey(self) -> None:
        self._pid = os.getpid()
        self._key = secrets.token_bytes(32)
        self._counter = 0
        self._used = 0
        self._zeros = b""
        self._chacha: Any = None
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

            # cryptography's 16-byte ChaCha20 nonce starts with the 32-bit block counter (RFC 7539
            # layout): a random one overflows after (2^32 - counter) 64-byte blocks, a few GB for an
            # unlucky draw (issue 33's Ray benchmark hit it). The key is fresh per source, so the
            # counter starts at 0 and the remaining 12 bytes stay random; random_bytes re-keys
            # before the 2^32 blocks are used up.
            self._nonce = bytes(4) + secrets.token_bytes(12)
            self._chacha = Cipher(algorithms.ChaCha20(self._key, self._nonce), mode=None).encryptor()
            self.stream = "ChaCha20"
        except ImportError:  # pragma: no cover - cryptography is usually present
            self.stream = "SHAKE-256"

    def random_bytes(self, nbytes: int) -> bytes:
        if os.getpid() != self._pid:  # a forked child must not replay the parent's stream
            self._rekey()
        if self._chacha is not None:
            if self._used + nbytes > _CHACHA_MAX_BYTES:
                self._rekey()  # a fresh key from OS entropy: an independent stream continues
            self._used += nbytes
            if len(self._zeros) < nbytes:
                self._zeros = bytes(nbytes)
            out: bytes = self._chacha.update(memoryview(self._zeros)[:nbytes])
            return out
        self._counter += 1
        block = self._key + self._counter.to_bytes(16, "little")
        return hashlib.shake_256(block).digest(nbytes)

    def words(self, n: int) -> NDArray[np.uint32]:
        return np.frombuffer(self.random_bytes(4 * n), dtype=np.uint32)


class _NumpySource(NoiseSource):
    def __init__(self, name: str, seed: int | None) -> None:
        self.name = name
        self.private = seed is None
        self.float_safe = seed is not None
        self._rng = np.random.default_rng(seed)

    def words(self, n: int) -> NDArray[np.uint32]:
        return self._rng.integers(0, 2**32, size=n, dtype=np.uint32, endpoint=False)

    def standard_normal(self, n: int, dtype: Any = np.float64) -> NDArray[Any]:
        if self.float_safe:  # seeded: same polar sampler as "secure", reproducible
            return super().standard_normal(n, dtype)
        dt = np.float32 if np.dtype(dtype) == np.float32 else np.float64
        z = self._rng.standard_normal(n, dtype=dt)
        return z if np.dtype(dtype) == dt else z.astype(dtype)

    def normal_into(self, out: NDArray[Any]) -> None:
        """Fill a float32/float64 array with N(0, 1) in place (the fast path)."""
        self._rng.standard_normal(out=out, dtype=out.dtype)


def noise_source(kind: SourceKind | NoiseSource = "secure", *, seed: int | None = None) -> NoiseSource:
    """Make a noise source: ``"secure"`` (default), ``"fast"``, or reproducible with ``seed=``.

    Args:
        kind: ``"secure"`` (CSPRNG keystream, float-safe releases) or ``"fast"`` (numpy PCG64 from OS
            entropy, not float-safe); an existing source is returned as is.
        seed: an integer makes a reproducible source that is NOT private (``.private is False``);
            it warns :class:`~gaussdp.errors.NotPrivateWarning`.

    >>> noise_source().private, noise_source("fast").float_safe
    (True, False)
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise TypeError(f"seed must be an int, got seed={seed!r}")
        warnings.warn(
            f"noise seeded with seed={seed}: results are reproducible and NOT private "
            "(anyone who knows the seed can remove the noise)",
            NotPrivateWarning,
            stacklevel=2,
        )
        return _NumpySource("seeded", int(seed))
    if isinstance(kind, NoiseSource):
        return kind
    if kind == "secure":
        return _SecureSource()
    if kind == "fast":
        return _NumpySource("fast", None)
    raise InvalidParameter(f"noise must be 'secure' or 'fast' (or seed=<int>), got noise={kind!r}")


# ------------------------------------------------------------------------------------------------
# arrays


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _float_array(name: str, x: Any) -> NDArray[Any]:
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise UnsafeInput(f"{name} is not a rectangular numeric array: {exc}") from None
    kind = arr.dtype.kind
    if kind == "b" or kind == "c":
        raise TypeError(f"{name} must be real-valued, got dtype {arr.dtype}")
    if kind in "iu":
        arr = arr.astype(np.float64)
    elif kind != "f":
        raise TypeError(f"{name} must be a real-valued numeric array, got dtype {arr.dtype}")
    if arr.size == 0:
        raise UnsafeInput(f"{name} is empty (shape {arr.shape}); nothing to release")
    return arr


def _check_finite(name: str, arr: NDArray[Any]) -> None:
    flat = arr.reshape(-1)
    for start in range(0, flat.size, _CHUNK * 16):
        if not np.isfinite(flat[start : start + _CHUNK * 16]).all():
            raise UnsafeInput(f"{name} contains NaN or Inf; nothing released")


def gaussian_like(x: Any, sigma: float, source: NoiseSource | None = None) -> Any:
    """Noise ``sigma * Z`` with the shape and dtype of ``x`` (numpy array or torch tensor).

    This is raw noise for callers that add it themselves (e.g. bulk DP-SGD with the fast source);
    ``x + gaussian_like(x, ...)`` in floating point is *not* floating-point safe. Use
    :func:`add_gaussian` (or :class:`~gaussdp.mechanism.GaussianMechanism`) for releases.
    """
    sigma = check_positive("sigma", sigma)
    src = source if source is not None else noise_source()
    if _is_torch(x):
        import torch

        z = src.standard_normal(int(x.numel()), np.float64) * sigma
        return torch.from_numpy(z.reshape(tuple(x.shape))).to(dtype=x.dtype, device=x.device)
    arr = _float_array("x", x)
    return (src.standard_normal(arr.size, np.float64) * sigma).astype(arr.dtype).reshape(arr.shape)


def grid_spacing(sigma: float, *, sensitivity: float, size: int, norm_bounded: bool) -> float:
    """The power-of-two grid of a float-safe release (see the module docstring)."""
    g = 2.0 ** (math.floor(math.log2(sigma)) - 20)
    if not norm_bounded:
        g = min(g, 2.0 ** math.floor(math.log2(GRID_SLACK * sensitivity / math.sqrt(size))))
    if sigma / g > _MAX_SCALE:
        raise InvalidParameter(
            f"a float-safe release of {size} values with sigma={sigma:g} and sensitivity="
            f"{sensitivity:g} would need a grid finer than sigma * 2**-40; release a norm-bounded "
            "record (GaussianMechanism.release), fewer values per call, or use noise='fast'"
        )
    if g < 2.0**-1000:
        raise InvalidParameter(f"sigma={sigma:g} is too small for the float-safe grid")
    return g


def add_gaussian(
    x: Any,
    sigma: float,
    *,
    sensitivity: float,
    source: NoiseSource | None = None,
    norm_bounded: bool = False,
) -> Any:
    """Return ``x`` plus N(0, sigma^2) noise per value: float-safe unless the source is "fast".

    Args:
        x: real array (any shape; float dtypes kept, integers become float64) or torch tensor.
        sigma: noise standard deviation, > 0.
        sensitivity: L2 sensitivity of ``x`` (sets the grid of a float-safe release).
        source: a :class:`NoiseSource`; a new ``"secure"`` one when omitted.
        norm_bounded: True when ``x`` itself has L2 norm <= ``sensitivity`` (a clipped record):
            rounds toward zero so that the sensitivity has no discretisation cost (the norm is
            re-checked on the grid; a record over the bound is shrunk, never released as is).

    Returns:
        The noisy values, same shape and dtype (a tensor on the same device for a tensor).

    Raises:
        UnsafeInput: NaN/Inf or empty input, values too large for the exact grid arithmetic.
        InvalidParameter: bad sigma or sensitivity.
    """
    sigma = check_positive("sigma", sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    src = source if source is not None else noise_source()
    if norm_bounded:
        # Clipped (or re-checked) to the bound on every path, torch and "fast" included.
        return release_clipped(x, sigma, clip_norm=sensitivity, source=src)
    if _is_torch(x):
        return _add_gaussian_torch(x, sigma, sensitivity, src, False)
    arr = _float_array("x", x)
    if not src.float_safe:
        _check_finite("x", arr)
        return _fast_loop(arr, sigma, 1.0, None, src)
    return _grid_loop(arr, sigma, sensitivity, src, None)


def release_clipped(x: Any, sigma: float, *, clip_norm: float, source: NoiseSource) -> Any:
    """Clip ``x`` to L2 norm ``clip_norm`` and add the noise, in one pass over the data.

    This is :meth:`gaussdp.mechanism.GaussianMechanism.release`. The norm is computed first
    (NaN/Inf refused before any noise is drawn); the scaling, the rounding to the grid, the
    re-check of the norm and the noise are then fused chunk by chunk. If the re-check fails (an
    ulp over the bound) the whole pass is redone with a smaller factor; nothing from the first
    pass is returned.
    """
    from gaussdp.clipping import clip_l2, l2_norm

    sigma = check_positive("sigma", sigma)
    clip_norm = check_positive("clip_norm", clip_norm)
    if _is_torch(x):
        clipped, _ = clip_l2(x, clip_norm)
        return _add_gaussian_torch(clipped, sigma, clip_norm, source, True)
    arr = _float_array("x", x)
    norm = l2_norm("x", arr)
    factor = 1.0 if norm <= clip_norm else clip_norm / norm
    if not source.float_safe:
        small = arr.size <= 2**30 and clip_norm > 2.0**-100
        if factor < 1.0 and small and arr.dtype in (np.float32, np.float64):
            # Each product x_i * f rounds with relative error <= 2**-24 (float32; absolute 2**-149
            # if subnormal) and a float64 norm of d <= 2**30 values errs by far less than 2**-20
            # relative: with the factor lowered by 2**-20 the clipped norm stays <= C, no re-check.
            return _fast_loop(arr, sigma, factor * (1.0 - 2.0**-20), None, source)
        return _fast_loop(arr, sigma, factor, clip_norm if factor < 1.0 else None, source)
    return _grid_loop(arr, sigma, clip_norm, source, factor)


def _fast_loop(
    arr: NDArray[Any], sigma: float, factor: float, clip_norm: float | None, src: NoiseSource
) -> NDArray[Any]:
    """``x * factor + sigma * Z`` in the data's float dtype (numpy generator; not float-safe).

    With ``clip_norm``, the float64 norm of ``x * factor`` (in the data's dtype) is checked to
    stay at most ``clip_norm`` and the factor shrunk by a few ulps until it does.
    """
    if not isinstance(src, _NumpySource):
        raise TypeError(f"the numpy path needs a numpy noise source, got {type(src).__name__}")
    work = np.float32 if arr.dtype == np.float32 else np.float64
    flat = arr.reshape(-1)
    out = np.empty(flat.size, dtype=arr.dtype)
    buf: NDArray[Any] = np.empty(min(_FAST_CHUNK, flat.size), dtype=work)
    for attempt in range(_MAX_SHRINKS + 1):
        if attempt == _MAX_SHRINKS:
            factor = 0.0  # subnormal rounding kept overshooting: release the zero vector
        f = arr.dtype.type(factor)
        sq = 0.0
        for start in range(0, flat.size, _FAST_CHUNK):
            chunk = flat[start : start + _FAST_CHUNK]
            m = chunk.size
            z = out[start : start + m] if out.dtype == work else buf[:m]
            src.normal_into(z)
            z *= work(sigma)
            if factor != 1.0:
                scaled = chunk * f
                if clip_norm is not None:
                    sq += float(np.einsum("i,i->", scaled, scaled, dtype=np.float64))
                z += scaled
            else:
                z += chunk
            if z.base is not out and z is not out:
                out[start : start + m] = z
        if clip_norm is None or math.sqrt(sq) <= clip_norm:
            return out.reshape(arr.shape)
        factor = shrink_factor(factor, clip_norm, math.sqrt(sq), float(np.finfo(arr.dtype).eps))
    raise AssertionError("unreachable")  # pragma: no cover


def _grid_loop(
    arr: NDArray[Any], sigma: float, sensitivity: float, src: NoiseSource, factor: float | None
) -> NDArray[Any]:
    """The float-safe release: ``(n + rint(S Z)) * g`` with ``n`` the input on the grid.

    ``factor is None``: an arbitrary aggregate, ``n = rint(x / g)`` (exact: g is a power of two).
    Otherwise a record clipped by ``factor``: ``n = trunc(x * factor / g)``, whose norm is checked
    against ``sensitivity / g`` (float64, with a 2**-30 margin) before anything is returned.
    """
    flat = arr.reshape(-1)
    bounded = factor is not None
    g = grid_spacing(sigma, sensitivity=sensitivity, size=flat.size, norm_bounded=bounded)
    scale, inv_g = sigma / g, 1.0 / g
    if bounded and 2.0 * sensitivity * inv_g >= _EXACT:
        raise InvalidParameter(f"sensitivity / sigma = {sensitivity / sigma:g} is too large for the grid")
    bound = (sensitivity * inv_g) ** 2 * (1.0 - 2.0**-30)
    out = np.empty(flat.size, dtype=arr.dtype)
    m0 = min(_CHUNK, flat.size)
    n_buf = np.empty(m0, dtype=np.float64)
    k_buf = np.empty(m0, dtype=np.float64)
    mult = inv_g * (factor if factor is not None else 1.0)
    while True:
        sq = 0.0
        for start in range(0, flat.size, _CHUNK):
            chunk = flat[start : start + _CHUNK]
            m = chunk.size
            n, k = n_buf[:m], k_buf[:m]
            np.multiply(chunk, mult, out=n, dtype=np.float64)  # float64 even for float32 x (NEP 50)
            if bounded:
                np.trunc(n, out=n)
                sq += float(np.dot(n, n))
            else:
                np.rint(n, out=n)
                # Also refuses NaN/Inf (comparisons with NaN are False) before noise is drawn.
                if not (-_EXACT < n.min() and n.max() < _EXACT):
                    if not np.isfinite(chunk).all():
                        raise UnsafeInput("x contains NaN or Inf; nothing released")
                    raise UnsafeInput(
                        f"x has values too large for the float-safe grid (|x| / g >= 2**51, "
                        f"g={g:g}); rescale the data or use noise='fast'"
                    )
            src.normal_fill(k)
            k *= scale
            np.rint(k, out=k)
            n += k  # integers below 2**52: exact
            n *= g  # a power of two: exact
            out[start : start + m] = n  # the cast to the input's dtype is post-processing
        if not bounded or sq <= bound:
            return out.reshape(arr.shape)
        # An ulp over the bound after rounding: shrink and redo; nothing above is returned.
        mult *= math.sqrt(bound / sq) * (1.0 - 2.0**-30)


def _add_gaussian_torch(
    x: Any, sigma: float, sensitivity: float, src: NoiseSource, norm_bounded: bool
) -> Any:
    import torch

    if x.dtype == torch.bool or x.is_complex() or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise UnsafeInput(f"x is empty (shape {tuple(x.shape)}); nothing to release")
    if not bool(torch.isfinite(x).all()):
        raise UnsafeInput("x contains NaN or Inf; nothing released")
    if not src.float_safe:
        gen = torch.Generator(device=x.device)
        gen.manual_seed(secrets.randbits(63))
        noise = torch.randn(x.shape, generator=gen, dtype=x.dtype, device=x.device)
        return x.detach() + sigma * noise
    host = x.detach().to("cpu")
    as_np = host.numpy() if host.dtype != torch.bfloat16 else host.float().numpy()
    out = _grid_loop(as_np, sigma, sensitivity, src, 1.0 if norm_bounded else None)
    return torch.from_numpy(out).to(dtype=x.dtype, device=x.device)


def add_gaussian_rows(X: Any, sigma: float, *, sensitivity: float, source: NoiseSource | None = None) -> Any:
    """Noise every row of a 2-D array whose rows each have L2 norm <= ``sensitivity``.

    Each row is one norm-bounded release (as :func:`add_gaussian` with ``norm_bounded=True``), done
    in row blocks; the caller clips the rows first (:func:`gaussdp.clipping.clip_rows`).

    The result has ``X``'s dtype (a tensor on ``X``'s device for a tensor). bfloat16 and float16
    tensors are noised as float32 (which holds their values exactly; numpy has no bfloat16) and the
    release is then rounded to their dtype: post-processing, no privacy cost.

    Raises:
        UnsafeInput: NaN/Inf, not 2-D, or values too large for the float-safe grid.
        FloatingPointError: a noised value overflows a half-precision dtype (float16's largest
            value is 65504); nothing is returned.
    """
    sigma = check_positive("sigma", sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    src = source if source is not None else noise_source()
    if _is_torch(X):
        import torch

        host = X.detach().to("cpu")
        if host.dtype in (torch.bfloat16, torch.float16):
            host = host.float()  # exact: every bfloat16 and float16 value is a float32 value
        out = add_gaussian_rows(host.numpy(), sigma, sensitivity=sensitivity, source=src)
        released = torch.from_numpy(out).to(dtype=X.dtype)
        if released.dtype != host.dtype and not bool(torch.isfinite(released).all()):
            raise FloatingPointError(f"noised rows overflow {X.dtype} (sigma={sigma:g}); nothing released")
        return released.to(device=X.device)
    arr = _float_array("X", X)
    if arr.ndim != 2:
        raise UnsafeInput(f"X must be a 2-D array (rows, dim), got shape {arr.shape}")
    _check_finite("X", arr)
    n_rows, dim = arr.shape
    if not src.float_safe:
        with np.errstate(over="ignore"):  # a float16 overflow is refused just below
            fast = _fast_loop(arr, sigma, 1.0, None, src)
        return _fits_dtype(fast, sigma)
    g = grid_spacing(sigma, sensitivity=sensitivity, size=dim, norm_bounded=True)
    scale, inv_g = sigma / g, 1.0 / g
    if float(np.max(np.abs(arr))) * inv_g >= _EXACT:
        raise UnsafeInput(f"X has values too large for the float-safe grid (g={g:g})")
    bound = (sensitivity * inv_g) ** 2 * (1.0 - 2.0**-30)
    out = np.empty_like(arr)
    rows = max(1, _CHUNK // dim)
    for start in range(0, n_rows, rows):
        xs = arr[start : start + rows].astype(np.float64) * inv_g  # exact: g is a power of two
        n = np.trunc(xs)
        sq = np.einsum("ij,ij->i", n, n)
        over = np.flatnonzero(sq > bound)
        while over.size:  # only rows whose clipped float64 norm sat an ulp above C
            f = np.sqrt(bound / sq[over]) * (1.0 - 2.0**-30)
            n[over] = np.trunc(n[over] * f[:, None])
            sq[over] = np.einsum("ij,ij->i", n[over], n[over])
            over = over[sq[over] > bound]
        n += np.rint(src.standard_normal(n.size).reshape(n.shape) * scale)
        n *= g
        with np.errstate(over="ignore"):  # a float16 overflow is refused just below
            out[start : start + rows] = n  # the cast to the input's dtype is post-processing
    return _fits_dtype(out, sigma)


def _fits_dtype(out: NDArray[Any], sigma: float) -> NDArray[Any]:
    """``out``, unless a noised value overflowed a half-precision dtype (float16 tops out at 65504)."""
    if out.dtype.itemsize < 4 and not np.isfinite(out).all():
        raise FloatingPointError(f"noised rows overflow {out.dtype} (sigma={sigma:g}); nothing released")
    return out
