"""Converters between gaussdp events and dp_accounting's ``DpEvent`` trees.

dp_accounting is a development dependency, imported only when a converter is called. Its events
carry no neighbouring relation (its accountants do), so :func:`from_dp_event` takes the relation
the tree is meant under, and :func:`to_dp_event` infers it from the gaussdp tree. The noise
multipliers follow dp_accounting's own accountants:

* ``GaussianDpEvent(s)``: add/remove: ``GaussianEvent(s)``. Under replace-one dp_accounting's PLD
  accountant uses the pair ``N(-1, s^2)``, ``N(1, s^2)`` (mu = 2/s), so it becomes
  ``GaussianEvent(s / 2)``; its RDP accountant would charge ``a / (2 s^2)``, four times less:
  gaussdp takes the larger (PLD) reading.
* ``PoissonSampledDpEvent(q, GaussianDpEvent(s))``: ``SubsampledGaussianEvent(s, q)`` under
  add/remove, ``ReplaceOneSubsampledGaussianEvent(s, q)`` under replace-one (dp_accounting's PLD).
* ``SampledWithoutReplacementDpEvent(n, b, GaussianDpEvent(s))`` (replace-one only):
  ``FixedBatchGaussianEvent(2 s, b, n)``: dp_accounting's ``s`` is relative to the replace-one
  sensitivity (two clip norms), gaussdp's to the clip norm.
* ``LaplaceDpEvent(b)``: ``LaplaceEvent(scale=b)`` (add/remove; dp_accounting's PLD refuses it
  under replace-one and so does this converter).
* ``SelfComposedDpEvent``, ``ComposedDpEvent``, ``NoOpDpEvent``: the same structure.

Everything else (non-private, unsupported, randomized response, tree aggregation, zCDP, ...) raises
:class:`~gaussdp.accounting.UnsupportedEvent`, as do gaussdp events that dp_accounting cannot
express ((epsilon, delta), loss histograms, profiles, the discrete Gaussian).
"""

from __future__ import annotations

from typing import Any

from gaussdp._neighbouring import Neighbouring, check_neighbouring
from gaussdp.accounting.base import UnsupportedEvent
from gaussdp.accounting.events import (
    ComposedEvent,
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    neighboring_relation_of,
)

__all__ = ["from_dp_event", "to_dp_event"]


def _dp_event_module() -> Any:
    try:
        from dp_accounting import dp_event
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "converting to or from dp_accounting events needs the dp-accounting package "
            "(pip install dp-accounting)"
        ) from exc
    return dp_event


def _gaussian_multiplier(de: Any, event: Any) -> float:
    if not isinstance(event, de.GaussianDpEvent):
        raise UnsupportedEvent(f"only a GaussianDpEvent can be sampled here, got {event!r}")
    return float(event.noise_multiplier)


def from_dp_event(event: Any, *, neighboring_relation: str = Neighbouring.ADD_REMOVE) -> Event:
    """The gaussdp event equivalent to a dp_accounting ``DpEvent`` tree under ``neighboring_relation``.

    >>> from dp_accounting import dp_event
    >>> from_dp_event(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)))
    SubsampledGaussianEvent(noise_multiplier=1.1, sample_rate=0.01)

    Raises:
        UnsupportedEvent: a node gaussdp has no event for, or one dp_accounting itself refuses under
            that relation; InvalidParameter: a bad relation or parameter (e.g. zero noise).
    """
    de = _dp_event_module()
    rel = check_neighbouring(neighboring_relation, "neighboring_relation")

    def conv(e: Any) -> Event:
        if isinstance(e, de.NoOpDpEvent):
            return ComposedEvent(())
        if isinstance(e, de.SelfComposedDpEvent):
            return SelfComposedEvent(conv(e.event), e.count)
        if isinstance(e, de.ComposedDpEvent):
            return ComposedEvent(tuple(conv(x) for x in e.events))
        if isinstance(e, de.GaussianDpEvent):
            s = float(e.noise_multiplier)
            return GaussianEvent(s if rel == Neighbouring.ADD_REMOVE else s / 2.0)
        if isinstance(e, de.LaplaceDpEvent):
            if rel != Neighbouring.ADD_REMOVE:
                raise UnsupportedEvent("dp_accounting accounts LaplaceDpEvent under add/remove only")
            return LaplaceEvent(scale=float(e.noise_multiplier))
        if isinstance(e, de.PoissonSampledDpEvent):
            s = _gaussian_multiplier(de, e.event)
            q = float(e.sampling_probability)
            if rel == Neighbouring.ADD_REMOVE:
                return SubsampledGaussianEvent(s, q)
            return ReplaceOneSubsampledGaussianEvent(s, q)
        if isinstance(e, de.SampledWithoutReplacementDpEvent):
            if rel != Neighbouring.REPLACE_ONE:
                raise UnsupportedEvent("SampledWithoutReplacementDpEvent is accounted under replace-one only")
            s = _gaussian_multiplier(de, e.event)
            return FixedBatchGaussianEvent(2.0 * s, e.sample_size, e.source_dataset_size)
        raise UnsupportedEvent(f"gaussdp has no event for {e!r}")

    if not isinstance(event, de.DpEvent):
        raise TypeError(f"event must be a dp_accounting DpEvent, got event={event!r}")
    return conv(event)


def to_dp_event(event: Event) -> Any:
    """The dp_accounting ``DpEvent`` tree equivalent to a gaussdp event (inverse of :func:`from_dp_event`).

    Account it with dp_accounting under ``neighboring_relation_of(event)`` (add/remove where that is
    ``None``); Gaussian leaves of a replace-one tree carry twice their noise multiplier (see the
    module docstring).

    Raises:
        UnsupportedEvent: a leaf dp_accounting has no event for.
    """
    de = _dp_event_module()
    rel = neighboring_relation_of(event) or Neighbouring.ADD_REMOVE

    def conv(e: Event) -> Any:
        if isinstance(e, SelfComposedEvent):
            return de.SelfComposedDpEvent(conv(e.event), e.count)
        if isinstance(e, ComposedEvent):
            return de.ComposedDpEvent([conv(x) for x in e.events]) if e.events else de.NoOpDpEvent()
        if isinstance(e, GaussianEvent):
            return de.GaussianDpEvent(
                e.noise_multiplier if rel == Neighbouring.ADD_REMOVE else 2.0 * e.noise_multiplier
            )
        if isinstance(e, SubsampledGaussianEvent | ReplaceOneSubsampledGaussianEvent):
            return de.PoissonSampledDpEvent(e.sample_rate, de.GaussianDpEvent(e.noise_multiplier))
        if isinstance(e, FixedBatchGaussianEvent):
            return de.SampledWithoutReplacementDpEvent(
                e.dataset_size, e.batch_size, de.GaussianDpEvent(e.noise_multiplier / 2.0)
            )
        if isinstance(e, LaplaceEvent):
            if rel != Neighbouring.ADD_REMOVE:
                raise UnsupportedEvent("dp_accounting accounts LaplaceDpEvent under add/remove only")
            return de.LaplaceDpEvent(e.scale / e.sensitivity)
        raise UnsupportedEvent(f"dp_accounting has no event for {e!r}")

    return conv(event)
