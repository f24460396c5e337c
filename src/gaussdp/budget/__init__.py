"""The privacy budget ledger: per-principal budgets, charged atomically and durably before release.

>>> from gaussdp.budget import Budget, Ledger
>>> ledger = Ledger("memory://")            # or "sqlite:///ledger.db", "postgresql://..."

Stores: ``memory.py`` (in process), ``sqlite.py`` (embedded default, WAL), ``postgres.py``
(``SELECT ... FOR UPDATE``; needs the ``service`` extra for psycopg). See :class:`Ledger`.
"""

from __future__ import annotations

from gaussdp.budget._types import Budget, ChargeRecord, Receipt, Release, Spent
from gaussdp.budget.ledger import Ledger
from gaussdp.budget.store import (
    IdempotencyKeyUsed,
    LedgerContention,
    PrincipalConflict,
    StoreUnavailable,
    TenantLimitExceeded,
    UnknownPrincipal,
)
from gaussdp.budget.trackers import BudgetState, PrivacyBudgetTracker, PrivacyExpenditure, PrivacyTracker
from gaussdp.errors import BudgetExhausted

__all__ = [
    "Budget",
    "BudgetExhausted",
    "BudgetState",
    "ChargeRecord",
    "IdempotencyKeyUsed",
    "Ledger",
    "LedgerContention",
    "PrincipalConflict",
    "PrivacyBudgetTracker",
    "PrivacyExpenditure",
    "PrivacyTracker",
    "Receipt",
    "Release",
    "Spent",
    "StoreUnavailable",
    "TenantLimitExceeded",
    "UnknownPrincipal",
]
