"""Correlated noise of a banded Toeplitz strategy, one step at a time, from a bounded buffer.

The mechanism releases ``C x + z`` with ``z_t ~ N(0, std^2 I)`` independent across steps; training
uses ``C^{-1}`` of it, i.e. step ``t``'s sum plus ``y_t = (C^{-1} z)_t``. For a ``b``-banded
lower-triangular Toeplitz ``C`` (coefficients ``c_0 .. c_{b-1}``), ``C y = z`` row by row gives

    y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0,

so each step needs only the ``b - 1`` previous noise vectors: the buffer holds ``b - 1`` arrays of
the parameters' shape, plus the one being made (``b x parameters`` in all). The array that leaves
the buffer is handed back by :meth:`BandedNoise.scratch` for the next step's draw, so a long run
allocates nothing per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter

__all__ = ["BandedNoise"]


class BandedNoise:
    """The correlated noise ``y = C^{-1} z`` of a banded Toeplitz strategy, step by step.

    Each call of :meth:`next` for a key (a parameter) takes that step's fresh Gaussian ``z_t``
    (drawn by the caller from its noise source, at the standard deviation the accounting assumes)
    and returns ``y_t``, computed in place in ``z_t``'s array, which the buffer then keeps: the
    caller must not modify it (add it to something else). The covariance of ``(y_0, .., y_{n-1})``
    per coordinate is ``std^2 C^{-1} C^{-T}``. Works on numpy arrays and torch tensors alike.

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
        self._buffers: dict[Hashable, deque[Any]] = {}
        self._spare: dict[Hashable, Any] = {}
        self.steps: dict[Hashable, int] = {}

    def scratch(self, key: Hashable) -> Any:
        """The array that left ``key``'s buffer at the last step (to draw the next ``z_t`` into), or
        None before the buffer is full. Its values are stale: overwrite them."""
        return self._spare.pop(key, None)

    def next(self, key: Hashable, fresh: Any) -> Any:
        """``y_t`` for ``key`` from this step's fresh noise ``z_t`` (overwritten and returned)."""
        buf = self._buffers.setdefault(key, deque(maxlen=self.bands - 1))
        y = fresh
        for j, prev in enumerate(reversed(buf), start=1):  # newest first: y_{t-1}, y_{t-2}, ...
            cj = float(self.coefficients[j])
            if cj == 0.0:
                continue
            if hasattr(y, "add_"):
                y.add_(prev, alpha=-cj)
            else:
                y -= cj * prev
        if self.coefficients[0] != 1.0:
            y /= float(self.coefficients[0])
        if self.bands > 1:
            if len(buf) == buf.maxlen:
                self._spare[key] = buf[0]  # y_{t-b+1}: no longer needed once y_t is made
            buf.append(y)
        self.steps[key] = self.steps.get(key, 0) + 1
        return y

    def buffered_values(self) -> int:
        """How many numbers the buffer holds now (at most ``(b - 1) x parameters``)."""
        return sum(int(np.prod(tuple(a.shape))) for buf in self._buffers.values() for a in buf)
