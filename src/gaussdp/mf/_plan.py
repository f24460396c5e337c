"""A banded-MF training plan: the strategy for a run's steps, bands and participation, and its cost."""

from __future__ import annotations

import dataclasses

import numpy as np

from gaussdp._validate import check_counts, check_positive
from gaussdp.accounting import GaussianEvent, banded_matrix_factorization_event
from gaussdp.errors import InvalidParameter
from gaussdp.mf._strategy import banded_toeplitz_coefficients, toeplitz_matrix

__all__ = ["MAX_STEPS", "BandedMFPlan", "strategy_sensitivity"]

MAX_STEPS = 8192  # steps of one plan: the accounting's dense strategy matrix is at most 512 MiB


def strategy_sensitivity(
    strategy: np.ndarray, *, bands: int, min_separation: int, max_participations: int
) -> float:
    """L2 sensitivity of ``C x`` (per unit clip norm) when a record takes part in at most
    ``max_participations`` steps, at least ``min_separation`` apart.

    Computed by the accounting's own search (:func:`gaussdp.accounting.banded_matrix_factorization_event`,
    exact when ``min_separation >= bands`` or the windowed search fits its work limit, an upper
    bound otherwise), and rounded up: it is ``1 / noise_multiplier`` of that event at noise
    multiplier 1, whose noise multiplier is rounded down.

    >>> import numpy as np
    >>> round(strategy_sensitivity(np.eye(4), bands=1, min_separation=1, max_participations=4), 9)
    2.0
    """
    event = banded_matrix_factorization_event(
        1.0, strategy, bands=bands, min_separation=min_separation, max_participations=max_participations
    )
    return 1.0 / event.noise_multiplier


@dataclasses.dataclass(frozen=True)
class BandedMFPlan:
    """A run of ``steps`` steps with a ``bands``-banded Toeplitz strategy and cyclic participation.

    Participation: each record takes part in at most ``max_participations`` steps, at least
    ``min_separation`` apart; a run of ``epochs`` epochs of ``steps_per_epoch`` fixed batches in a
    fixed order is ``max_participations = epochs``, ``min_separation = steps_per_epoch``
    (:meth:`cyclic`). The strategy is optimised for ``min_separation >= bands`` (required here: then
    a record's columns of ``C`` do not overlap and the optimised loss is the true error); its
    sensitivity is computed from the matrix by the accounting (:func:`strategy_sensitivity`).

    Guarantee of the mechanism ``C x + N(0, (noise_multiplier * clip_norm)^2)`` under zero-out of
    one record (its clipped gradients replaced by zero in the steps it takes part in; the relation of
    DP-FTRL and MF training, Kairouz et al. 2021, Section 2): the event :meth:`event`, a Gaussian of
    noise multiplier ``noise_multiplier / sensitivity``. Prefixes: the first ``m`` steps are a
    release of ``C[:m, :m] x[:m]`` (``C`` is lower triangular), charged by ``event(..., upto=m)``;
    adaptively chosen gradients do not change this (Denisov, McMahan, Rush, Smith & Thakurta 2022,
    Theorem 2.1).

    Bounded work: the accounting takes the dense ``steps x steps`` strategy, so ``steps`` is at most
    :data:`MAX_STEPS` (8,192: a 512 MiB matrix at most, built once per epoch by the engine).

    Raises:
        InvalidParameter: a count < 1, ``bands`` above ``min_separation`` or ``steps``, ``steps``
            above :data:`MAX_STEPS`.
    """

    steps: int
    bands: int
    min_separation: int
    max_participations: int

    def __post_init__(self) -> None:
        check_counts(
            steps=self.steps,
            bands=self.bands,
            min_separation=self.min_separation,
            max_participations=self.max_participations,
        )
        if self.bands > self.min_separation:
            raise InvalidParameter(
                f"bands must be <= min_separation (the steps between two participations of a record, "
                f"the steps per epoch), got bands={self.bands}, min_separation={self.min_separation}"
            )
        if self.steps > MAX_STEPS:
            raise InvalidParameter(
                f"steps must be <= {MAX_STEPS} for banded MF (the accounting builds the dense strategy), "
                f"got steps={self.steps}: use fewer epochs or larger batches"
            )
        if self.bands > self.steps:
            raise InvalidParameter(f"bands must be <= steps, got bands={self.bands}, steps={self.steps}")

    @classmethod
    def cyclic(cls, *, steps_per_epoch: int, epochs: int, bands: int) -> BandedMFPlan:
        """``epochs`` passes over fixed batches in a fixed order, ``steps_per_epoch`` steps each."""
        check_counts(steps_per_epoch=steps_per_epoch, epochs=epochs, bands=bands)
        return cls(
            steps=steps_per_epoch * epochs,
            bands=bands,
            min_separation=steps_per_epoch,
            max_participations=epochs,
        )

    @property
    def coefficients(self) -> np.ndarray:
        """The optimised ``c_0 .. c_{b-1}`` (cached per ``(steps, bands)``)."""
        return banded_toeplitz_coefficients(steps=self.steps, bands=self.bands)

    def matrix(self, upto: int | None = None) -> np.ndarray:
        """``C[:upto, :upto]`` (the whole ``steps x steps`` strategy by default)."""
        m = self.steps if upto is None else upto
        return toeplitz_matrix(self.coefficients, m)

    def sensitivity(self, upto: int | None = None) -> float:
        """Sensitivity of the first ``upto`` steps' release (all of them by default)."""
        return strategy_sensitivity(
            self.matrix(upto),
            bands=self.bands,
            min_separation=self.min_separation,
            max_participations=self.max_participations,
        )

    def event(self, noise_multiplier: float, *, upto: int | None = None) -> GaussianEvent:
        """The accounting's event for the first ``upto`` steps (the whole run by default)."""
        check_positive("noise_multiplier", noise_multiplier)
        m = self.steps if upto is None else upto
        if not 1 <= m <= self.steps:
            raise InvalidParameter(f"upto must be in [1, steps={self.steps}], got upto={upto}")
        return banded_matrix_factorization_event(
            noise_multiplier,
            self.matrix(m),
            bands=self.bands,
            min_separation=self.min_separation,
            max_participations=self.max_participations,
        )
