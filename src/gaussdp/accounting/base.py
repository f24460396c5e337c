"""The accountant interface every backend implements (the ``accountant(name)`` factory is in
:mod:`gaussdp.accounting.registry`).

An accountant turns the events composed into it into a privacy profile: ``epsilon(delta)`` and
``delta(epsilon)``, always an upper bound on the true one (never below it), under the neighbouring
relation its events fix: add/remove of one record (Poisson-subsampled steps), replace-one (fixed-size
batches), or the one the sensitivities of relation-free events are measured in. An accountant
refuses to compose events of both relations (see :mod:`gaussdp.accounting.events`).

Composition is commutative, so an accountant keeps the *multiset* of events (a dict from leaf event
to its total count) plus a run-length history for reports: composing one more step costs O(1), and
the profile is recomputed lazily, only when asked, from the distinct events and their counts.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Self

import numpy as np

from gaussdp._lazy import lazy_module
from gaussdp._neighbouring import Neighbouring
from gaussdp._validate import check_delta, real_number
from gaussdp.accounting.events import (
    EpsilonDeltaEvent,
    Event,
    GaussianEvent,
    check_count,
    flatten_event,
    neighboring_relation_of,
)
from gaussdp.errors import InvalidParameter, NumericalFault

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = [
    "Accountant",
    "UnsupportedEvent",
]

# Larger epsilons are refused with a clear error rather than reported as inf or garbage.
EPSILON_MAX = 1e6


class UnsupportedEvent(InvalidParameter):
    """This accountant cannot bound this kind of event (e.g. RDP for an (epsilon, delta>0) event)."""


class Accountant(abc.ABC):
    """Composes events and answers ``epsilon(delta)`` / ``delta(epsilon)`` as upper bounds.

    Subclasses implement ``_supports_leaf``, ``_epsilon`` and ``_delta``; this class validates every
    argument and the whole event before any state changes, keeps the multiset of composed events,
    and caches answers until the next ``compose``.
    """

    name: ClassVar[str] = ""
    #: True only for accountants whose answer is not a proven upper bound (GDP via the CLT).
    approximate: ClassVar[bool] = False

    def __init__(self) -> None:
        self._counts: dict[Event, int] = {}
        self._history: list[tuple[Event, int]] = []
        self._cache: dict[tuple[str, float], float] = {}
        self._relation: Neighbouring | None = None

    @property
    def neighboring_relation(self) -> Neighbouring | None:
        """``"add_remove"`` or ``"replace_one"`` once an event fixing it is composed, else ``None``."""
        return self._relation

    # ----- composition -------------------------------------------------------------------------
    def compose(self, event: Event, count: int = 1) -> Self:
        """Compose ``event`` ``count`` times; returns ``self`` so calls chain.

        Raises:
            TypeError / InvalidParameter: bad event or count; UnsupportedEvent: this accountant
                cannot bound the event. Nothing is composed when it raises.
        """
        count = check_count(count)
        leaves = list(flatten_event(event, count))
        for leaf, _ in leaves:
            if not self._supports_leaf(leaf):
                raise UnsupportedEvent(f"the {self.name!r} accountant cannot bound {leaf!r}")
        relation = neighboring_relation_of(event) or self._relation
        if self._relation is not None and relation != self._relation:
            raise InvalidParameter(
                f"cannot compose a {relation} event into an accountant holding {self._relation} "
                "events: the two guarantees do not compose into either"
            )
        self._relation = relation
        for leaf, c in leaves:
            self._counts[leaf] = self._counts.get(leaf, 0) + c
            if self._history and self._history[-1][0] == leaf:
                self._history[-1] = (leaf, self._history[-1][1] + c)
            else:
                self._history.append((leaf, c))
        self._cache.clear()
        self._on_compose()
        return self

    def supports(self, event: Event) -> bool:
        """Whether :meth:`compose` would accept ``event``."""
        try:
            relation = neighboring_relation_of(event)
            if None not in (relation, self._relation) and relation != self._relation:
                return False
            return all(self._supports_leaf(leaf) for leaf, _ in flatten_event(event))
        except (TypeError, InvalidParameter):
            return False

    @property
    def counts(self) -> dict[Event, int]:
        """Distinct leaf events composed so far and their total counts (a copy)."""
        return dict(self._counts)

    @property
    def history(self) -> tuple[tuple[Event, int], ...]:
        """Leaf events in composition order, consecutive repeats merged into ``(event, count)``."""
        return tuple(self._history)

    @property
    def steps(self) -> int:
        """Total number of leaf events composed."""
        return sum(self._counts.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, distinct_events={len(self._counts)})"

    # ----- answers -----------------------------------------------------------------------------
    def epsilon(self, delta: float) -> float:
        """Smallest epsilon this accountant can certify at ``delta`` (0.0 when nothing composed).

        Raises:
            InvalidParameter: the epsilon exceeds 1e6 (no meaningful privacy) or this accountant
                cannot bound the composition at this delta. NumericalFault: a numerical fault
                (overflow, NaN, an answer below the certified lower bound of
                :mod:`gaussdp.accounting._lower`): no number is returned.
        """
        delta = check_delta(delta)
        if not self._counts:
            return 0.0
        key = ("eps", delta)
        if key not in self._cache:
            eps = self._fail_closed(self._epsilon, delta, f"epsilon at delta={delta:g}")
            if eps < 0.0:
                raise NumericalFault(f"{self.name!r} accountant: epsilon={eps} < 0 at delta={delta:g}")
            if eps > EPSILON_MAX:
                raise InvalidParameter(
                    f"epsilon at delta={delta:g} exceeds {EPSILON_MAX:g} with the {self.name!r} "
                    "accountant: these releases give no meaningful privacy"
                )
            if not self.approximate:
                from gaussdp.accounting._lower import lower_epsilon  # scipy.special: on first use

                floor = lower_epsilon(self._counts, delta)
                if eps < floor * (1.0 - 1e-9):
                    raise NumericalFault(
                        f"{self.name!r} accountant: epsilon={eps!r} at delta={delta:g} is below the "
                        f"exact epsilon of one of its releases ({floor!r}); refusing to report it"
                    )
            self._cache[key] = eps
        return self._cache[key]

    def delta(self, epsilon: float) -> float:
        """Smallest delta this accountant can certify at ``epsilon`` >= 0 (0.0 when nothing composed).

        Raises:
            NumericalFault: a numerical fault (as for :meth:`epsilon`): no number is returned.
        """
        epsilon = real_number("epsilon", epsilon)
        if epsilon < 0.0:
            raise InvalidParameter(f"epsilon must be >= 0, got epsilon={epsilon!r}")
        if not self._counts:
            return 0.0
        key = ("delta", epsilon)
        if key not in self._cache:
            d = min(1.0, max(0.0, self._fail_closed(self._delta, epsilon, f"delta at epsilon={epsilon:g}")))
            if not self.approximate and d < 1.0:
                from gaussdp.accounting._lower import lower_delta  # scipy.special: on first use

                floor = lower_delta(self._counts, epsilon)
                if d < floor * (1.0 - 1e-9):
                    raise NumericalFault(
                        f"{self.name!r} accountant: delta={d!r} at epsilon={epsilon:g} is below the "
                        f"exact delta of one of its releases ({floor!r}); refusing to report it"
                    )
            self._cache[key] = d
        return self._cache[key]

    def _fail_closed(self, compute: Callable[[float], float], arg: float, what: str) -> float:
        """``compute(arg)`` with floating-point overflow and invalid operations raised, every
        arithmetic fault turned into :class:`NumericalFault`, and NaN refused."""
        try:
            with np.errstate(over="raise", invalid="raise"):
                value = float(compute(arg))
        except InvalidParameter:
            raise
        except (ArithmeticError, ValueError) as exc:  # FloatingPointError, OverflowError, math domain
            raise NumericalFault(
                f"{self.name!r} accountant: numerical fault computing {what} ({type(exc).__name__}: "
                f"{exc}); no number is reported"
            ) from exc
        if math.isnan(value):
            raise NumericalFault(f"{self.name!r} accountant: {what} is NaN; no number is reported")
        return value

    # ----- for subclasses ----------------------------------------------------------------------
    def _on_compose(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook: invalidate backend caches after a compose."""

    @abc.abstractmethod
    def _supports_leaf(self, leaf: Event) -> bool: ...

    @abc.abstractmethod
    def _epsilon(self, delta: float) -> float: ...

    @abc.abstractmethod
    def _delta(self, epsilon: float) -> float: ...

    def _gaussian_mu(self) -> float:
        """mu of the exact GDP composition of the plain Gaussian events: sqrt(sum count / sigma^2)."""
        s = 0.0
        for e, c in self._counts.items():
            if isinstance(e, GaussianEvent):
                s += c / (e.noise_multiplier * e.noise_multiplier)
        return math.sqrt(s)

    def _only_gaussian(self) -> bool:
        return all(isinstance(e, GaussianEvent) for e in self._counts)


def invert_delta(
    delta_of_eps: Callable[[float], float], delta: float, *, eps_max: float = EPSILON_MAX
) -> float:
    """Smallest epsilon >= 0 with ``delta_of_eps(epsilon) <= delta`` (a non-increasing function), rounded up.

    Raises InvalidParameter when even ``eps_max`` does not reach ``delta``.
    """
    if delta_of_eps(0.0) <= delta:
        return 0.0
    hi = 1.0
    while delta_of_eps(hi) > delta:
        hi *= 2.0
        if hi > eps_max:
            raise InvalidParameter(f"epsilon at delta={delta:g} exceeds {eps_max:g}")
    lo = hi / 2.0 if hi > 1.0 else 0.0
    log_d = math.log(delta)

    def f(e: float) -> float:
        v = delta_of_eps(e)
        return (math.log(v) if v > 0.0 else -800.0) - log_d

    eps = float(optimize.brentq(f, lo, hi, xtol=1e-12, rtol=1e-13, maxiter=300))
    # brentq may stop on either side of the root: step up until the profile holds.
    step = max(1e-12, eps * 1e-12)
    while delta_of_eps(eps) > delta:
        eps += step
        step *= 2.0
    return eps


def fixed_leaves(counts: dict[Event, int]) -> list[tuple[EpsilonDeltaEvent, int]]:
    """The (epsilon, delta) events among ``counts``."""
    return [(e, c) for e, c in counts.items() if isinstance(e, EpsilonDeltaEvent)]
