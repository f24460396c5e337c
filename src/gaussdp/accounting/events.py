"""Immutable records of what was released: the events that accountants turn into epsilon.

An event says which mechanism ran, never what it cost: the cost depends on the accountant. Every
event is a frozen dataclass, validated on construction, hashable (so accountants can group repeats),
and round-trips through plain JSON-able dicts (``to_dict()`` / :func:`event_from_dict`) so that a
ledger can store it in a database.

Neighbouring relation: **add/remove of one record**, in every event and every accountant of
gaussdp. For a Gaussian event the query has L2 sensitivity 1 under that relation once the noise is
expressed as a noise multiplier (sigma / sensitivity). Under replace-one (substitution) the
sensitivity of a clipped sum doubles; express that by halving the noise multiplier.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gaussdp._validate import check_delta, check_positive, check_probability, real_number
from gaussdp.errors import InvalidParameter

__all__ = [
    "ComposedEvent",
    "EpsilonDeltaEvent",
    "Event",
    "GaussianEvent",
    "SelfComposedEvent",
    "SubsampledGaussianEvent",
    "event_from_dict",
    "flatten_event",
]


class Event:
    """Base class of every event. Subclasses are frozen dataclasses with a ``kind`` tag."""

    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that :func:`event_from_dict` turns back into an equal event."""
        raise NotImplementedError


@dataclass(frozen=True)
class GaussianEvent(Event):
    """One release ``f(D) + N(0, (noise_multiplier * Delta)^2 I)`` of a query of L2 sensitivity Delta.

    Exactly ``mu``-GDP with ``mu = 1 / noise_multiplier`` under add/remove of one record (Dong, Roth
    & Su 2019, Theorem 2.7); ``k`` such releases are ``sqrt(k) / noise_multiplier``-GDP.
    """

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "noise_multiplier": self.noise_multiplier}


@dataclass(frozen=True)
class SubsampledGaussianEvent(Event):
    """A Gaussian release on a Poisson subsample: each record is included independently w.p. q.

    This is one step of DP-SGD: clipped per-example gradients of the sampled records are summed and
    ``N(0, (noise_multiplier * clip_norm)^2 I)`` is added. With ``sample_rate=1`` it is a
    :class:`GaussianEvent`. Neighbouring relation: add/remove of one record.
    """

    noise_multiplier: float
    sample_rate: float
    kind: ClassVar[str] = "subsampled_gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )
        object.__setattr__(self, "sample_rate", check_probability("sample_rate", self.sample_rate))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
        }


@dataclass(frozen=True)
class EpsilonDeltaEvent(Event):
    """A mechanism known only to be (epsilon, delta)-DP (add/remove), e.g. a spend recorded by hand.

    Accountants that need the mechanism itself (RDP with delta > 0, GDP) refuse it; basic, advanced
    and PLD (through the tight privacy loss distribution of an (epsilon, delta)-DP mechanism,
    Kairouz, Oh & Viswanath 2015) accept it.
    """

    epsilon: float
    delta: float = 0.0
    kind: ClassVar[str] = "epsilon_delta"

    def __post_init__(self) -> None:
        eps = real_number("epsilon", self.epsilon)
        if eps < 0.0:
            raise InvalidParameter(f"epsilon must be >= 0, got epsilon={self.epsilon!r}")
        d = real_number("delta", self.delta)
        if d != 0.0:
            d = check_delta(d)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", d)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "epsilon": self.epsilon, "delta": self.delta}


@dataclass(frozen=True)
class SelfComposedEvent(Event):
    """``event`` repeated ``count`` times (adaptively chosen, independent noise each time)."""

    event: Event
    count: int
    kind: ClassVar[str] = "self_composed"

    def __post_init__(self) -> None:
        if not isinstance(self.event, Event):
            raise TypeError(f"event must be a gaussdp Event, got event={self.event!r}")
        object.__setattr__(self, "count", check_count(self.count))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "event": self.event.to_dict(), "count": self.count}


@dataclass(frozen=True)
class ComposedEvent(Event):
    """The adaptive composition of several events, in order."""

    events: tuple[Event, ...] = field(default_factory=tuple)
    kind: ClassVar[str] = "composed"

    def __post_init__(self) -> None:
        events = tuple(self.events)
        for i, e in enumerate(events):
            if not isinstance(e, Event):
                raise TypeError(f"events[{i}] must be a gaussdp Event, got {e!r}")
        object.__setattr__(self, "events", events)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "events": [e.to_dict() for e in self.events]}


def check_count(count: Any, name: str = "count") -> int:
    """A composition count: an integer >= 1 (bools refused)."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {name}={count!r}")
    if int(count) < 1:
        raise InvalidParameter(f"{name} must be >= 1, got {name}={count!r}")
    return int(count)


def flatten_event(event: Event, count: int = 1) -> Iterator[tuple[Event, int]]:
    """Yield ``(leaf_event, count)`` pairs; leaves are Gaussian, subsampled or (epsilon, delta) events.

    A subsampled event with ``sample_rate == 1`` is yielded as the equivalent :class:`GaussianEvent`
    so that every accountant can apply the exact closed form to it.
    """
    if isinstance(event, SelfComposedEvent):
        yield from flatten_event(event.event, count * event.count)
    elif isinstance(event, ComposedEvent):
        for e in event.events:
            yield from flatten_event(e, count)
    elif isinstance(event, SubsampledGaussianEvent) and event.sample_rate == 1.0:
        yield GaussianEvent(event.noise_multiplier), count
    elif isinstance(event, GaussianEvent | SubsampledGaussianEvent | EpsilonDeltaEvent):
        yield event, count
    elif isinstance(event, Event):
        raise InvalidParameter(f"unknown event type {type(event).__name__}")
    else:
        raise TypeError(f"event must be a gaussdp Event, got event={event!r}")


def _field(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise InvalidParameter(f"event dict of type {d.get('type')!r} lacks the field {key!r}")
    return d[key]


def event_from_dict(d: Mapping[str, Any]) -> Event:
    """Rebuild an event from :meth:`Event.to_dict` output (validated like the constructors).

    >>> event_from_dict(SubsampledGaussianEvent(1.1, 0.01).to_dict())
    SubsampledGaussianEvent(noise_multiplier=1.1, sample_rate=0.01)
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"event dict must be a mapping, got {d!r}")
    kind = d.get("type")
    if kind == GaussianEvent.kind:
        return GaussianEvent(_field(d, "noise_multiplier"))
    if kind == SubsampledGaussianEvent.kind:
        return SubsampledGaussianEvent(_field(d, "noise_multiplier"), _field(d, "sample_rate"))
    if kind == EpsilonDeltaEvent.kind:
        return EpsilonDeltaEvent(_field(d, "epsilon"), d.get("delta", 0.0))
    if kind == SelfComposedEvent.kind:
        return SelfComposedEvent(event_from_dict(_field(d, "event")), _field(d, "count"))
    if kind == ComposedEvent.kind:
        events: Iterable[Any] = _field(d, "events")
        return ComposedEvent(tuple(event_from_dict(e) for e in events))
    raise InvalidParameter(f"unknown event type {kind!r} in event dict")
