"""The wire format of :mod:`gaussdp.inference.ckks`: SEAL objects to and from bytes, framed, and
bounded in what they decompress to before SEAL reads them.

A message is ``MAGIC``, a few little-endian ``uint32`` header fields, a part count, then each part
as its length and its bytes (SEAL serializations). Parsing refuses a bad magic, too many parts, a
truncated part and trailing bytes.
"""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Any

from gaussdp.errors import UnsafeInput

CTX_MAGIC = b"GDPCKKSCTX2\n"  # parameters, then one part per rotation key
OLD_CTX_MAGIC = b"GDPCKKSCTX1\n"  # parameters and every rotation key in one part: refused
CT_MAGIC = b"GDPCKKSCT1\n"


def _tmpdir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def save(obj: Any) -> bytes:
    """SEAL's Python binding saves to a path only: through a private temporary file (RAM when it can)."""
    fd, path = tempfile.mkstemp(dir=_tmpdir(), prefix="gaussdp-ckks-")
    os.close(fd)
    try:
        obj.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


_SEAL_MAGIC = 0xA15E
_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_BLOCK_MAX = 128 * 1024  # a compressed zstd block regenerates at most this many bytes
# Largest decompressed SEAL object accepted: one rotation key (seeded: 3 x 4 x 8192 x 8 = 786 kB,
# 1.5 MiB unseeded), a ciphertext (fresh and unseeded: 2 x 3 x 8192 x 8 = 393 kB), the parameters
# (under 1 kB).
MAX_KEY_BYTES = 2 << 20
MAX_CIPHERTEXT_BYTES = 512 << 10
MAX_PARMS_BYTES = 256 << 10  # one compressed zstd block may count 128 KiB


def inflated_bound(name: str, data: bytes) -> int:
    """An upper bound on the bytes SEAL will decompress from ``data``, read from the headers only.

    SEAL compresses with zstd, and a small message could otherwise inflate to gigabytes (many
    rotation keys of zeros) before any check of SEAL's runs. Every zstd block says its type and
    size: a raw or RLE block regenerates exactly its size, a compressed block at most 128 KiB
    (RFC 8878, Section 3.1.1.2), so the sum bounds the output without decompressing anything.
    """
    try:
        magic, header_size, _, _, compr_mode, _, size = struct.unpack_from("<HBBBBHQ", data, 0)
        if magic != _SEAL_MAGIC or header_size != 16 or size != len(data):
            raise UnsafeInput(f"{name}: not a SEAL object")
        if compr_mode == 0:  # none
            return len(data)
        if compr_mode != 2:  # zlib streams carry no block sizes: refused
            raise UnsafeInput(f"{name}: SEAL compression mode {compr_mode}; only none or zstd are accepted")
        total, pos = 0, 16
        while pos < len(data):
            (frame_magic,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if frame_magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame
                (skip,) = struct.unpack_from("<I", data, pos)
                pos += 4 + skip
                continue
            if frame_magic != _ZSTD_MAGIC:
                raise UnsafeInput(f"{name}: not a zstd frame")
            descriptor = data[pos]
            pos += 1
            single_segment = (descriptor >> 5) & 1
            pos += (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
            pos += (single_segment, 2, 4, 8)[descriptor >> 6]
            while True:
                head = int.from_bytes(data[pos : pos + 3], "little")
                if pos + 3 > len(data):
                    raise UnsafeInput(f"{name}: truncated")
                pos += 3
                block_type, block_size = (head >> 1) & 3, head >> 3
                if block_type == 0:  # raw
                    total, pos = total + block_size, pos + block_size
                elif block_type == 1:  # RLE: one byte repeated block_size times
                    total, pos = total + block_size, pos + 1
                elif block_type == 2:
                    total, pos = total + _ZSTD_BLOCK_MAX, pos + block_size
                else:
                    raise UnsafeInput(f"{name}: invalid zstd block")
                if head & 1:
                    break
            if (descriptor >> 2) & 1:
                pos += 4  # content checksum
        if pos != len(data):
            raise UnsafeInput(f"{name}: truncated")
        return total
    except (struct.error, IndexError):
        raise UnsafeInput(f"{name}: truncated") from None


def load(obj: Any, data: bytes, ctx: Any = None, *, name: str = "SEAL object", max_bytes: int) -> None:
    """Load ``data`` into ``obj`` after bounding what it decompresses to (see :func:`inflated_bound`)."""
    bound = inflated_bound(name, data)
    if bound > max_bytes:
        raise UnsafeInput(f"{name}: would decompress to up to {bound} bytes, more than {max_bytes}")
    fd, path = tempfile.mkstemp(dir=_tmpdir(), prefix="gaussdp-ckks-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if ctx is None:
            obj.load(path)
        else:
            obj.load(ctx, path)
    finally:
        os.unlink(path)


def frame(magic: bytes, header: tuple[int, ...], parts: list[bytes]) -> bytes:
    out = [magic, struct.pack("<" + "I" * len(header), *header), struct.pack("<I", len(parts))]
    for p in parts:
        out += [struct.pack("<I", len(p)), p]
    return b"".join(out)


def unframe(
    name: str, magic: bytes, n_header: int, data: bytes, max_parts: int
) -> tuple[tuple[int, ...], list[bytes]]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{name} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(magic):
        raise UnsafeInput(f"{name}: not a gaussdp CKKS message (bad magic)")
    pos = len(magic)
    try:
        header = struct.unpack_from("<" + "I" * n_header, data, pos)
        pos += 4 * n_header
        (count,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if not 1 <= count <= max_parts:
            raise UnsafeInput(f"{name}: {count} parts, expected 1 to {max_parts}")
        parts = []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + n > len(data):
                raise UnsafeInput(f"{name}: truncated")
            parts.append(data[pos : pos + n])
            pos += n
    except struct.error:
        raise UnsafeInput(f"{name}: truncated") from None
    if pos != len(data):
        raise UnsafeInput(f"{name}: {len(data) - pos} trailing bytes")
    return header, parts
