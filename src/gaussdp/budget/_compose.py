"""Composition of a principal's grouped history, with the caches that make a charge cheap.

A history is a tuple of ``(event_key, count)`` pairs, where ``event_key`` is the canonical JSON of
``event.to_dict()``. The accountant composes each distinct event once with its count
(``accountant.compose(event, count)``), so the cost is O(number of distinct events), whatever the
number of charges.

Most charges then cost no accountant call at all: for a history whose *other* events are fixed, the
largest count ``n*`` of the charged event that keeps the composed epsilon within the budget is found
once (doubling, then bisection) and cached; a charge is accepted while ``count + 1 <= n*``.
This is sound even if an accountant's numerics were not monotone in the count: the ``m``-fold
(adaptive) composition is a post-processing of the ``n*``-fold one for every ``m <= n*``, so the
bound ``epsilon(n*) <= budget``, checked explicitly, covers every smaller count.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = ["MAX_COUNT", "Composer", "event_dict", "event_key"]

History = tuple[tuple[str, int], ...]

# Largest count of one event the allowance search will certify; past it, charges are refused
# (fail closed) rather than searched further.
MAX_COUNT = 2**31


def event_key(event: Any) -> str:
    """Canonical JSON of ``event.to_dict()``: equal events give equal keys (the store groups by it)."""
    to_dict = getattr(event, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(
            f"event must be a gaussdp.accounting event with to_dict(), got event={event!r} "
            f"({type(event).__name__})"
        )
    return json.dumps(to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)


def event_dict(key: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(key)
    return out


class Composer:
    """Composes histories under named accountants; memoises epsilons and allowances (bounded LRU)."""

    def __init__(self, cache_size: int = 4096) -> None:
        self.epsilon: Callable[[str, float, History], float] = functools.lru_cache(maxsize=cache_size)(
            self._epsilon
        )
        self.allowance: Callable[[str, float, float, History, str], int] = functools.lru_cache(
            maxsize=cache_size
        )(self._allowance)
        self._event: Callable[[str], Any] = functools.lru_cache(maxsize=cache_size)(self._parse_event)

    @staticmethod
    def check_accountant(name: str) -> None:
        """Refuse an accountant name the accounting layer does not know, or one whose epsilon is an
        approximation (a budget it enforces would be no bound), naming the argument."""
        from gaussdp.accounting import upper_bound_accountant

        if not isinstance(name, str):
            raise TypeError(f"accountant must be a str, got accountant={name!r}")
        try:
            upper_bound_accountant(name)
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
        from gaussdp.accounting import accountant

        if not history:
            return 0.0
        acc = accountant(accountant_name)
        for key, count in history:
            acc.compose(self._event(key), count)
        try:
            eps = float(acc.epsilon(delta))
        except (ArithmeticError, PrivacyError):
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
        good, bad = 1, 2
        while fits(bad):
            good = bad
            if bad >= MAX_COUNT:
                return MAX_COUNT
            bad = min(2 * bad, MAX_COUNT)
        while bad - good > 1:  # invariant: fits(good), not fits(bad)
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
        return good
