"""Correlated noise of a banded Toeplitz strategy, one step at a time, from a bounded buffer.

The mechanism releases ``C x + z`` with ``z_t ~ N(0, std^2 I)`` independent across steps; training
uses ``C^{-1}`` of it, i.e. step ``t``'s sum plus ``y_t = (C^{-1} z)_t``. For a ``b``-banded
lower-triangular Toeplitz ``C`` (coefficients ``c_0 .. c_{b-1}``), ``C y = z`` row by row gives

    y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0,

so each step needs only the ``b - 1`` previous noise vectors: the buffer is a ring of ``b - 1`` rows
of the parameters' size, plus one work array the step's noise is drawn into and made in
(``b x parameters`` in all). The sum over the ring is one matrix-vector product (BLAS ``gemv``),
which reads the ring once per step; nothing is allocated per step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter

__all__ = ["BandedNoise"]


class BandedNoise:
    """The correlated noise ``y = C^{-1} z`` of a banded Toeplitz strategy, step by step.

    For each key (a parameter), draw the step's fresh Gaussian ``z_t`` (at the standard deviation
    the accounting assumes, from the caller's noise source) into :meth:`scratch` (or any array of
    the key's shape) and call :meth:`next`, which turns it into ``y_t`` in place and returns it.
    The ring keeps a copy, so the caller may use the returned array freely until the key's next
    step (the work array is handed out again then). The covariance of ``(y_0, .., y_{n-1})`` per
    coordinate is ``std^2 C^{-1} C^{-T}``. Works on numpy arrays and torch tensors alike.

    Args:
        coefficients: ``c_0 .. c_{b-1}`` of the strategy, finite, ``c_0 > 0``.

    Raises:
        InvalidParameter: coefficients empty, not finite, or ``c_0 <= 0``.
    """

    def __init__(self, coefficients: Any) -> None:
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim != 1 or c.size == 0 or not np.all(np.isfinite(c)) or c[0] <= 0:
            raise InvalidParameter(
                f"coefficients must be a non-empty finite vector with coefficients[0] > 0, got {c!r}"
            )
        self.coefficients = c
        self.bands = int(c.size)
        self._rings: dict[Hashable, Any] = {}  # key -> (b - 1, size) array of y_{t-1}, .., y_{t-b+1}
        self._work: dict[Hashable, Any] = {}
        self.steps: dict[Hashable, int] = {}

    def scratch(self, key: Hashable) -> Any:
        """The key's work array (None before its first step): draw ``z_t`` into it (stale values)."""
        return self._work.get(key)

    def next(self, key: Hashable, fresh: Any) -> Any:
        """``y_t`` for ``key`` from this step's fresh noise ``z_t`` (overwritten and returned)."""
        t = self.steps.get(key, 0)
        torch_like = hasattr(fresh, "addmv_")
        # in place through a flat view: a non-contiguous array is made contiguous (a copy) first
        fresh = fresh.contiguous() if torch_like else np.ascontiguousarray(fresh)
        flat = fresh.reshape(-1)
        w = self.bands - 1
        if w and t:
            ring = self._rings[key]
            # row r holds y_{t-j} with j = (t - 1 - r) mod w + 1 (the newest row is (t - 1) mod w)
            lags = (t - 1 - np.arange(w)) % w + 1
            weights = np.where(lags <= t, self.coefficients[lags], 0.0)
            if torch_like:
                import torch

                wt = torch.as_tensor(weights, dtype=flat.dtype, device=flat.device)
                flat.addmv_(ring.t(), wt, alpha=-1.0)
            else:
                flat -= weights.astype(flat.dtype, copy=False) @ ring
        if self.coefficients[0] != 1.0:
            flat /= float(self.coefficients[0])
        if w:
            if key not in self._rings:
                if torch_like:
                    import torch

                    self._rings[key] = torch.zeros((w, flat.numel()), dtype=flat.dtype, device=flat.device)
                else:
                    self._rings[key] = np.zeros((w, flat.size), dtype=flat.dtype)
            self._rings[key][t % w] = flat
        self._work[key] = fresh
        self.steps[key] = t + 1
        return fresh

    def buffered_values(self) -> int:
        """How many numbers the ring holds (``(b - 1) x parameters``; the work arrays add one more)."""
        return sum(int(np.prod(tuple(r.shape))) for r in self._rings.values())
