"""Composition of a principal's grouped history, with the caches that make a charge cheap.

A history is a tuple of ``(event_key, count)`` pairs, where ``event_key`` is the canonical JSON of
``event.to_dict()``. The accountant composes each distinct event once with its count
(``accountant.compose(event, count)``), so the cost is O(number of distinct events), whatever the
number of charges.

Most charges then cost no accountant call at all. The ledger keeps, per principal, a *certified
box*: counts ``C`` (one per event) whose composition was checked to fit the budget,
``epsilon(C) <= budget``. A charge is accepted while the principal's history after it stays within
the box, event by event (a few integer comparisons, cheap enough to run under the store's lock).
This is sound whatever history led there, and even if an accountant's numerics were not monotone in
the counts: a history with counts ``h <= C`` releases a subset of the releases of ``C``, so its
(adaptive) composition is a post-processing of ``C``'s, and the bound ``epsilon(C) <= budget``,
checked explicitly, covers it.

:meth:`Composer.box` grows the box from the history ``h`` after a charge: every event's count by the
same fraction, ``C = h + ceil(t h / |h|)`` with the largest integer ``t`` that fits (doubling, then
bisection: at most ~64 accountant calls, and at most ``GROWTH_CPU_S`` of CPU: a smaller box is still
certified), so that a principal charging k distinct events in a steady mix recomputes about as
rarely as one charging a single event. Where not even one more of every event fits, the box gives
the charged event alone its largest count ``n*`` with the others fixed.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any

from gaussdp._worklimit import check_work_limit
from gaussdp.accounting.events import event_json
from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = ["MAX_COUNT", "Composer", "event_dict", "event_key", "within"]

History = tuple[tuple[str, int], ...]

# Largest count of one event the allowance search will certify; past it, charges are refused
# (fail closed) rather than searched further.
MAX_COUNT = 2**31
# CPU seconds a box may spend growing beyond the history it certifies: growth only saves later work
# (any certified box is valid), so it stops early for accountants whose every call is expensive.
GROWTH_CPU_S = 0.2


_SCALARS = (str, int, float, bool, type(None))
# event_key of recently seen immutable events, by identity: (event, key). The event is held so that
# its id is not reused while it is here; bounded like the ledger's other caches.
_KEYS: dict[int, tuple[Any, str]] = {}
_MAX_KEYS = 1024


def event_key(event: Any) -> str:
    """Canonical JSON of ``event.to_dict()`` (:func:`~gaussdp.accounting.events.event_json`): equal
    events give equal keys (the store groups by it).

    Remembered for the same event object when it cannot change (a frozen dataclass of scalars, as
    every Gaussian event is): a mechanism charged again and again is serialised once.
    """
    hit = _KEYS.get(id(event))
    if hit is not None and hit[0] is event:
        return hit[1]
    to_dict = getattr(event, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(
            f"event must be a gaussdp.accounting event with to_dict(), got event={event!r} "
            f"({type(event).__name__})"
        )
    key = event_json(to_dict())
    params = getattr(event, "__dataclass_params__", None)
    fields = getattr(event, "__dict__", None)
    frozen = params is not None and params.frozen
    if frozen and fields and all(isinstance(v, _SCALARS) for v in fields.values()):
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        _KEYS[id(event)] = (event, key)
    return key


def within(history: dict[str, int], box: dict[str, int]) -> bool:
    """True when every count of ``history`` is at most the box's count of that event (absent: 0)."""
    return all(c <= box.get(k, 0) for k, c in history.items())


def event_dict(key: str) -> dict[str, Any]:
    """The event's dict from its key: a new dict on every call (a caller may change it)."""
    flat = _flat_event(key)
    if flat is not None:
        return dict(flat)
    out: dict[str, Any] = json.loads(key)
    return out


@functools.lru_cache(maxsize=1024)
def _flat_event(key: str) -> dict[str, Any] | None:
    """The parsed key when every value is a scalar (a copy of it is then a full copy), else None."""
    out: dict[str, Any] = json.loads(key)
    return out if all(isinstance(v, _SCALARS) for v in out.values()) else None


class Composer:
    """Composes histories under named accountants; memoises epsilons and allowances (bounded LRU)."""

    def __init__(self, cache_size: int = 4096) -> None:
        self.epsilon: Callable[[str, float, History], float] = functools.lru_cache(maxsize=cache_size)(
            self._epsilon
        )
        self.allowance: Callable[[str, float, float, History, str], int] = functools.lru_cache(
            maxsize=cache_size
        )(self._allowance)
        self.box: Callable[[str, float, float, History, str], History | None] = functools.lru_cache(
            maxsize=cache_size
        )(self._box)
        self._event: Callable[[str], Any] = functools.lru_cache(maxsize=cache_size)(self._parse_event)

    @staticmethod
    def check_accountant(name: str) -> None:
        """Refuse an accountant name the accounting layer does not know, or one whose epsilon is an
        approximation (a budget it enforces would be no bound), naming the argument."""
        from gaussdp.accounting import accountant as make_accountant

        if not isinstance(name, str):
            raise TypeError(f"accountant must be a str, got accountant={name!r}")
        try:
            make_accountant(name)
        except PrivacyError:
            raise
        except (KeyError, ValueError) as exc:
            raise InvalidParameter(f"unknown accountant, got accountant={name!r}: {exc}") from exc

    @staticmethod
    def _parse_event(key: str) -> Any:
        from gaussdp.accounting import event_from_dict

        return event_from_dict(event_dict(key))

    def _epsilon(self, accountant_name: str, delta: float, history: History) -> float:
        """Composed epsilon at ``delta`` of ``history``; ``inf`` when the accountant has no finite bound."""
        from gaussdp.accounting import accountant as make_accountant

        if not history:
            return 0.0
        check_work_limit()
        acc = make_accountant(accountant_name)
        for key, count in history:
            acc.compose(self._event(key), count)
        try:
            eps = float(acc.epsilon(delta))
        except (ArithmeticError, PrivacyError):  # (WorkLimitExceeded is neither: it propagates)
            return math.inf  # no bound we can justify: treated as over any budget (fail closed)
        return eps if not math.isnan(eps) else math.inf

    def _allowance(
        self, accountant_name: str, budget_epsilon: float, delta: float, others: History, key: str
    ) -> int:
        """Largest ``n`` (``0 <= n <= MAX_COUNT``) with ``epsilon(others + n x key) <= budget_epsilon``."""

        def fits(n: int) -> bool:
            history = tuple(sorted((*others, (key, n))))
            return self.epsilon(accountant_name, delta, history) <= budget_epsilon

        if not fits(1):
            return 0
        return _largest(fits, 1)

    def _box(
        self, accountant_name: str, budget_epsilon: float, delta: float, after: History, key: str
    ) -> History | None:
        """A certified box around ``after`` (the history including the new charge of ``key``), or
        ``None`` when ``after`` itself does not fit the budget. See the module's docstring."""

        def fits(history: History) -> bool:
            return self.epsilon(accountant_name, delta, history) <= budget_epsilon

        if not fits(after):
            return None
        total = sum(c for _, c in after)

        def grown(t: int) -> History:
            # every count grows by ceil(t * c / total) >= 1: the steady mix of events is kept
            return tuple((k, max(c, min(MAX_COUNT, c + -(-t * c // total)))) for k, c in after)

        start = time.thread_time()

        def enough() -> bool:
            return time.thread_time() - start > GROWTH_CPU_S

        if fits(grown(1)):
            return grown(_largest(lambda t: fits(grown(t)), 1, enough))
        # not one more of every event: room for the charged event alone, the others fixed
        others = tuple((k, c) for k, c in after if k != key)

        def fits_n(n: int) -> bool:
            return fits(tuple(sorted((*others, (key, n)))))

        return tuple(sorted((*others, (key, _largest(fits_n, dict(after)[key], enough)))))


def _largest(fits: Callable[[int], bool], good: int, enough: Callable[[], bool] | None = None) -> int:
    """Largest ``n`` in ``[good, MAX_COUNT]`` with ``fits(n)``, given ``fits(good)``: doubling, then
    bisection (at most ~2 log2(MAX_COUNT) = 62 calls). With ``enough``, the search stops as soon as
    it says so and returns the largest ``n`` verified so far (a lower bound, still certified)."""
    if good >= MAX_COUNT:
        return good
    bad = min(2 * good, MAX_COUNT)
    while True:
        if enough is not None and enough():
            return good
        if not fits(bad):
            break
        good = bad
        if bad >= MAX_COUNT:
            return MAX_COUNT
        bad = min(2 * bad, MAX_COUNT)
    while bad - good > 1:  # invariant: fits(good), not fits(bad)
        if enough is not None and enough():
            return good
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
