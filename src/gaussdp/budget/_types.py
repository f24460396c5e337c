"""Value types of the ledger: budgets, receipts, charge records and spent-privacy snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from gaussdp._validate import check_delta, check_epsilon

__all__ = ["Budget", "ChargeRecord", "Receipt", "Release", "Spent"]


@dataclass(frozen=True)
class Budget:
    """The most privacy a principal may ever spend: ``(epsilon, delta)``-DP over all its charges.

    A charge is accepted only while the composed epsilon of everything charged so far, *including* the
    new event, evaluated at this ``delta`` by the principal's accountant, stays ``<= epsilon``
    (privacy-filter semantics; the neighbouring relation is add/remove of one record).

    Raises:
        TypeError: ``epsilon`` or ``delta`` is not a real number.
        InvalidParameter: ``epsilon <= 0`` or ``delta`` outside ``(0, 1)``.
    """

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon))
        object.__setattr__(self, "delta", check_delta(self.delta))

    def remaining(self, spent: Spent) -> Spent:
        """``epsilon - spent.epsilon`` floored at 0, at this budget's ``delta`` (what is left to show).

        Under tight accountants privacy does not add up linearly: whether a given next event fits is
        what :meth:`Ledger.allowance` and :meth:`Ledger.charge` decide, not this difference.
        """
        return Spent(max(0.0, self.epsilon - spent.epsilon), self.delta)


@dataclass(frozen=True)
class Spent:
    """Privacy spent so far: the composed ``epsilon`` at the budget's ``delta`` (an upper bound).

    ``delta`` is 0 and ``epsilon`` is 0 while nothing has been charged.
    """

    epsilon: float
    delta: float


@dataclass(frozen=True)
class ChargeRecord:
    """One charge as stored: what was released (``event``, as a dict) and when."""

    charge_id: int
    principal: str
    event: dict[str, Any]
    idempotency_key: str | None
    created_at: float
    within_budget: bool
    key_id: str | None = None  # the service's API key id that made the charge (not secret), if any


@dataclass(frozen=True)
class Receipt:
    """Proof that an event was charged to a principal, durably, before anything was released.

    Attributes:
        principal: who was charged.
        charge_id: the store's identifier of the charge (unique per ledger).
        event: the charged event as a dict (``event.to_dict()``).
        idempotency_key: the key given to :meth:`Ledger.charge`, if any.
        created_at: Unix time of the original charge.
        replayed: ``True`` when this receipt is the earlier charge of a retried idempotency key: nothing
            new was charged, so nothing new may be released under it.
        within_budget: ``False`` only under ``policy="warn"`` for a charge recorded past the budget.
        composed: the principal's grouped history right after this charge, as ``(event_key, count)``
            pairs (``None`` for a replayed receipt); ``Ledger.spent(principal, as_of=receipt)`` composes
            it without reading the store again.
    """

    principal: str
    charge_id: int
    event: dict[str, Any]
    idempotency_key: str | None
    created_at: float
    replayed: bool
    within_budget: bool
    composed: tuple[tuple[str, int], ...] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Release:
    """What :meth:`Ledger.release` answers: the released value and the receipt of its charge.

    Attributes:
        value: ``mechanism.release(x)``, released only after the charge was on record.
        receipt: the :class:`Receipt` of that charge (never a replayed one).
        spent: the principal's composed spend right after this charge (an upper bound), computed
            from the receipt when first read.
        remaining: ``budget.epsilon - spent.epsilon`` floored at 0, at the budget's delta.
    """

    value: Any
    receipt: Receipt
    _ledger: Any = field(repr=False, compare=False)

    @property
    def charge_id(self) -> int:
        """The store's identifier of the charge (``receipt.charge_id``)."""
        return self.receipt.charge_id

    @cached_property
    def spent(self) -> Spent:
        return self._ledger.spent(self.receipt.principal, as_of=self.receipt)  # type: ignore[no-any-return]

    @cached_property
    def remaining(self) -> Spent:
        budget: Budget = self._ledger.budget(self.receipt.principal)
        return budget.remaining(self.spent)
