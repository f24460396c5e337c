"""Incremental allowance: per-event cost rows that make a charge's check O(1) accountant work.

:mod:`gaussdp.budget._compose` composes a principal's whole history from scratch (one accountant call
per distinct event) for every decision it cannot take from a certified box: with ``k`` distinct
events each decision costs ``O(k)`` accountant work, around 2 ms per event for a subsampled Gaussian
under the basic and advanced theorems (a root search per event) and a discretised PLD per event
under ``pld``. This module keeps what does not change from one charge to the next, per distinct
event, so that a charge computes the rows of the *new* event only and combines the rest with a dot
product (``O(k)`` floating-point operations, microseconds):

* ``rdp``: RDP is additive over releases (Mironov 2017, Proposition 1). A row is the event's RDP at
  every order (and its ``1/sigma^2`` for the closed form of plain Gaussian compositions); the
  history's RDP is ``counts @ rows``, converted exactly as :class:`~gaussdp.accounting.RDPAccountant`
  does. Equal to the accountant's answer up to rounding; the sum is padded by a relative ``1e-10``
  (far above the rounding of any sum of up to 1e5 terms) so that it is never below it.
* ``basic``: the theorem (Dwork & Roth 2014, Theorem 3.16) with each of the ``K`` mechanism releases
  at delta share ``delta / K``. Shares are taken on a ladder ``delta / 2^(j/4)`` with ``2^(j/4) >= K``
  (a smaller share, hence a larger epsilon per release: still the theorem, with total delta ``<=
  delta``), so the rows of a rung serve every ``K`` up to ``2^(j/4)`` and are computed once per event
  and rung. The bound is at most about 1% above the accountant's (measured in the tests).
* ``advanced``: the same ladder for the releases' share, at each delta' fraction of the grid that
  :class:`~gaussdp.accounting.AdvancedComposition` searches (``sigmoid(linspace(-10, 10, 11))``); its
  sufficient statistics ``sum eps_i^2`` and ``sum eps_i (e^eps_i - 1)`` (Dwork & Roth 2014, Theorem
  3.20, heterogeneous form) are dot products with the rows. The minimum over the grid and the basic
  bound is at least the accountant's answer (which is at most its value at each grid point, at the
  exact share) and an upper bound by the same theorems.
* ``pld``: composition is a product of spectra; a *live* :class:`~gaussdp.accounting.PLDAccountant` per
  principal keeps its discretised events, spectra and checkpoints (see ``accounting/pld.py``), and a
  charge composes the events added since (the new one included) into it and asks it; its answer is
  padded by a relative ``1e-6`` (a fresh accountant's windows differ: both are upper bounds, ~1e-9
  apart in the tests). A live accountant is reused only for a history that contains the one it
  composed (counts only grow); anything else (a refused or lost race) rebuilds it from scratch.

Each sketch answers an *upper bound* on the accountant's epsilon (never below the from-scratch
answer), or ``None`` where it cannot (events it has no rows for: ``(epsilon, delta)`` events under
basic/advanced, mixed neighbouring relations); the ledger then composes from scratch, as before.
A sketch that says "does not fit" is not trusted either: the from-scratch composition decides every
refusal, so the ledger refuses exactly what the accountant refuses.

References:
    Mironov, I. (2017). Renyi Differential Privacy, Proposition 1. CSF.
    Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy, Theorems 3.16
    and 3.20.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gaussdp._worklimit import check_work_limit
from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = ["RUNGS_PER_OCTAVE", "LinearSketch", "LivePLD"]

# Ladder of delta shares for basic/advanced: 4 rungs per octave (share ratio 2^(1/4) = 1.19).
RUNGS_PER_OCTAVE = 4
# Relative padding of sums computed in an order other than the accountant's (see the docstring).
_PAD = 1e-10
_PLD_PAD = 1e-6
# Entries of a live PLD accountant's run-length history after which it is rebuilt (bounded memory).
_LIVE_HISTORY_MAX = 4096
# The delta' fractions AdvancedComposition searches first (its coarse grid, in logit space).
# CPU seconds a box may spend growing (the bound is cheap: a few dozen dot products in practice).
_GROWTH_CPU_S = 0.05
_ADV_FRACTIONS = tuple(float(1.0 / (1.0 + math.exp(-z))) for z in np.linspace(-10.0, 10.0, 11))


class _LRU:
    """A small thread-safe LRU map (rows are shared by every principal of a ledger)."""

    def __init__(self, size: int) -> None:
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            hit = self._d.get(key)
            if hit is not None:
                self._d.move_to_end(key)
                return hit
        value = make()  # outside the lock: rows are pure functions of the key
        with self._lock:
            self._d[key] = value
            if len(self._d) > self._size:
                self._d.popitem(last=False)
        return value


def rung(total: int) -> int:
    """Smallest ``j`` with ``2^(j/4) >= total`` (``total >= 1``)."""
    j = max(0, math.ceil(RUNGS_PER_OCTAVE * math.log2(total)) - 1)
    while 2.0 ** (j / RUNGS_PER_OCTAVE) < total:
        j += 1
    return j


def rung_top(j: int) -> int:
    """Largest release count a rung's share covers: ``floor(2^(j/4))``."""
    return int(2.0 ** (j / RUNGS_PER_OCTAVE))  # floor: the power is positive


class LinearSketch:
    """Upper bounds on one accountant's epsilon from per-event rows (rdp, basic, advanced)."""

    def __init__(self, name: str, parse: Callable[[str], Any], cache_size: int = 1 << 15) -> None:
        self.name = name
        self._parse = parse
        self._rows = _LRU(cache_size)

    # -- rows ---------------------------------------------------------------------------------------
    def _leaves(self, key: str) -> tuple[list[tuple[Any, int]], str | None] | None:
        from gaussdp.accounting.events import (
            EpsilonDeltaEvent,
            flatten_event,
            neighboring_relation_of,
        )

        def make() -> Any:
            event = self._parse(key)
            leaves = list(flatten_event(event, 1))
            if self.name != "rdp" and any(isinstance(leaf, EpsilonDeltaEvent) for leaf, _ in leaves):
                return ()  # basic/advanced with (epsilon, delta) events: the delta left moves; no rows
            return (leaves, neighboring_relation_of(event))

        out = self._rows.get(("leaves", key), make)
        return out if out != () else None

    def _rdp_row(self, key: str) -> tuple[float, bool, np.ndarray]:
        from gaussdp.accounting import accountant
        from gaussdp.accounting.events import GaussianEvent

        def make() -> tuple[float, bool, np.ndarray]:
            check_work_limit()
            leaves, _ = self._leaves(key) or ([], None)
            acc: Any = accountant("rdp")
            acc.compose(self._parse(key), 1)
            gauss = all(isinstance(leaf, GaussianEvent) for leaf, _ in leaves)
            mu2 = math.fsum(
                c / (leaf.noise_multiplier * leaf.noise_multiplier)
                for leaf, c in leaves
                if isinstance(leaf, GaussianEvent)
            )
            return mu2, gauss, np.asarray(acc.rdp(), dtype=np.float64).copy()

        out: tuple[float, bool, np.ndarray] = self._rows.get(("rdp", key), make)
        return out

    def _mech_count(self, key: str) -> int:
        got = self._leaves(key)
        return 0 if got is None else sum(c for _, c in got[0])

    def _share_row(self, key: str, share: float) -> tuple[float, float, float]:
        """(sum eps_i, sum eps_i^2, sum eps_i (e^eps_i - 1)) of one event's releases at ``share``."""
        from gaussdp.accounting.basic import leaf_epsilon

        def make() -> tuple[float, float, float]:
            check_work_limit()  # a new rung costs a root search per event: the request's CPU limit holds
            got = self._leaves(key)
            if got is None:  # pragma: no cover - callers check first
                raise InvalidParameter("no rows for this event")
            s1 = s2 = lin = 0.0
            for leaf, c in got[0]:
                e = float(leaf_epsilon(leaf, share))
                s1 += c * e
                s2 += c * e * e
                lin += c * e * math.expm1(e) if e <= 700.0 else math.inf
            return s1, s2, lin

        out: tuple[float, float, float] = self._rows.get(("share", key, share), make)
        return out

    # -- bounds -------------------------------------------------------------------------------------
    def supports(self, keys: list[str]) -> bool:
        """Whether every event has rows and their neighbouring relations compose."""
        rels = set()
        for k in keys:
            got = self._leaves(k)
            if got is None:
                return False
            rels.add(got[1])
        return len(rels - {None}) <= 1

    def evaluator(self, delta: float, keys: list[str], j: int | None = None) -> Callable[[np.ndarray], float]:
        """``counts -> bound`` for histories of ``keys``, with the rows fetched once.

        For basic/advanced, ``j`` fixes the rung (the bound then holds for histories of at most
        ``rung_top(j)`` releases); ``None`` picks the rung of each history (rows fetched per call).
        """
        from gaussdp.accounting.rdp import DEFAULT_ORDERS, rdp_to_epsilon
        from gaussdp.calibration import epsilon_for_mu

        if self.name == "rdp":
            rows = [self._rdp_row(k) for k in keys]
            gauss = np.array([r[1] for r in rows])
            mu2s = np.array([r[0] for r in rows])
            mat = np.stack([r[2] for r in rows])
            orders = np.asarray(DEFAULT_ORDERS)

            def rdp_eps(counts: np.ndarray) -> float:
                live = counts > 0
                if not live.any():
                    return 0.0
                if gauss[live].all():
                    mu2 = float(np.dot(counts, mu2s)) * (1.0 + _PAD)
                    return float(epsilon_for_mu(mu=math.sqrt(mu2), delta=delta))
                return rdp_to_epsilon((counts @ mat) * (1.0 + _PAD), orders, delta)

            return rdp_eps
        per = np.array([self._mech_count(k) for k in keys], dtype=np.int64)
        if j is None:

            def any_rung(counts: np.ndarray) -> float:
                total = int(np.dot(counts, per))
                return 0.0 if total == 0 else self.evaluator(delta, keys, rung(total))(counts)

            return any_rung
        scale = 2.0 ** (j / RUNGS_PER_OCTAVE)
        share = math.nextafter(delta / scale, 0.0)
        s1 = np.array([self._share_row(k, share)[0] for k in keys])
        adv: list[tuple[float, np.ndarray]] = []
        if self.name == "advanced":
            for f in _ADV_FRACTIONS:
                s = math.nextafter((1.0 - f) * delta / scale, 0.0)
                adv.append((f * delta, np.array([self._share_row(k, s)[1:] for k in keys])))

        def ladder(counts: np.ndarray) -> float:
            best = float(np.dot(counts, s1)) * (1.0 + _PAD)
            for d_prime, rows in adv:
                with np.errstate(invalid="ignore"):
                    sq, lin = (counts @ rows) * (1.0 + _PAD)
                if math.isfinite(sq) and math.isfinite(lin):
                    best = min(best, math.sqrt(2.0 * math.log(1.0 / d_prime) * sq) + lin)
            return best

        return ladder

    def bounded(self, delta: float, keys: list[str], j: int | None = None) -> Callable[[np.ndarray], float]:
        """:meth:`evaluator`, with ``inf`` past the largest epsilon an accountant answers (it refuses
        those: the ledger treats them as over any budget)."""
        from gaussdp.accounting.base import EPSILON_MAX

        inner = self.evaluator(delta, keys, j)

        def out(counts: np.ndarray) -> float:
            eps = inner(counts)
            return eps if eps <= EPSILON_MAX else math.inf

        return out

    def epsilon(self, delta: float, history: Mapping[str, int]) -> float | None:
        """An upper bound on the accountant's epsilon at ``delta`` of ``history``; None: no rows."""
        keys = sorted(history)
        if not self.supports(keys):
            return None
        return self.bounded(delta, keys)(np.array([history[k] for k in keys], dtype=np.int64))

    def box(self, delta: float, budget: float, after: Mapping[str, int], key: str) -> dict[str, int] | None:
        """A certified box around ``after`` (bound <= budget), grown like ``Composer.box``; ``None``
        when the bound does not show that ``after`` fits (the caller then composes from scratch)."""
        from gaussdp.budget._compose import MAX_COUNT, _largest

        keys = sorted(after)
        if not self.supports(keys):
            return None
        base = np.array([after[k] for k in keys], dtype=np.int64)
        cap = MAX_COUNT * len(keys)
        per = np.ones(len(keys), dtype=np.int64)
        if self.name == "rdp":
            bound = self.bounded(delta, keys)
        else:  # grow within the rung of ``after``, whose rows are computed once
            per = np.array([self._mech_count(k) for k in keys], dtype=np.int64)
            j = rung(max(1, int(np.dot(base, per))))
            cap = rung_top(j)
            bound = self.bounded(delta, keys, j)
        if bound(base) > budget:
            return None
        total = int(base.sum())

        def grown(t: int) -> np.ndarray:
            out: np.ndarray = np.minimum(np.maximum(base, base + -(-t * base // total)), MAX_COUNT)
            return out

        def fits(t: int) -> bool:
            c = grown(t)
            return int(np.dot(c, per)) <= cap and bound(c) <= budget

        start = time.thread_time()
        box = (
            grown(_largest(fits, 1, lambda: time.thread_time() - start > _GROWTH_CPU_S)) if fits(1) else base
        )
        return {k: int(v) for k, v in zip(keys, box, strict=True)}


class LivePLD:
    """A PLD accountant per principal, kept composed with its last history (see the module docstring)."""

    def __init__(self, parse: Callable[[str], Any], size: int = 256) -> None:
        self._parse = parse
        self._live: OrderedDict[str, tuple[float, dict[str, int], Any]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def epsilon_after(self, principal: str, delta: float, after: Mapping[str, int]) -> float | None:
        """The PLD epsilon of ``after`` (an upper bound, as the accountant's), or None if unknown."""
        from gaussdp.accounting import accountant

        with self._lock:
            hit = self._live.pop(principal, None)
        # (the accountant's run-length history grows with every compose: a long-lived principal's live
        # accountant is rebuilt from scratch now and then rather than kept growing)
        if (
            hit is not None
            and len(hit[2].history) <= _LIVE_HISTORY_MAX
            and hit[0] == delta
            and all(after.get(k, 0) >= c for k, c in hit[1].items())
        ):
            _, counts, acc = hit
        else:
            counts, acc = {}, accountant("pld")
        try:
            for k, c in sorted(after.items()):
                more = c - counts.get(k, 0)
                if more > 0:
                    acc.compose(self._parse(k), more)
            eps = float(acc.epsilon(delta))
        except (ArithmeticError, PrivacyError):
            return None  # the from-scratch path decides (and words) what cannot be bounded
        with self._lock:
            self._live[principal] = (delta, dict(after), acc)
            while len(self._live) > self._size:
                self._live.popitem(last=False)
        # The live accountant's windows differ from a fresh one's (both upper bounds, within ~1e-9 of each
        # other in the tests): the pad keeps this answer at or above the from-scratch composition.
        return eps * (1.0 + _PLD_PAD) if not math.isnan(eps) else None
