"""Where the torch engine's randomness comes from: Poisson sampling and gradient noise."""

from __future__ import annotations

import os
import secrets
import warnings
from typing import Any

import torch

from gaussdp._validate import check_nonnegative
from gaussdp.errors import NotPrivateWarning

__all__ = [
    "KeystreamNormal",
    "add_standard_normal_",
    "keystream_normal_available",
    "noise_buffer",
    "torch_generator",
]

_CHUNK = 1 << 16  # values per draw: 256 KiB of float32 scratch, whatever the tensor's size
_REKEY_BYTES = 1 << 35  # keystream bytes per key and nonce (half of what one GCM nonce covers)


def torch_generator(seed: int | None, what: str) -> torch.Generator:
    """A CPU ``torch.Generator``: seeded from OS entropy by default, or from ``seed`` (not private).

    The default draws a fresh 63-bit seed from ``secrets`` (the OS CSPRNG) for each generator, as the
    core's "fast" noise source does; a fixed ``seed`` makes ``what`` reproducible and therefore not
    private, which is warned with :class:`gaussdp.errors.NotPrivateWarning`.
    """
    gen = torch.Generator()
    if seed is None:
        gen.manual_seed(secrets.randbits(63))
    else:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got seed={seed!r}")
        warnings.warn(
            f"{what} uses seed={seed}: reproducible, and NOT private (anyone with the seed can undo it)",
            NotPrivateWarning,
            stacklevel=3,
        )
        gen.manual_seed(seed)
    return gen


def keystream_normal_available() -> bool:
    """True where :class:`KeystreamNormal` can run: ``cryptography`` and the compiled ``gaussdp._gauss``."""
    try:
        import cryptography.hazmat.primitives.ciphers  # noqa: F401

        import gaussdp._gauss  # noqa: F401
    except ImportError:
        return False
    return True


class KeystreamNormal:
    """N(0, 1) deviates from an AES-128-CTR keystream, by a vectorised Box-Muller transform.

    The gradient noise of the torch engine by default (``PrivacyEngine(noise="fast")``). The key and
    the nonce are 28 bytes from the OS CSPRNG (``secrets``); the keystream is OpenSSL's AES in
    counter mode (through ``cryptography``, AES-NI where the CPU has it), a cryptographic generator where
    torch's Mersenne Twister is not (its state follows from 624 outputs). ``gaussdp._gauss`` turns
    the words into float32 or float64 deviates in place (see its source for the uniforms' widths and
    the tails). A forked child re-keys, so it never replays its parent's noise, and so does the
    generator every 32 GiB of keystream.

    Speed (``benchmarks/bench_torch_noise.py``, 2 shared vCPUs): adding 670k float32 deviates takes
    about 0.8 ms, 3.3 times less than ``torch.randn`` and ``add_`` (most of whose time is the
    Mersenne Twister itself), and float64 about 7 times less.
    """

    stream = "AES-128-CTR keystream + Box-Muller"
    private = True

    def __init__(self) -> None:
        self._zeros = bytes(0)
        self._rekey()

    def _rekey(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._pid = os.getpid()
        # AES-GCM encryption of zeros is the AES-CTR keystream from counter (nonce, 2): the same
        # generator, through OpenSSL's GCM code, which uses the wide vector AES instructions where
        # its CTR code does not (about twice the speed here). The tag is never formed. One nonce
        # covers 2^32 - 2 blocks (64 GiB); a fresh key and nonce are drawn every 32 GiB.
        cipher = Cipher(algorithms.AES(secrets.token_bytes(16)), modes.GCM(secrets.token_bytes(12)))
        self._encryptor = cipher.encryptor()
        self._left = _REKEY_BYTES

    def _keystream_into(self, raw: Any) -> None:
        if os.getpid() != self._pid or raw.nbytes > self._left:
            self._rekey()
        self._left -= raw.nbytes
        if len(self._zeros) < raw.nbytes:
            self._zeros = bytes(raw.nbytes)
        self._encryptor.update_into(memoryview(self._zeros)[: raw.nbytes], raw)

    def fill_(self, buf: torch.Tensor, std: float = 1.0) -> torch.Tensor:
        """Overwrite a contiguous CPU float32/float64 tensor of even length with N(0, std^2); return
        it. Written in place, a chunk at a time: no scratch."""
        from gaussdp import _gauss

        _check_host_float(buf)
        std = _check_std(std)
        if buf.numel() % 2:
            raise ValueError(f"buf must hold an even number of values, got {buf.numel()}")
        flat = buf.detach().view(-1).numpy()
        for lo in range(0, flat.size, _CHUNK):
            raw = flat[lo : lo + _CHUNK].view("uint8")  # _CHUNK is even: every chunk holds pairs
            self._keystream_into(raw)
            _gauss.normal_inplace(raw, buf.element_size(), std)
        return buf

    def add_(self, dst: torch.Tensor, std: float) -> torch.Tensor:
        """``dst += std * N(0, 1)`` in place on a contiguous CPU float32/float64 tensor; return it.

        The keystream goes through a scratch of at most 64k words; the kernel adds the deviates to
        ``dst`` as it makes them (one pass over ``dst``, no array of deviates).
        """
        from gaussdp import _gauss

        _check_host_float(dst)
        std = _check_std(std)
        flat = dst.detach().view(-1).numpy()
        width = dst.element_size()
        words = torch.empty(min(flat.size + flat.size % 2, _CHUNK), dtype=dst.dtype).numpy().view("uint8")
        for lo in range(0, flat.size, _CHUNK):
            part = flat[lo : lo + _CHUNK]
            raw = words[: (part.size + part.size % 2) * width]
            self._keystream_into(raw)
            _gauss.normal_add(part, raw, width, std)
        return dst

    def __repr__(self) -> str:
        return f"<KeystreamNormal {self.stream}>"


def noise_buffer(source: Any, shape: torch.Size, dtype: torch.dtype, std: float) -> torch.Tensor:
    """A new CPU tensor of ``shape`` holding N(0, std^2) per value, from any of the engine's sources.

    The DP optimizer draws a step's noise into the buffer that the clipped sums are then added to
    (in place, by the GEMM that forms them): one pass over the gradient instead of two.
    """
    buf = torch.empty(shape, dtype=dtype)
    if isinstance(source, KeystreamNormal) and buf.numel() % 2 == 0:
        return source.fill_(buf, std)
    return add_standard_normal_(source, buf.zero_(), std)


def _check_host_float(t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float64) or t.device.type != "cpu":
        raise TypeError(f"expected a CPU float32 or float64 tensor, got {t.dtype} on {t.device}")
    if not t.is_contiguous():
        raise ValueError("expected a contiguous tensor")


def _check_std(std: float) -> float:
    # the kernel is compiled with -ffast-math, which may assume finite values: refuse NaN/Inf here
    return check_nonnegative("std", std)


def add_standard_normal_(source: Any, dst: torch.Tensor, std: float) -> torch.Tensor:
    """``dst += std * N(0, 1)`` per value, in place, from any of the engine's noise sources.

    ``source``: a :class:`KeystreamNormal`, a ``torch.Generator``, or a
    :class:`gaussdp.noise.NoiseSource` (``noise="secure"``). ``dst``: a float32/float64 tensor on any
    device. The noise is drawn on the host a chunk at a time, so it never needs a full-size copy.
    """
    std = _check_std(std)
    flat = dst.view(-1)
    if isinstance(source, KeystreamNormal) and flat.device.type == "cpu" and flat.is_contiguous():
        source.add_(flat, std)
        return dst
    buf = torch.empty(min(flat.numel() + flat.numel() % 2, _CHUNK), dtype=dst.dtype)
    for lo in range(0, flat.numel(), _CHUNK):
        part = flat[lo : lo + _CHUNK]
        m = part.numel()
        z = buf[: m + m % 2]
        if isinstance(source, KeystreamNormal):
            source.fill_(z)
        elif isinstance(source, torch.Generator):
            z.normal_(generator=source)
        else:
            np_dtype = "float32" if z.dtype == torch.float32 else "float64"
            z.copy_(torch.from_numpy(source.standard_normal(z.numel(), dtype=np_dtype)))
        part.add_(z[:m].to(part.device), alpha=std)  # drawn on the host, added on the device
    return dst
