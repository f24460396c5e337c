"""Sanitize embeddings with the Gaussian mechanism: the anomaly detector's API, and streaming over files.

The flow is the library's: **clip each row to L2 norm ``C``, add Gaussian noise calibrated to
``(epsilon, delta)`` with sensitivity ``C``, release.** Clipping comes from :mod:`gaussdp.clipping`,
calibration and noise from :class:`gaussdp.mechanism.GaussianMechanism`; nothing is re-implemented
here.

What the guarantee covers. Every row is one individual's embedding, and the released matrix is each
row clipped and noised independently. The neighbouring relation is **add/remove of one row**, with
an absent individual's row counting as the zero vector (the number of rows is treated as public,
as it is in the federated anomaly detector, which ships coresets of a known size). One row moves the output by
at most ``C`` in L2 norm, so the sensitivity is ``C`` and each release is ``(epsilon, delta)``-DP for
every individual. If instead one individual's row may be *replaced* by another one (the neighbouring
relation of a data owner who contributes exactly one row either way), two rows in the ``C``-ball
differ by up to ``2C``: the same noise then gives the larger epsilon reported as
``epsilon_replace`` by :func:`sanitize_npy` and ``gaussdp sanitize``. Releasing the same
individuals again (another call, another round) composes: charge every release to an accountant
or a :class:`gaussdp.budget.Ledger` with the mechanism's ``event``.

Where the federated anomaly detector is wrong, and what gaussdp does instead:

* It calibrates with the classical ``sigma = C sqrt(2 ln(1.25/delta)) / epsilon``, a theorem only
  for epsilon < 1 (and one that under-delivers above epsilon of about 8.4 at delta=1e-5). gaussdp
  calibrates exactly (Balle & Wang 2018): sigma=3.7306 instead of 4.8448 at epsilon=1, delta=1e-5.
* It seeds the noise (``seed + client_id``). Anyone who knows the seed can subtract the noise:
  seeded output here warns :class:`gaussdp.errors.NotPrivateWarning` and is for reproducible
  experiments only. The default noise is keyed from OS entropy.
* It clips with ``C / (norm + 1e-8)`` and never checks for NaN: a NaN row has a NaN norm, skips
  clipping and breaks the guarantee. gaussdp refuses NaN/Inf and guarantees the clipped float64
  norm is at most ``C``.
* Its ``DPConfig`` is a mutable dataclass read again at clip time: mutating ``clipping_norm`` after
  the mechanism was built would clip to one norm and calibrate to another. Ours is frozen.

References:
    Balle, B. & Wang, Y.-X. (2018). Improving the Gaussian Mechanism for Differential Privacy:
    Analytical Calibration and Optimal Denoising. ICML, Theorem 8.
    Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy, Thm. A.1.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gaussdp import mechanism as _mechanism
from gaussdp._neighbouring import Neighbouring
from gaussdp._npy_stream import SanitizeReport, sanitize_npy
from gaussdp._rows import SEED_BLOCK_ROWS, check_seed, noise_rows, release_epsilon
from gaussdp._validate import SetOnce, check_delta, check_positive, real_number
from gaussdp.clipping import clip_rows
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.noise import SourceKind

__all__ = [
    "SEED_BLOCK_ROWS",
    "DPConfig",
    "EmbeddingSanitizer",
    "GaussianMechanism",
    "SanitizeReport",
    "sanitize_npy",
]

# The federated anomaly detector's accepted range for epsilon: below 0.1 the noise drowns the embeddings,
# above 10 the guarantee means little. Kept for compatibility with its configurations.
_DOC_EPSILON_RANGE = (0.1, 10.0)


def _check_doc_epsilon(value: Any) -> float:
    eps = real_number("epsilon", value)
    lo, hi = _DOC_EPSILON_RANGE
    if not lo <= eps <= hi:
        raise InvalidParameter(f"epsilon must be in [{lo}, {hi}], got epsilon={value!r}")
    return eps


class GaussianMechanism(_mechanism.GaussianMechanism):
    """The anomaly detector's ``GaussianMechanism(epsilon, delta, sensitivity)``, exactly calibrated.

    A thin face over :class:`gaussdp.mechanism.GaussianMechanism` with the federated anomaly detector's
    positional signature and validation (epsilon in [0.1, 10], delta in (0, 1), sensitivity > 0) and its
    ``add_noise(data, seed=None)``, which keeps the input's dtype. ``sigma`` is the exact
    (analytic) one, not the document's classical formula. Adding ``N(0, sigma^2)`` to a query of
    L2 sensitivity ``sensitivity`` is ``(epsilon, delta)``-DP for the neighbouring relation the
    sensitivity was computed for.

    One difference from the document: ``epsilon`` and ``delta`` are the core mechanism's methods
    (``epsilon(delta)``, ``delta(epsilon)``: what the noise really buys); the calibration target is
    ``target == (epsilon, delta)``.

    Args:
        epsilon: in [0.1, 10].
        delta: in (0, 1).
        sensitivity: L2 sensitivity, > 0 (the clipping norm for clipped rows).
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``; see :mod:`gaussdp.noise`.

    Raises:
        InvalidParameter: a parameter out of range (named in the message).
    """

    def __init__(
        self, epsilon: float, delta: float, sensitivity: float, *, noise: SourceKind = "secure"
    ) -> None:
        epsilon = _check_doc_epsilon(epsilon)
        delta = check_delta(delta)
        sensitivity = check_positive("sensitivity", sensitivity)
        super().__init__(epsilon=epsilon, delta=delta, sensitivity=sensitivity, noise=noise)
        self._noise_kind: SourceKind = noise

    def add_noise(self, data: Any, seed: int | None = None) -> np.ndarray:
        """Return ``data + N(0, sigma^2 I)`` in ``data``'s dtype (noise only: clip first).

        With ``seed`` the noise is reproducible and therefore **not private** (anyone who knows
        the seed can subtract it): a :class:`~gaussdp.errors.NotPrivateWarning` is issued.
        """
        arr = np.asarray(data)
        if seed is None:
            out = super().add_noise(arr)
        else:
            seed = check_seed(seed)
            warnings.warn(
                "add_noise(seed=...) gives reproducible noise that anyone who knows the seed can "
                "remove: the result is not private",
                NotPrivateWarning,
                stacklevel=2,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NotPrivateWarning)
                seeded = _mechanism.GaussianMechanism(
                    sigma=self.sigma, sensitivity=self.sensitivity, noise=self._noise_kind, seed=seed
                )
                out = seeded.add_noise(arr)
        return np.asarray(out).astype(arr.dtype, copy=False) if arr.dtype.kind == "f" else np.asarray(out)


@dataclass(frozen=True)
class DPConfig:
    """The federated anomaly detector's differential-privacy configuration of the embedding sanitizer.

    Validated only when ``enabled`` (as in the document): epsilon in [0.1, 10], delta in (0, 1),
    clipping_norm > 0. Frozen, so the clipping norm cannot change after the mechanism was
    calibrated to it.

    Args:
        enabled: whether sanitization adds noise at all.
        epsilon: per-release epsilon, in [0.1, 10].
        delta: per-release delta, in (0, 1); take it well below 1/(number of individuals).
        clipping_norm: L2 bound of each row, which is the sensitivity.

    Raises:
        TypeError: ``enabled`` not a bool, or a non-numeric value.
        InvalidParameter: a value out of range (named in the message).
    """

    enabled: bool = False
    epsilon: float = 1.0
    delta: float = 1e-5
    clipping_norm: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool | np.bool_):
            raise TypeError(f"enabled must be a bool, got enabled={self.enabled!r}")
        object.__setattr__(self, "enabled", bool(self.enabled))
        if self.enabled:
            object.__setattr__(self, "epsilon", _check_doc_epsilon(self.epsilon))
            object.__setattr__(self, "delta", check_delta(self.delta))
            object.__setattr__(self, "clipping_norm", check_positive("clipping_norm", self.clipping_norm))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DPConfig:
        """Build from a mapping (e.g. a parsed YAML/JSON section); unknown keys are refused.

        A misspelt key silently falling back to a default epsilon would change the guarantee, so
        unknown keys raise :class:`~gaussdp.errors.InvalidParameter`.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidParameter(f"unknown DPConfig keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)


class EmbeddingSanitizer(SetOnce):
    """The anomaly detector's sanitizer: clip every row to ``clipping_norm``, then add Gaussian noise.

    Each row of the matrix passed to :meth:`sanitize` is one individual's embedding. Under
    add/remove of one row (an absent row counting as zero, the number of rows public) the
    sensitivity is ``clipping_norm`` and every call is ``(epsilon, delta)``-DP; under replacement
    of one row it is ``2 * clipping_norm`` (see :meth:`epsilon`). Calls on the same individuals
    compose: charge :attr:`event` per call to an accountant or ledger.

    Args:
        config: a :class:`DPConfig`. When disabled, :meth:`sanitize` returns its input unchanged
            (the document's behaviour) and :attr:`mechanism` is ``None``.
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``.
    """

    _CALIBRATED = frozenset({"config", "mechanism"})  # gaussdp._validate.SetOnce: never reassigned

    def __init__(self, config: DPConfig, *, noise: SourceKind = "secure") -> None:
        if not isinstance(config, DPConfig):
            raise TypeError(f"config must be a DPConfig, got {type(config).__name__}")
        self.config = config
        # The clipping norm bounds each row, hence it is the sensitivity (add/remove one row).
        self.mechanism: GaussianMechanism | None = (
            GaussianMechanism(config.epsilon, config.delta, config.clipping_norm, noise=noise)
            if config.enabled
            else None
        )
        self._sanitization_count = 0
        self._norm_sum_before = 0.0
        self._norm_sum_after = 0.0
        self._stats: dict[str, Any] = {
            "num_sanitizations": 0,
            "total_embeddings_processed": 0,
            "embeddings_clipped": 0,
            "avg_norm_before_clip": 0.0,
            "avg_norm_after_clip": 0.0,
        }

    @property
    def sigma(self) -> float | None:
        """Standard deviation of the noise per coordinate (``None`` when disabled)."""
        return None if self.mechanism is None else float(self.mechanism.sigma)

    @property
    def event(self) -> Any:
        """The accounting event of one :meth:`sanitize` call (a Gaussian release per row)."""
        if self.mechanism is None:
            raise InvalidParameter("the sanitizer is disabled (config.enabled=False): nothing to account")
        return self.mechanism.event

    def epsilon(self, delta: float | None = None, *, neighbouring: str = Neighbouring.ADD_REMOVE) -> float:
        """True epsilon of one :meth:`sanitize` call at ``delta`` (default: the configured delta).

        ``neighbouring="add_remove"`` (sensitivity C) or ``"replace_one"`` (sensitivity 2C).
        """
        if self.mechanism is None:
            raise InvalidParameter("the sanitizer is disabled (config.enabled=False): no noise is added")
        delta = self.config.delta if delta is None else check_delta(delta)
        return release_epsilon(self.mechanism, delta, neighbouring)

    def clip_embeddings(self, embeddings: Any) -> tuple[np.ndarray, int, float, float]:
        """Clip every row to L2 norm ``clipping_norm``.

        Returns:
            ``(clipped, n_clipped, avg_norm_before, avg_norm_after)``: the clipped rows in the
            input's dtype, how many rows had a norm above the bound, and the mean row norms
            before and after clipping (computed in float64).

        Raises:
            UnsafeInput: not a non-empty 2-D float array, or NaN/Inf values.
        """
        clip_norm = check_positive("clipping_norm", self.config.clipping_norm)
        x = _as_embedding_matrix(embeddings)
        clipped, norms = clip_rows(x, clip_norm)
        norms = np.asarray(norms, dtype=np.float64)
        # A clipped row has norm C (to the last ulp, never above): no float64 copy of the matrix.
        after = np.minimum(norms, clip_norm)
        n_clipped = int(np.count_nonzero(norms > clip_norm))
        return clipped, n_clipped, float(norms.mean()), float(after.mean())

    def sanitize(self, embeddings: Any, seed: int | None = None) -> np.ndarray:
        """Clip every row and add calibrated Gaussian noise; dtype kept.

        When the configuration is disabled the input is returned unchanged. With ``seed`` the
        output is reproducible and **not private** (:class:`~gaussdp.errors.NotPrivateWarning`).

        Raises:
            UnsafeInput: not a non-empty 2-D float array, or NaN/Inf values (nothing released).
        """
        if not self.config.enabled or self.mechanism is None:
            return embeddings
        if seed is not None:
            seed = check_seed(seed)
        clipped, n_clipped, avg_before, avg_after = self.clip_embeddings(embeddings)
        sanitized = noise_rows(
            clipped,
            sigma=self.mechanism.sigma,
            clip_norm=self.config.clipping_norm,
            source=self.mechanism.source,
            seed=seed,
            first_row=0,
        )
        if seed is not None:
            warnings.warn(
                "sanitize(seed=...) gives reproducible noise that anyone who knows the seed can "
                "remove: the result is not private",
                NotPrivateWarning,
                stacklevel=2,
            )
        n = clipped.shape[0]
        self._sanitization_count += 1
        self._norm_sum_before += avg_before * n
        self._norm_sum_after += avg_after * n
        total = self._stats["total_embeddings_processed"] + n
        self._stats.update(
            num_sanitizations=self._sanitization_count,
            total_embeddings_processed=total,
            embeddings_clipped=self._stats["embeddings_clipped"] + n_clipped,
            avg_norm_before_clip=self._norm_sum_before / total,
            avg_norm_after_clip=self._norm_sum_after / total,
        )
        return sanitized

    def get_stats(self) -> dict[str, Any]:
        """The federated anomaly detector's five counters (averages are over every row sanitized so far)."""
        return dict(self._stats)


def _as_embedding_matrix(embeddings: Any, name: str = "embeddings") -> np.ndarray:
    if isinstance(embeddings, np.ndarray):
        x = embeddings
    else:
        try:
            x = np.asarray(embeddings)
        except ValueError as exc:  # ragged nested lists
            raise UnsafeInput(f"{name} must be a 2-D float array: {exc}") from None
    if x.dtype.kind not in "fiu" or x.dtype.kind == "b":
        raise UnsafeInput(f"{name} must be a 2-D float array, got dtype {x.dtype}")
    if x.ndim != 2:
        raise UnsafeInput(f"{name} must be a 2-D array (rows x dims), got shape {x.shape}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise UnsafeInput(f"{name} must be non-empty, got shape {x.shape}")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    return x
