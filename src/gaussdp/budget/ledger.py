"""The privacy ledger: who may still spend what, durably, with charges checked before release."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gaussdp._format import format_exact, format_upper
from gaussdp._validate import check_choice
from gaussdp._worklimit import cpu_limited, no_cpu_limit
from gaussdp.accounting.events import event_json
from gaussdp.budget._compose import Composer, event_dict, event_key, within
from gaussdp.budget._sketch import LinearSketch, LivePLD
from gaussdp.budget._types import Budget, ChargeRecord, Receipt, Release, Spent
from gaussdp.budget.store import (
    Decide,
    IdempotencyKeyUsed,
    LedgerContention,
    PrincipalConflict,
    PrincipalRow,
    Store,
    StoredCharge,
    UnknownPrincipal,
    check_idempotency_key,
    check_principal,
    open_store,
)
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyError, PrivacyWarning, UnsafeInput

__all__ = ["Ledger"]

logger = logging.getLogger("gaussdp.budget")

Policy = Literal["refuse", "warn"]

_MAX_HINTS = 10_000
# Attempts of one charge whose decision went stale under the lock (the history moved past what was
# computed outside it) before giving up with LedgerContention; each attempt recomputes outside the lock.
_MAX_ATTEMPTS = 16
# Distinct events from which a PLD principal's charges are checked on its live accountant (incremental)
# rather than composed from scratch (cheap for a few events, and that path grows the box further).
_LIVE_PLD_FROM = 8


class _Stale(Exception):
    """Raised under the store's lock: the history seen there needs a new decision, made outside."""

    def __init__(self, groups: dict[str, int]) -> None:
        super().__init__("stale decision")
        self.groups = groups


@dataclass(frozen=True)
class _Plan:
    """What was decided outside the lock for one charge, re-validated under it in O(events).

    ``box``: a certified box (``epsilon(box) <= budget``), or None. ``refuse_from``: a history (after
    the charge) found not to fit; any history at or above it, event by event, is refused too.
    """

    box: dict[str, int] | None
    refuse_from: dict[str, int] | None = None
    refusal: str = ""


class Ledger:
    """Per-principal privacy budgets with atomic, durable charges (a privacy filter).

    Each principal (a session, a user, a federated client) is opened once with a :class:`Budget` and
    an accountant. :meth:`charge` composes the new event with everything already charged to the
    principal, under that accountant, and records it only if the composed epsilon at the budget's
    delta stays within the budget; otherwise it raises :class:`~gaussdp.errors.BudgetExhausted` and
    records nothing. The check and the write happen in one transaction that holds the principal's lock
    (SQLite ``BEGIN IMMEDIATE``, PostgreSQL ``SELECT ... FOR UPDATE``), so concurrent requests from
    any number of threads or processes can never spend past a budget together.

    Nothing slow runs under that lock: the accountant runs before it is taken and certifies a *box*
    of counts per event that fits the budget (see ``budget/_compose.py``); under the lock the
    history after the charge is compared with the box, count by count. When the history seen under
    the lock is not covered (another process charged meanwhile), the transaction is rolled back and
    the decision is made again outside the lock (at most 16 times, then
    :class:`~gaussdp.budget.LedgerContention`, nothing charged).

    Deciding is incremental in the number of distinct events (``budget/_sketch.py``): per-event rows
    (RDP vectors; leaf epsilons on a ladder of delta shares for basic and advanced composition) and a
    live PLD accountant per principal certify the box, so that a charge to a principal with 300
    distinct events costs about what it costs with one. Those bounds are never below a from-scratch
    composition of the same history; where they cannot show that a charge fits (near the budget), the
    history is composed from scratch, which decides every refusal.

    Guarantee: while ``policy="refuse"``, the adaptive composition of all events charged to a
    principal is ``(budget.epsilon, budget.delta)``-DP under add/remove of one record, as bounded by the
    principal's accountant (a privacy filter in the sense of Rogers, Roth, Ullman & Vadhan 2016; with
    the budget fixed in advance the filter is valid for the accountant's fully adaptive composition
    bound, see Whitehouse, Ramdas, Rogers & Wu 2023 for RDP/PLD filters).

    Args:
        url: ``"memory://"`` (in-process), ``"sqlite:///path.db"`` (embedded, WAL) or
            ``"postgresql://..."`` (needs ``psycopg`` and ``psycopg_pool``).
        policy: ``"refuse"`` (default) raises on exhaustion. ``"warn"`` is the private inference server's
            behaviour: the charge is recorded anyway, logged, and a :class:`~gaussdp.errors.PrivacyWarning` is
            issued; the budget then guarantees nothing. Opt in only to reproduce that document.
        store: an already opened store (instead of ``url``), e.g. shared by several ledgers.
        cache_size: entries of the epsilon, allowance and box caches.

    Raises:
        InvalidParameter: unknown URL scheme or policy.

    References:
        Rogers, Roth, Ullman, Vadhan. Privacy Odometers and Filters: Pay-as-you-Go Composition.
        NeurIPS 2016. Whitehouse, Ramdas, Rogers, Wu. Fully-Adaptive Composition in Differential
        Privacy. ICML 2023.
    """

    def __init__(
        self,
        url: str = "memory://",
        policy: Policy = "refuse",
        *,
        store: Store | None = None,
        cache_size: int = 4096,
    ) -> None:
        check_choice("policy", policy, ("refuse", "warn"))
        self.url = url if store is None else f"<{type(store).__name__}>"
        self.policy: Policy = policy
        self.store: Store = store if store is not None else open_store(url)
        self._composer = Composer(cache_size)
        parse = self._composer._event
        self._sketches = {n: LinearSketch(n, parse) for n in ("rdp", "basic", "advanced")}
        self._live_pld = LivePLD(parse)
        self._rows: dict[str, PrincipalRow] = {}
        # Per principal, the history this process last saw: a hint, trusted only where the store
        # confirms it (charge_next checks its total where it writes).
        self._last_groups: dict[str, dict[str, int]] = {}
        self._charge_next = getattr(self.store, "charge_next", None)
        # Per principal, the last certified box (valid for any history: see budget/_compose.py).
        self._boxes: dict[str, tuple[PrincipalRow, dict[str, int]]] = {}
        if policy == "warn":
            logger.warning(
                "ledger %s uses policy='warn': exhausted budgets are logged, not enforced", self.url
            )

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the store's connections."""
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r}, policy={self.policy!r})"

    # -- principals --------------------------------------------------------------------------------
    def open(
        self, principal: str, budget: Budget, *, accountant: str = "pld", tenant: str | None = None
    ) -> Budget:
        """Open ``principal`` with ``budget`` (idempotent); return its budget.

        Opening an existing principal again with the same budget and accountant is a no-op (so every
        process of a service may call it); with a different one it raises: a budget never grows.

        Raises:
            TypeError: ``budget`` is not a :class:`Budget`.
            InvalidParameter: bad principal or accountant name.
            PrincipalConflict: a different budget or accountant is already on record for ``principal``.
            TenantLimitExceeded: ``tenant`` is given and a new principal would pass its caps
                (``store.set_tenant_limits``); counted atomically with the open.
        """
        check_principal(principal)
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a gaussdp.budget.Budget, got budget={budget!r}")
        self._composer.check_accountant(accountant)
        if tenant is None:
            row = self.store.open_principal(principal, budget.epsilon, budget.delta, accountant)
        else:
            row = self.store.open_principal_within(
                principal, budget.epsilon, budget.delta, accountant, tenant
            )
        if (row.epsilon, row.delta, row.accountant) != (budget.epsilon, budget.delta, accountant):
            raise PrincipalConflict(
                f"principal {principal!r} is already open with budget=Budget(epsilon={row.epsilon!r}, "
                f"delta={row.delta!r}) and accountant={row.accountant!r}; a budget cannot be changed, "
                "open a new principal"
            )
        self._remember(principal, row)
        return budget

    def _remember(self, principal: str, row: PrincipalRow) -> None:
        # a cache of immutable records (a budget never changes), bounded like the history hints: a
        # service with a principal per session must not grow without limit; evicted rows are re-read
        if len(self._rows) >= _MAX_HINTS:
            self._rows.clear()
        self._rows[principal] = row

    def _row(self, principal: str) -> PrincipalRow:
        row = self._rows.get(principal)
        if row is None:
            check_principal(principal)
            row = self.store.get_principal(principal)
            if row is None:
                raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
            self._remember(principal, row)
        return row

    def budget(self, principal: str) -> Budget:
        """The budget ``principal`` was opened with."""
        row = self._row(principal)
        return Budget(row.epsilon, row.delta)

    def accountant(self, principal: str) -> str:
        """The accountant name ``principal`` was opened with."""
        return self._row(principal).accountant

    def principals(self, prefix: str = "") -> list[str]:
        """Names of the opened principals that start with ``prefix``, sorted."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got prefix={prefix!r}")
        return self.store.list_principals(prefix)

    # -- charging ----------------------------------------------------------------------------------
    def charge(
        self,
        principal: str,
        event: Any,
        idempotency_key: str | None = None,
        *,
        key_id: str | None = None,
        fresh: bool = False,
    ) -> Receipt:
        """Atomically charge ``event`` to ``principal`` if the composed spend stays within budget.

        Args:
            principal: an opened principal.
            event: a ``gaussdp.accounting`` event (e.g. ``mechanism.event``).
            idempotency_key: a retried call with the same key is charged once and returns the earlier
                receipt with ``replayed=True`` (nothing new may be released under a replayed receipt).
            key_id: who made the charge (the service's API key id, not secret), kept with it for audit.
            fresh: the caller releases something under this charge, so a replayed idempotency key
                raises :class:`IdempotencyKeyUsed` instead of returning the earlier receipt.

        Returns:
            A :class:`Receipt`, written durably before this method returns.

        Raises:
            BudgetExhausted: the event does not fit (``policy="refuse"``); nothing was recorded.
            LedgerContention: concurrent charges kept changing the history; nothing was recorded.
            UnknownPrincipal: ``principal`` was never opened.
            InvalidParameter: the idempotency key was used before for a different event.
            IdempotencyKeyUsed: ``fresh`` and the idempotency key was already charged.
        """
        receipt = self._charge(principal, event, idempotency_key, key_id)
        if fresh and receipt.replayed:
            raise _key_used(receipt)
        return receipt

    def _charge(self, principal: str, event: Any, idempotency_key: str | None, key_id: str | None) -> Receipt:
        key = event_key(event)
        idempotency_key = check_idempotency_key(idempotency_key)
        if key_id is not None:
            check_idempotency_key(key_id)  # same rules: a short printable string
        row = self._row(principal)
        self._composer._event(key)  # parse (and validate) the event before taking any lock
        # Decide outside the store's lock, from the last history this process saw (or a snapshot):
        # counts only grow, so that history is at or below the one the lock will show.
        last = self._last_groups.get(principal)
        cached = self._boxes.get(principal)
        if last is not None and cached is not None and (cached[0] is row or cached[0] == row):
            known = self._charge_known(principal, key, last, cached[1], idempotency_key, key_id)
            if known is not None:
                return known
        plan = self._plan(principal, row, last if last is not None else self.store.groups(principal), key)
        if last is not None and plan.box is not None and (cached is None or plan.box is not cached[1]):
            known = self._charge_known(principal, key, last, plan.box, idempotency_key, key_id)
            if known is not None:
                return known
        after: dict[str, dict[str, int]] = {}
        stored = None
        for _ in range(_MAX_ATTEMPTS):
            try:
                stored = self.store.charge(
                    principal,
                    key,
                    idempotency_key,
                    self._decide(principal, row, key, plan, after),
                    key_id=key_id,
                )
                break
            except _Stale as stale:  # the history moved under the lock: decide again, outside it
                plan = self._plan(principal, row, stale.groups, key)
        if stored is None:
            raise LedgerContention(
                f"principal {principal!r}: the history changed under {_MAX_ATTEMPTS} attempts in a row "
                "(heavy concurrent charging); nothing was charged, retry"
            )
        if not stored.within_budget and not stored.replayed:
            msg = (
                f"privacy budget of principal {principal!r} exhausted (budget epsilon="
                f"{format_exact(row.epsilon)}, delta={format_exact(row.delta)}); the charge was recorded "
                "anyway because policy='warn'"
            )
            logger.warning(msg)
            warnings.warn(msg, PrivacyWarning, stacklevel=2)
        composed = None if stored.replayed else tuple(sorted(after["groups"].items()))
        return _receipt(stored, composed)

    def _charge_known(
        self,
        principal: str,
        key: str,
        last: dict[str, int],
        box: dict[str, int],
        idempotency_key: str | None,
        key_id: str | None,
    ) -> Receipt | None:
        """The common charge in one statement, or None for the general path of :meth:`charge`.

        Where the certified ``box`` covers the history after the charge (``last`` plus one ``key``),
        stores with ``charge_next`` (SQLite, PostgreSQL) write the charge in one statement, numbered
        one past ``last``'s total: the database writes it only if the principal's total is still
        that (counts only grow, so the history is still ``last``) and nothing otherwise (a moved
        history, a used idempotency key): None, and the general path decides.
        """
        if self._charge_next is None:
            return None
        new = {**last, key: last.get(key, 0) + 1}
        if not within(new, box):
            return None
        stored = self._charge_next(principal, key, idempotency_key, sum(new.values()), key_id=key_id)
        if stored is None:
            return None
        self._hint(principal, new)
        return _receipt(stored, tuple(sorted(new.items())))

    def _hint(self, principal: str, groups: dict[str, int]) -> None:
        if len(self._last_groups) >= _MAX_HINTS:
            self._last_groups.clear()
        self._last_groups[principal] = groups

    def _plan(self, principal: str, row: PrincipalRow, base: Mapping[str, int], key: str) -> _Plan:
        """The decision for charging ``key`` on top of ``base``, made outside any lock.

        The numeric work (the accountant) runs here only; under the lock :meth:`_decide` compares
        counts. A box certified earlier for this principal is reused while it covers the history.
        """
        after = {**base, key: int(base.get(key, 0)) + 1}
        cached = self._boxes.get(principal)
        if cached is not None and cached[0] == row and within(after, cached[1]):
            return _Plan(cached[1])
        fast = self._fast_box(principal, row, after, key)
        if fast is not None:
            if len(self._boxes) >= _MAX_HINTS:
                self._boxes.clear()
            self._boxes[principal] = (row, fast)
            return _Plan(fast)
        history = tuple(sorted((k, int(c)) for k, c in after.items()))
        try:
            box = self._composer.box(row.accountant, row.epsilon, row.delta, history, key)
        except PrivacyError:
            raise
        except (ValueError, ArithmeticError) as exc:
            raise InvalidParameter(
                f"the {row.accountant!r} accountant cannot bound event={event_dict(key)}: {exc}"
            ) from exc
        if box is not None:
            certified = dict(box)
            if len(self._boxes) >= _MAX_HINTS:
                self._boxes.clear()
            self._boxes[principal] = (row, certified)
            return _Plan(certified)
        spent = self._composer.epsilon(row.accountant, row.delta, tuple(sorted(base.items())))
        refusal = (
            f"privacy budget of principal {principal!r} exhausted: spent epsilon={format_upper(spent)} of "
            f"budget epsilon={format_exact(row.epsilon)} at delta={format_exact(row.delta)}, and "
            f"event={event_dict(key)} "
            f"does not fit ({row.accountant} accountant); nothing was charged"
        )
        return _Plan(cached[1] if cached is not None and cached[0] == row else None, after, refusal)

    def _fast_box(
        self, principal: str, row: PrincipalRow, after: dict[str, int], key: str
    ) -> dict[str, int] | None:
        """A box certified from the incremental state (``budget/_sketch.py``), or None: the caller then
        composes from scratch (which also decides, and words, every refusal)."""
        try:
            if row.accountant == "pld":
                if len(after) < _LIVE_PLD_FROM:
                    return None  # few events: composing from scratch is cheap and grows the box further
                eps = self._live_pld.epsilon_after(principal, row.delta, after)
                return dict(after) if eps is not None and eps <= row.epsilon else None
            sketch = self._sketches.get(row.accountant)
            return None if sketch is None else sketch.box(row.delta, row.epsilon, after, key)
        except (ArithmeticError, PrivacyError):
            return None

    def _decide(
        self, principal: str, row: PrincipalRow, key: str, plan: _Plan, after: dict[str, dict[str, int]]
    ) -> Decide:
        """The check under the store's lock: integer comparisons only, never the accountant."""

        def decide(locked: PrincipalRow, groups: Mapping[str, int]) -> bool:
            if locked != row:  # budgets never change; a different row is a different principal
                raise PrivacyError(
                    f"principal {principal!r} changed while being charged; nothing was charged"
                )
            new = {**groups, key: int(groups.get(key, 0)) + 1}
            if plan.box is not None and within(new, plan.box):
                after["groups"] = new
                self._hint(principal, new)
                return True
            refuse = plan.refuse_from
            if refuse is not None and all(new.get(k, 0) >= c for k, c in refuse.items()):
                # at or above a history that does not fit: refused (sound for any accountant whose
                # bound grows with the counts; refusing is never a privacy risk in any case)
                if self.policy == "refuse":
                    self._hint(principal, dict(groups))
                    raise BudgetExhausted(plan.refusal)
                after["groups"] = new
                self._hint(principal, new)
                return False
            raise _Stale(dict(groups))

        return decide

    def _allowed(self, row: PrincipalRow, groups: Mapping[str, int], key: str) -> int:
        """Largest total count of ``key`` that fits with the other events of ``groups``."""
        others = tuple(sorted((k, int(c)) for k, c in groups.items() if k != key))
        try:
            return self._composer.allowance(row.accountant, row.epsilon, row.delta, others, key)
        except PrivacyError:
            raise
        except (ValueError, ArithmeticError) as exc:
            raise InvalidParameter(
                f"the {row.accountant!r} accountant cannot bound event={event_dict(key)}: {exc}"
            ) from exc

    def allowance(self, principal: str, event: Any) -> int:
        """How many more charges of ``event`` fit in ``principal``'s budget now (a snapshot)."""
        key = event_key(event)
        row = self._row(principal)
        groups = self.store.groups(principal)
        return max(0, self._allowed(row, groups, key) - groups.get(key, 0))

    def release(
        self,
        principal: str,
        mechanism: Any,
        x: Any,
        *,
        idempotency_key: str | None = None,
        key_id: str | None = None,
    ) -> Release:
        """Charge ``mechanism.event`` to ``principal`` durably, then release ``mechanism.release(x)``.

        The order is the guarantee: a crash after the charge loses budget, never privacy. A floating
        input with NaN or Inf is refused before anything is charged. A replayed idempotency key raises
        (a second noisy value under one charge would not be covered by it).

        Args:
            principal: an opened principal.
            mechanism: what to release: its ``.event`` is charged, then ``.release(x)`` is called.
            x: the input of the release.
            idempotency_key: a retried call with the same key is charged once (and released once).
            key_id: who made the charge (kept with it for audit), as for :meth:`charge`.

        Returns:
            A :class:`Release`: the released ``value``, the ``receipt`` of its charge (``charge_id``),
            and the principal's ``spent`` and ``remaining`` privacy right after it.

        Raises:
            BudgetExhausted: the release does not fit in the budget; nothing was charged or released.
            UnsafeInput: ``x`` holds NaN or Inf.
            IdempotencyKeyUsed: ``idempotency_key`` was already used for a release (a
                :class:`~gaussdp.errors.PrivacyError`); nothing new was charged or released.
        """
        _refuse_non_finite(x)
        receipt = self._charge(principal, mechanism.event, idempotency_key, key_id)
        if receipt.replayed:
            raise _key_used(receipt)
        if not cpu_limited():
            return Release(mechanism.release(x), receipt, self)
        with no_cpu_limit():  # charged: the release must follow (its cost is bounded by the input)
            return Release(mechanism.release(x), receipt, self)

    # -- reading -----------------------------------------------------------------------------------
    def spent(self, principal: str, *, as_of: Receipt | None = None) -> Spent:
        """Composed epsilon of everything charged to ``principal``, at its budget's delta.

        With ``as_of=receipt`` (a receipt of this principal), the spend right after that charge,
        composed from the receipt without reading the store.
        """
        row = self._row(principal)
        if as_of is not None and as_of.principal != principal:
            raise InvalidParameter(f"as_of is a receipt of principal {as_of.principal!r}, not {principal!r}")
        if as_of is not None and as_of.composed is not None:
            groups = as_of.composed
        else:
            groups = tuple(sorted(self.store.groups(principal).items()))
        if not groups:
            return Spent(0.0, 0.0)
        return Spent(self._composer.epsilon(row.accountant, row.delta, groups), row.delta)

    def increase(self, receipt: Receipt) -> float:
        """How much the charge of ``receipt`` raised its principal's composed epsilon (0 for a replay)."""
        if receipt.replayed or receipt.composed is None:
            return 0.0
        row = self._row(receipt.principal)
        key = event_json(receipt.event)
        before = tuple((k, c - 1 if k == key else c) for k, c in receipt.composed if k != key or c > 1)
        after_eps = self._composer.epsilon(row.accountant, row.delta, receipt.composed)
        before_eps = self._composer.epsilon(row.accountant, row.delta, before) if before else 0.0
        return max(0.0, after_eps - before_eps)

    def remaining(self, principal: str) -> Spent:
        """``budget.epsilon - spent.epsilon`` (at the budget's delta, floored at 0): :meth:`Budget.remaining`.

        Under tight accountants privacy does not add up linearly: whether a given next event fits is
        what :meth:`allowance` and :meth:`charge` decide, not this difference.
        """
        return self.budget(principal).remaining(self.spent(principal))

    def history(self, principal: str, limit: int | None = None) -> list[ChargeRecord]:
        """The charges of ``principal`` in order (the last ``limit`` if given)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidParameter(f"limit must be a non-negative int or None, got limit={limit!r}")
        self._row(principal)
        return [_record(c) for c in self.store.history(principal, limit)]

    def history_page(self, principal: str, *, after: int = 0, limit: int = 100) -> list[ChargeRecord]:
        """At most ``limit`` charges of ``principal`` with ``charge_id > after``, oldest first.

        Pages through a long history at a bounded cost per call: pass the last ``charge_id`` seen.
        """
        _check_page(after, limit)
        self._row(principal)
        return [_record(c) for c in self.store.charges_after(principal, after, limit, exact=True)]

    def export(self, prefix: str, *, after: int = 0, limit: int = 1000) -> list[ChargeRecord]:
        """At most ``limit`` charges of every principal starting with ``prefix``, ``charge_id > after``,
        by ``charge_id`` (an audit export, one page at a time)."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got prefix={prefix!r}")
        _check_page(after, limit)
        return [_record(c) for c in self.store.charges_after(prefix, after, limit)]

    def events(self, principal: str) -> list[tuple[Any, int]]:
        """The distinct events charged to ``principal`` with their counts (what the accountant composes)."""
        self._row(principal)
        return [(self._composer._event(k), c) for k, c in sorted(self.store.groups(principal).items())]


def _check_page(after: object, limit: object) -> None:
    for name, value, low in (("after", after, 0), ("limit", limit, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidParameter(f"{name} must be an int >= {low}, got {name}={value!r}")


def _record(c: StoredCharge) -> ChargeRecord:
    return ChargeRecord(
        c.charge_id,
        c.principal,
        event_dict(c.event_key),
        c.idempotency_key,
        c.created_at,
        c.within_budget,
        c.key_id,
    )


def _receipt(stored: StoredCharge, composed: tuple[tuple[str, int], ...] | None) -> Receipt:
    return Receipt(
        principal=stored.principal,
        charge_id=stored.charge_id,
        event=event_dict(stored.event_key),
        idempotency_key=stored.idempotency_key,
        created_at=stored.created_at,
        replayed=stored.replayed,
        within_budget=stored.within_budget,
        composed=composed,
    )


def _refuse_non_finite(x: Any) -> None:
    import numpy as np

    if isinstance(x, np.ndarray) and x.dtype.kind in "fc" and not np.isfinite(x).all():
        raise UnsafeInput("x holds NaN or Inf; nothing was charged or released")


def _key_used(receipt: Receipt) -> IdempotencyKeyUsed:
    return IdempotencyKeyUsed(
        f"idempotency_key={receipt.idempotency_key!r} was already charged and released (or answered) for "
        f"principal {receipt.principal!r}; a second noisy value would not be covered by that charge (the "
        "first response is the only one)",
        receipt,
    )
