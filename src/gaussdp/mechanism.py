"""The Gaussian mechanism: clip to the sensitivity, add calibrated noise, release.

``GaussianMechanism(epsilon=..., delta=..., sensitivity=...)`` calibrates sigma exactly
(:func:`gaussdp.calibration.sigma_for`, Balle & Wang 2018); ``GaussianMechanism(sigma=...,
sensitivity=...)`` takes a noise level and reports what it buys. Neighbouring relation: one release
changes by at most ``sensitivity`` in L2 norm between neighbouring datasets; :meth:`release` makes
that true for a single record by clipping it to L2 norm ``sensitivity`` first (add/remove of that
record), :meth:`add_noise` trusts the caller's bound on an aggregate.

By default the noise comes from a CSPRNG and the release is floating-point safe
(:mod:`gaussdp.noise`): the output lies on a power-of-two grid and leaks no low-order bits of the
input. Rounding an arbitrary aggregate to that grid can move it by ``2**-20 * sensitivity``; the
mechanism therefore calibrates and accounts for the sensitivity ``sensitivity * (1 + 2**-20)``
(:attr:`accounted_sensitivity`) so that every epsilon it reports is an upper bound for both
methods. ``noise="fast"`` uses numpy's generator and plain float arithmetic (not float-safe; the
claim then holds for the ideal real-valued mechanism). ``seed=`` makes the noise reproducible and
the mechanism NOT private (``.private is False``, :class:`~gaussdp.errors.NotPrivateWarning`).

References:
    Balle, B. & Wang, Y.-X. (2018). Improving the Gaussian Mechanism for Differential Privacy. ICML.
    Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy, Thm A.1.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

from gaussdp._format import format_exact, format_upper
from gaussdp._validate import SetOnce, check_delta, check_epsilon, check_positive
from gaussdp.calibration import Method, delta_for, epsilon_for, sigma_for
from gaussdp.clipping import clip_rows
from gaussdp.errors import InvalidParameter
from gaussdp.noise import (
    GRID_SLACK,
    NoiseSource,
    SourceKind,
    add_gaussian,
    add_gaussian_rows,
    noise_source,
    release_clipped,
)

if TYPE_CHECKING:
    from gaussdp.accounting import GaussianEvent

__all__ = ["GaussianMechanism"]

_MIN_SCALE = 1e-280  # smallest sigma or sensitivity whose noise grid stays a normal float


class GaussianMechanism(SetOnce):
    """One (epsilon, delta)-DP release of a vector of bounded L2 sensitivity.

    Args:
        epsilon: target epsilon > 0 (with ``delta``), or omit and give ``sigma``.
        delta: target delta in (0, 1).
        sigma: noise standard deviation > 0 (instead of epsilon and delta).
        sensitivity: L2 sensitivity, and the clip norm of :meth:`release`, > 0.
        method: calibration, ``"analytic"`` (exact, default) or ``"classical"`` (refused where it
            does not deliver the target).
        noise: ``"secure"`` (default, CSPRNG, float-safe), ``"fast"`` (numpy, not float-safe), or a
            :class:`~gaussdp.noise.NoiseSource`.
        seed: reproducible noise for experiments; marks the mechanism not private.

    Raises:
        InvalidParameter: parameters out of range or an inconsistent combination.
        TypeError: a parameter that is not a real number.

    >>> mech = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    >>> round(mech.sigma, 4), round(mech.epsilon(1e-5), 6), mech.private
    (3.7306, 1.0, True)
    """

    # calibrated together: set once (gaussdp._validate.SetOnce), since releasing at one sensitivity
    # while accounting for another would print a wrong epsilon
    _CALIBRATED = frozenset({"sigma", "sensitivity", "accounted_sensitivity", "source"})

    def __init__(
        self,
        *,
        epsilon: float | None = None,
        delta: float | None = None,
        sigma: float | None = None,
        sensitivity: float = 1.0,
        method: Method = "analytic",
        noise: SourceKind | NoiseSource = "secure",
        seed: int | None = None,
    ) -> None:
        self.sensitivity = check_positive("sensitivity", sensitivity)
        self.source: NoiseSource = noise_source(noise, seed=seed) if seed is None else _seeded(seed)
        slack = GRID_SLACK if self.source.float_safe else 0.0
        self.accounted_sensitivity = self.sensitivity * (1.0 + slack)
        if sigma is not None:
            if epsilon is not None or delta is not None:
                raise InvalidParameter(
                    "give either sigma=... or epsilon=... and delta=..., not both "
                    f"(got sigma={sigma!r}, epsilon={epsilon!r}, delta={delta!r})"
                )
            self.sigma = check_positive("sigma", sigma)
            self.target: tuple[float, float] | None = None
        else:
            if epsilon is None or delta is None:
                raise InvalidParameter(
                    "GaussianMechanism needs epsilon=... and delta=..., or sigma=... "
                    f"(got epsilon={epsilon!r}, delta={delta!r})"
                )
            eps = check_epsilon(epsilon)
            dlt = check_delta(delta)
            self.sigma = _fits_its_event(
                sigma_for(epsilon=eps, delta=dlt, sensitivity=self.accounted_sensitivity, method=method),
                self.accounted_sensitivity,
                eps,
                dlt,
            )
            self.target = (eps, dlt)
        for name, value in (("sigma", self.sigma), ("sensitivity", self.sensitivity)):
            if value < _MIN_SCALE:
                # Refused before anything is charged: the noise grid (2**-20 sigma, finer for small
                # sensitivities) would underflow to 0 and the release fail after its charge.
                raise InvalidParameter(
                    f"{name} must be >= {_MIN_SCALE:g} (below it floats cannot carry the noise), "
                    f"got {name}={value!r}"
                )

    # --- what it costs -----------------------------------------------------------------------

    @property
    def noise_multiplier(self) -> float:
        """``sigma / sensitivity``."""
        return self.sigma / self.sensitivity

    @property
    def private(self) -> bool:
        """False when the noise is seeded (reproducible by anyone who knows the seed)."""
        return self.source.private

    @property
    def float_safe(self) -> bool:
        """True when releases use the exact integer-grid arithmetic of :mod:`gaussdp.noise`."""
        return self.source.float_safe

    def epsilon(self, delta: float) -> float:
        """Exact epsilon (rounded up) of one release at ``delta``."""
        return epsilon_for(sigma=self.sigma, delta=delta, sensitivity=self.accounted_sensitivity)

    def delta(self, epsilon: float) -> float:
        """Exact delta of one release at ``epsilon``."""
        return delta_for(sigma=self.sigma, epsilon=epsilon, sensitivity=self.accounted_sensitivity)

    @property
    def event(self) -> GaussianEvent:
        """The release as a :class:`gaussdp.accounting.GaussianEvent`, for accountants and ledgers."""
        from gaussdp.accounting import GaussianEvent

        return GaussianEvent(noise_multiplier=self.sigma / self.accounted_sensitivity)

    # --- releasing -----------------------------------------------------------------------------

    def release(self, x: Any) -> Any:
        """Clip ``x`` to L2 norm ``sensitivity`` and add the noise: one DP release of one record.

        Args:
            x: a scalar, vector, matrix (L2 norm over all entries) or torch tensor of real values.

        Returns:
            The noisy values, same shape; float dtypes are kept (float32 stays float32), integers
            become float64, a Python scalar gives a float.

        Raises:
            UnsafeInput: NaN/Inf or empty input (checked before anything is drawn).
            TypeError: bool, complex or non-numeric input.
        """
        scalar = isinstance(x, numbers.Real) and not isinstance(x, bool | np.generic)
        out = release_clipped(x, self.sigma, clip_norm=self.sensitivity, source=self.source)
        return float(out) if scalar else out

    def release_rows(self, X: Any) -> Any:
        """Release every row of a 2-D array as one record: clip each row, then add the noise.

        Each row is its own release (one per record); composing them is the caller's business
        (a dataset of ``n`` rows of the same person costs ``n`` events).
        """
        clipped, _ = clip_rows(X, self.sensitivity)
        return add_gaussian_rows(clipped, self.sigma, sensitivity=self.sensitivity, source=self.source)

    def add_noise(self, x: Any) -> Any:
        """Add the noise to ``x`` without clipping: the caller guarantees its L2 sensitivity.

        Use it for aggregates (a sum of clipped rows has sensitivity ``clip_norm``). Same dtype
        rules and errors as :meth:`release`.
        """
        scalar = isinstance(x, numbers.Real) and not isinstance(x, bool | np.generic)
        if isinstance(x, bool):
            raise TypeError("x must be real-valued, got a bool")
        out = add_gaussian(
            x, self.sigma, sensitivity=self.sensitivity, source=self.source, norm_bounded=False
        )
        return float(out) if scalar else out

    def __repr__(self) -> str:
        eps = "" if self.target is None else f"epsilon={format_exact(self.target[0])}, delta="
        eps += "" if self.target is None else f"{format_exact(self.target[1])}, "
        return (  # the calibrated sigma rounded up (more noise), the rest as given
            f"GaussianMechanism({eps}sigma={format_upper(self.sigma)}, sensitivity="
            f"{format_exact(self.sensitivity)}, "
            f"noise={self.source.name!r}, private={self.private})"
        )


def _seeded(seed: int) -> NoiseSource:
    import warnings

    from gaussdp.errors import NotPrivateWarning

    # Re-raise noise_source's warning at the caller of GaussianMechanism(..., seed=...).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = noise_source(seed=seed)
    for w in caught:
        if issubclass(w.category, NotPrivateWarning):
            warnings.warn(str(w.message), NotPrivateWarning, stacklevel=3)
    return src


def _fits_its_event(sigma: float, accounted_sensitivity: float, epsilon: float, delta: float) -> float:
    """``sigma``, raised by a few ulps if needed so that the tight accountant's epsilon of the release's
    own event (``sigma / accounted_sensitivity``, a rounded division) is at most the target.

    Without it a ledger whose budget is exactly the requested (epsilon, delta) refused the release:
    the division's rounding put the PLD accountant's answer 2e-15 above epsilon. Raising sigma only
    adds noise; at most 16 steps of about 7e-15 relative (each one exact-PLD evaluation of a single
    Gaussian), after which the calibrated value is kept and a ledger decides as before.
    """
    from gaussdp.accounting import GaussianEvent, accountant

    for _ in range(16):
        if accountant("pld").compose(GaussianEvent(sigma / accounted_sensitivity)).epsilon(delta) <= epsilon:
            return sigma
        sigma *= 1.0 + 2.0**-47
    return sigma
