"""Immutable records of what was released: the events that accountants turn into epsilon.

An event says which mechanism ran, never what it cost: the cost depends on the accountant. Every
event is a frozen dataclass, validated on construction, hashable (so accountants can group repeats),
and round-trips through plain JSON-able dicts (``to_dict()`` / :func:`event_from_dict`, both read
from the dataclass fields: a new event kind is its class alone) so that a ledger can store it in a
database; :func:`event_json` is the one canonical JSON of an event (sorted keys, compact).

Neighbouring relation: **add/remove of one record** unless an event says otherwise. Each event
class declares ``neighboring_relation``, a :class:`~gaussdp._neighbouring.Neighbouring`:
``"add_remove"`` (Poisson-subsampled Gaussian steps), ``"replace_one"`` (fixed-size batches,
replace-one Poisson steps: the dataset size is public and one record is substituted), or ``None``
for mechanisms whose guarantee is stated in terms of the sensitivity under whichever relation the
composition uses (Gaussian, Laplace, discrete Gaussian, (epsilon, delta), privacy-loss histograms).
An accountant refuses to compose events of both relations. For a Gaussian event the query has
L2 sensitivity 1 under the relation in force once the noise is expressed as a noise multiplier
(sigma / sensitivity); under replace-one the sensitivity of a clipped sum is twice the clip norm,
so a :class:`GaussianEvent` for such a sum carries half the noise multiplier. The replace-one
*sampled* events below instead take the DP-SGD noise multiplier (noise standard deviation / clip
norm) and account for the doubling themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gaussdp._neighbouring import Neighbouring
from gaussdp._validate import check_delta, check_positive, check_probability, real_number
from gaussdp.errors import InvalidParameter

__all__ = [
    "ComposedEvent",
    "DiscreteGaussianEvent",
    "EpsilonDeltaEvent",
    "Event",
    "FixedBatchGaussianEvent",
    "GaussianEvent",
    "LaplaceEvent",
    "PrivacyLossDistributionEvent",
    "PrivacyProfileEvent",
    "ReplaceOneSubsampledGaussianEvent",
    "SelfComposedEvent",
    "SubsampledGaussianEvent",
    "event_from_dict",
    "event_json",
    "flatten_event",
    "neighboring_relation_of",
]


#: The noise multipliers (noise standard deviation / L2 sensitivity) the Gaussian events accept.
#: Below 1e-4 one sampled record's privacy loss exceeds 5e7 nats: no grid resolves it next to the
#: unsampled records' losses near 0, and a plain release costs epsilon > 1e6. Above 1e12 the loss is
#: below 1e-24 nats, under the resolution of every accountant (and mu under the closed form's 1e-12).
NOISE_MULTIPLIER_MIN = 1e-4
NOISE_MULTIPLIER_MAX = 1e12


def check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """A noise multiplier in [:data:`NOISE_MULTIPLIER_MIN`, :data:`NOISE_MULTIPLIER_MAX`] (1e-4 to 1e12)."""
    out = check_positive(name, value)
    if not NOISE_MULTIPLIER_MIN <= out <= NOISE_MULTIPLIER_MAX:
        raise InvalidParameter(
            f"{name} must be in [{NOISE_MULTIPLIER_MIN:g}, {NOISE_MULTIPLIER_MAX:g}], got {name}={value!r}: "
            "outside it no accountant certifies a bound"
        )
    return out


class Event:
    """Base class of every event. Subclasses are frozen dataclasses with a ``kind`` tag."""

    kind: ClassVar[str] = "event"
    #: The neighbouring relation the event's guarantee is stated under; ``None``: whichever the
    #: composition uses (the mechanism is described through its sensitivity under that relation).
    neighboring_relation: ClassVar[Neighbouring | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every event class of this module that names its own kind is serialisable by that kind:
        # a new event is its class, nothing else (to_dict and event_from_dict read its fields).
        if "kind" in cls.__dict__ and cls.__module__ == __name__:
            if cls.kind in _KINDS:
                raise TypeError(f"event kind {cls.kind!r} is taken by {_KINDS[cls.kind].__name__}")
            _KINDS[cls.kind] = cls

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that :func:`event_from_dict` turns back into an equal event.

        ``{"type": kind, field: value, ...}`` over the dataclass fields in order: nested events as
        their dicts, tuples as lists.
        """
        out: dict[str, Any] = {"type": self.kind}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            out[name] = value if isinstance(value, _PLAIN) else _encode(value)
        return out


# kind -> event class, filled as the classes below are defined (Event.__init_subclass__).
_KINDS: dict[str, type[Event]] = {}


_PLAIN = (float, int, str)  # JSON values as they are (a ledger serialises every charge's event)
_FIELD_NAMES: dict[type[Event], tuple[str, ...]] = {}


def _field_names(cls: type[Event]) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return names


def _encode(value: Any) -> Any:
    if isinstance(value, Event):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


@dataclass(frozen=True)
class GaussianEvent(Event):
    """One release ``f(D) + N(0, (noise_multiplier * Delta)^2 I)`` of a query of L2 sensitivity Delta.

    Exactly ``mu``-GDP with ``mu = 1 / noise_multiplier`` under add/remove of one record (Dong, Roth
    & Su 2019, Theorem 2.7); ``k`` such releases are ``sqrt(k) / noise_multiplier``-GDP.
    """

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))


@dataclass(frozen=True)
class _PoissonGaussianFields(Event):
    """The fields of a Gaussian step on a Poisson subsample (the neighbouring relation is the
    subclass's: the two subclasses are distinct events, never instances of each other)."""

    noise_multiplier: float
    sample_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", check_probability("sample_rate", self.sample_rate))


@dataclass(frozen=True)
class SubsampledGaussianEvent(_PoissonGaussianFields):
    """A Gaussian release on a Poisson subsample: each record is included independently w.p. q.

    This is one step of DP-SGD: clipped per-example gradients of the sampled records are summed and
    ``N(0, (noise_multiplier * clip_norm)^2 I)`` is added. With ``sample_rate=1`` it is a
    :class:`GaussianEvent`. Neighbouring relation: add/remove of one record.
    """

    kind: ClassVar[str] = "subsampled_gaussian"
    neighboring_relation: ClassVar[Neighbouring | None] = Neighbouring.ADD_REMOVE


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


@dataclass(frozen=True)
class ReplaceOneSubsampledGaussianEvent(_PoissonGaussianFields):
    """A DP-SGD step on a Poisson subsample, under **replace-one** (substitution) neighbours.

    Each record is included independently with probability ``sample_rate``; the clipped (L2 norm
    at most ``clip_norm``) contributions of the included records are summed and
    ``N(0, (noise_multiplier * clip_norm)^2 I)`` is added. ``noise_multiplier`` is the DP-SGD one
    (noise standard deviation / clip norm): replacing a record moves its contribution by up to
    ``2 * clip_norm``, which this event accounts for. Dominating pair: ``(1-q) N(0, s^2) + q N(-1,
    s^2)`` against ``(1-q) N(0, s^2) + q N(1, s^2)`` with ``s = noise_multiplier`` (the pair
    dp_accounting's PLD uses for ``PoissonSampledDpEvent`` under ``REPLACE_ONE``).
    """

    kind: ClassVar[str] = "replace_one_subsampled_gaussian"
    neighboring_relation: ClassVar[Neighbouring | None] = Neighbouring.REPLACE_ONE


@dataclass(frozen=True)
class FixedBatchGaussianEvent(Event):
    """A DP-SGD step on a fixed-size batch drawn without replacement, under replace-one neighbours.

    ``batch_size`` records are drawn uniformly without replacement from the ``dataset_size``
    records (shuffled fixed batches; a federated cohort of fixed size); their clipped contributions
    (L2 norm at most ``clip_norm``) are summed and ``N(0, (noise_multiplier * clip_norm)^2 I)`` is
    added. The dataset size is public, so the neighbouring relation is **replace-one**: ``noise_
    multiplier`` is the DP-SGD one (std / clip norm), and a replacement moves the sum by up to
    ``2 * clip_norm``. (dp_accounting's ``SampledWithoutReplacementDpEvent(dataset_size,
    batch_size, GaussianDpEvent(noise_multiplier / 2))`` describes the same step: its noise
    multiplier is relative to the replace-one sensitivity ``2 * clip_norm``.)
    """

    noise_multiplier: float
    batch_size: int
    dataset_size: int
    kind: ClassVar[str] = "fixed_batch_gaussian"
    neighboring_relation: ClassVar[Neighbouring | None] = Neighbouring.REPLACE_ONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        b = check_count(self.batch_size, "batch_size")
        n = check_count(self.dataset_size, "dataset_size")
        if b > n:
            raise InvalidParameter(
                f"batch_size must be <= dataset_size, got batch_size={b!r}, dataset_size={n!r}"
            )
        object.__setattr__(self, "batch_size", b)
        object.__setattr__(self, "dataset_size", n)

    @property
    def sample_rate(self) -> float:
        """The probability ``batch_size / dataset_size`` that a given record is in the batch."""
        return self.batch_size / self.dataset_size


@dataclass(frozen=True)
class LaplaceEvent(Event):
    """One release ``f(D) + Laplace(scale)`` per coordinate of a query of L1 sensitivity ``sensitivity``.

    Pure ``epsilon = sensitivity / scale``-DP under the relation the sensitivity is measured in
    (Dwork, McSherry, Nissim & Smith 2006); accountants use its exact privacy loss distribution
    (losses in ``[-epsilon, epsilon]``) and its exact RDP (Mironov 2017, Proposition 6). dp_accounting's
    ``LaplaceDpEvent(noise_multiplier)`` is ``LaplaceEvent(scale=noise_multiplier)``.
    """

    scale: float
    sensitivity: float = 1.0
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_positive("scale", self.scale))
        object.__setattr__(self, "sensitivity", check_positive("sensitivity", self.sensitivity))

    @property
    def epsilon(self) -> float:
        """The pure-DP epsilon ``sensitivity / scale`` (the largest privacy loss)."""
        return self.sensitivity / self.scale


@dataclass(frozen=True)
class DiscreteGaussianEvent(Event):
    """One release ``f(D) + Y`` of an integer-valued query, ``Y`` discrete Gaussian on the integers.

    ``P(Y = y)`` is proportional to ``exp(-y^2 / (2 sigma^2))`` (``sigma`` is the parameter, not
    quite the standard deviation) and ``|f(D) - f(D')| <= sensitivity`` (an integer) under the
    relation in force: the noise of secure aggregation with integer (modular) arithmetic
    (Canonne, Kamath & Steinke 2020; Kairouz, Liu & Steinke 2021). Accountants use its exact
    privacy loss distribution (atoms ``(sensitivity^2 - 2 y sensitivity) / (2 sigma^2)`` with
    probability ``P(Y = y)``) and, for RDP, its ``(sensitivity / sigma)^2 / 2``-concentrated DP.
    """

    sigma: float
    sensitivity: int = 1
    kind: ClassVar[str] = "discrete_gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigma", check_positive("sigma", self.sigma))
        object.__setattr__(self, "sensitivity", check_count(self.sensitivity, "sensitivity"))


def _float_tuple(name: str, values: Any) -> tuple[float, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of numbers, got {name}={values!r}")
    out = tuple(real_number(f"{name}[{i}]", v) for i, v in enumerate(values))
    if not out:
        raise InvalidParameter(f"{name} must not be empty")
    return out


@dataclass(frozen=True)
class PrivacyLossDistributionEvent(Event):
    """A mechanism given by the privacy loss distribution of a dominating pair ``(P, Q)``.

    Mass ``probabilities[i]`` at privacy loss ``losses[i] = ln(P(o)/Q(o))`` (o drawn from P); the
    rest of P's mass, ``1 - sum(probabilities)``, is at loss +infinity. The pair must dominate the
    mechanism for *every ordered* pair of neighbours (``H_a(M(D)||M(D')) <= H_a(P||Q)`` for all a >=
    0), as dp_accounting's PLDs do; it is checked to be a valid PLD (``E[e^-L] <= 1``). The PLD
    accountant discretises its exact profile ``delta(eps) = sum_i p_i (1 - e^{eps - l_i})_+ + p_inf``
    pessimistically (connect the dots), so the answer stays an upper bound.
    """

    losses: tuple[float, ...]
    probabilities: tuple[float, ...]
    kind: ClassVar[str] = "privacy_loss_distribution"

    def __post_init__(self) -> None:
        losses = _float_tuple("losses", self.losses)
        probs = _float_tuple("probabilities", self.probabilities)
        if len(losses) != len(probs):
            raise InvalidParameter(
                f"losses and probabilities must have the same length, got {len(losses)} and {len(probs)}"
            )
        if any(not math.isfinite(v) for v in losses):
            raise InvalidParameter("losses must be finite (leave the mass at +infinity out)")
        if any(not (0.0 <= p <= 1.0) for p in probs) or math.fsum(probs) > 1.0 + 1e-12:
            raise InvalidParameter(
                f"probabilities must be in [0, 1] and sum to <= 1, got sum={math.fsum(probs)!r}"
            )
        if math.fsum(p * math.exp(-min(v, 700.0)) for v, p in zip(losses, probs, strict=True)) > 1.0 + 1e-9:
            raise InvalidParameter(
                "not a privacy loss distribution: E[exp(-loss)] > 1 (Q would have mass > 1)"
            )
        object.__setattr__(self, "losses", losses)
        object.__setattr__(self, "probabilities", probs)

    @classmethod
    def from_probability_mass_functions(
        cls, p: Iterable[float], q: Iterable[float]
    ) -> PrivacyLossDistributionEvent:
        """The PLD of the pair (P, Q) of probability vectors on the same finite outcomes.

        Outcomes where Q is 0 and P is not carry loss +infinity; where P is 0 they carry no mass.
        """
        pp, qq = _float_tuple("p", p), _float_tuple("q", q)
        if len(pp) != len(qq):
            raise InvalidParameter(f"p and q must have the same length, got {len(pp)} and {len(qq)}")
        if any(v < 0 for v in pp + qq) or math.fsum(pp) > 1 + 1e-12 or math.fsum(qq) > 1 + 1e-12:
            raise InvalidParameter("p and q must be probability vectors")
        pairs = [(math.log(a) - math.log(b), a) for a, b in zip(pp, qq, strict=True) if a > 0 and b > 0]
        if not pairs:
            raise InvalidParameter("P and Q have no outcome in common: the mechanism is not private")
        return cls(tuple(v for v, _ in pairs), tuple(w for _, w in pairs))


@dataclass(frozen=True)
class PrivacyProfileEvent(Event):
    """A mechanism known only to be ``(epsilons[i], deltas[i])``-DP for every i (a sampled profile).

    The accountants use the least private mechanism with that guarantee: the tight pair of the
    trade-off function ``max_i f_{eps_i, delta_i}`` (Kairouz, Oh & Viswanath 2015 for one pair),
    whose privacy profile, as a function of ``e^eps``, is the lower convex hull of the points, of
    ``(0, 1)`` and of their mirror images ``(e^-eps_i, 1 - e^-eps_i (1 - delta_i))``, flat beyond
    the last point. Any epsilon-delta curve a user holds (a profile from another library, a table)
    composes through it, and the result stays an upper bound.
    """

    epsilons: tuple[float, ...]
    deltas: tuple[float, ...]
    kind: ClassVar[str] = "privacy_profile"

    def __post_init__(self) -> None:
        eps = _float_tuple("epsilons", self.epsilons)
        dl = _float_tuple("deltas", self.deltas)
        if len(eps) != len(dl):
            raise InvalidParameter(
                f"epsilons and deltas must have the same length, got {len(eps)} and {len(dl)}"
            )
        if any(not (0.0 <= e <= 700.0) for e in eps):
            raise InvalidParameter("epsilons must be in [0, 700]")
        if any(not (0.0 <= d < 1.0) for d in dl):
            raise InvalidParameter("deltas must be in [0, 1)")
        object.__setattr__(self, "epsilons", eps)
        object.__setattr__(self, "deltas", dl)


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


def check_count(count: Any, name: str = "count") -> int:
    """A composition count: an integer >= 1 (bools refused)."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {name}={count!r}")
    if int(count) < 1:
        raise InvalidParameter(f"{name} must be >= 1, got {name}={count!r}")
    return int(count)


def flatten_event(event: Event, count: int = 1) -> Iterator[tuple[Event, int]]:
    """Yield ``(leaf_event, count)`` pairs; leaves are the events of every kind but the compositions.

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
    elif isinstance(event, _leaf_classes()):
        yield event, count
    elif isinstance(event, Event):
        raise InvalidParameter(f"unknown event type {type(event).__name__}")
    else:
        raise TypeError(f"event must be a gaussdp Event, got event={event!r}")


_COMPOSITIONS = (SelfComposedEvent, ComposedEvent)


@functools.cache
def _leaf_classes() -> tuple[type[Event], ...]:
    """Every registered event kind but the two compositions: the mechanisms accountants bound."""
    return tuple(cls for cls in _KINDS.values() if cls not in _COMPOSITIONS)


def neighboring_relation_of(event: Event) -> Neighbouring | None:
    """The neighbouring relation ``event``'s leaves fix (``None``: any), refusing a mix of both.

    Raises:
        InvalidParameter: the event mixes add/remove and replace-one leaves.
    """
    rels = {leaf.neighboring_relation for leaf, _ in flatten_event(event)} - {None}
    if len(rels) > 1:
        raise InvalidParameter(
            f"event mixes neighbouring relations {sorted(str(r) for r in rels if r)}: an add/remove "
            "guarantee and a replace-one guarantee do not compose into either"
        )
    return rels.pop() if rels else None


_DECODERS: dict[type[Event], tuple[tuple[str, Any, Callable[[Any], Any]], ...]] = {}


def _field_decoders(cls: type[Event]) -> tuple[tuple[str, Any, Callable[[Any], Any]], ...]:
    """``(name, default or MISSING, decode)`` per dataclass field of ``cls``, in order.

    A field typed ``Event`` holds a nested event dict, one typed ``tuple[Event, ...]`` a list of
    them; every other value goes to the constructor as it is (the constructor validates it). A
    field with a plain default may be left out of the dict; one with a default factory may not.
    """
    hit = _DECODERS.get(cls)
    if hit is not None:
        return hit
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every concrete event is a dataclass
        hint = hints[f.name]
        decode: Callable[[Any], Any]
        if hint is Event:
            decode = event_from_dict
        elif typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is Event:
            decode = _decode_events
        else:
            decode = _as_is
        out.append((f.name, f.default, decode))
    _DECODERS[cls] = tuple(out)
    return _DECODERS[cls]


def _decode_events(values: Iterable[Any]) -> tuple[Event, ...]:
    return tuple(event_from_dict(v) for v in values)


def _as_is(value: Any) -> Any:
    return value


def event_from_dict(d: Mapping[str, Any]) -> Event:
    """Rebuild an event from :meth:`Event.to_dict` output (validated like the constructors).

    >>> event_from_dict(SubsampledGaussianEvent(1.1, 0.01).to_dict())
    SubsampledGaussianEvent(noise_multiplier=1.1, sample_rate=0.01)
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"event dict must be a mapping, got {d!r}")
    kind = d.get("type")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidParameter(f"unknown event type {kind!r} in event dict")
    decoders = _field_decoders(cls)
    unknown = sorted(set(d) - {"type"} - {name for name, _, _ in decoders})
    if unknown:
        # fail closed: a misspelt field must not fall back to its default (a count of 1, say)
        raise InvalidParameter(f"event dict of type {kind!r} has unknown fields {unknown}")
    args = []
    for name, default, decode in decoders:
        if name in d:
            args.append(decode(d[name]))
        elif default is not dataclasses.MISSING:
            args.append(default)
        else:
            raise InvalidParameter(f"event dict of type {kind!r} lacks the field {name!r}")
    return cls(*args)


def event_json(event: Event | Mapping[str, Any]) -> str:
    """The canonical JSON of an event (or of its :meth:`~Event.to_dict`): sorted keys, compact.

    Equal events give equal strings: ledgers group charges by it and compare stored events with it.

    >>> event_json(GaussianEvent(2.0))
    '{"noise_multiplier":2.0,"type":"gaussian"}'
    """
    d = event.to_dict() if isinstance(event, Event) else event
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
