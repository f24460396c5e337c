"""Row-wise Gaussian releases shared by the embedding sanitizer and the file streamer.

Each row is one individual's (clipped) embedding and one norm-bounded Gaussian release through
:func:`gaussdp.noise.add_gaussian_rows` (the core's row path); this module only chooses where the
randomness comes from (seeded runs are keyed per block of rows, so chunking cannot change them)
and what a release costs under the two neighbouring relations.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import numpy as np

from gaussdp import mechanism as _mechanism
from gaussdp._neighbouring import Neighbouring, check_neighbouring
from gaussdp.errors import InvalidParameter, NotPrivateWarning
from gaussdp.noise import NoiseSource, add_gaussian_rows, noise_source

__all__ = ["SEED_BLOCK_ROWS", "check_seed", "noise_rows", "release_epsilon"]

# Seeded noise is drawn per block of this many rows, each block from its own seed derived from
# (seed, block index): the output then does not depend on how the rows were chunked.
SEED_BLOCK_ROWS = 256


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got seed={seed!r} ({type(seed).__name__})")
    if seed < 0:
        raise InvalidParameter(f"seed must be >= 0, got seed={seed!r}")
    return int(seed)


def _block_source(seed: int, block: int) -> NoiseSource:
    derived = int(np.random.SeedSequence([seed, block]).generate_state(1, dtype=np.uint64)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)  # the public entry points warn once
        return noise_source(seed=derived)


def noise_rows(
    clipped: np.ndarray,
    *,
    sigma: float,
    clip_norm: float,
    source: NoiseSource,
    seed: int | None,
    first_row: int,
) -> np.ndarray:
    """Add N(0, sigma^2) to every clipped row: one norm-bounded release per row (core's row path).

    Unseeded, the rows draw from ``source`` in order. Seeded, rows are noised in blocks of
    :data:`SEED_BLOCK_ROWS` keyed by ``(seed, absolute block index)``, so that a file sanitized in
    chunks (block-aligned) gives exactly what one call on the whole matrix gives.
    """
    if seed is None:
        return np.asarray(add_gaussian_rows(clipped, sigma, sensitivity=clip_norm, source=source))
    if first_row % SEED_BLOCK_ROWS:
        raise InvalidParameter("seeded chunks must start on a multiple of SEED_BLOCK_ROWS")
    out = np.empty_like(clipped)
    for start in range(0, clipped.shape[0], SEED_BLOCK_ROWS):
        stop = start + SEED_BLOCK_ROWS
        src = _block_source(seed, (first_row + start) // SEED_BLOCK_ROWS)
        out[start:stop] = add_gaussian_rows(clipped[start:stop], sigma, sensitivity=clip_norm, source=src)
    return out


def release_epsilon(mech: Any, delta: float, neighbouring: str) -> float:
    """Epsilon at ``delta`` of one row release by ``mech`` (sensitivity = its clip norm C).

    ``"add_remove"``: a row added or removed (an absent row counting as zero) moves the output
    by at most C. ``"replace_one"``: two rows in the C-ball differ by up to 2C.
    """
    if check_neighbouring(neighbouring) is Neighbouring.ADD_REMOVE:
        return float(mech.epsilon(delta))
    # Two rows in the C-ball differ by up to 2C: the same sigma at twice the sensitivity.
    doubled = _mechanism.GaussianMechanism(
        sigma=mech.sigma, sensitivity=2.0 * mech.sensitivity, noise=mech.source
    )
    return float(doubled.epsilon(delta))
