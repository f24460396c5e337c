"""Where the torch engine's randomness comes from: Poisson sampling and gradient noise."""

from __future__ import annotations

import secrets
import warnings

import torch

from gaussdp.errors import NotPrivateWarning

__all__ = ["torch_generator"]


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
