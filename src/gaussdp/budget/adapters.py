"""A ledger behind the original in-memory trackers, so that their spends persist.

The private inference server's ``PrivacyBudgetTracker``
(``consume(epsilon, session_id) -> (ok, state)``) and the federated anomaly detector's
``PrivacyTracker`` (``record_expenditure(epsilon, delta, round_num)``) keep spends in a Python
list. :class:`SessionLedger` gives them one budget per session on a durable
:class:`~gaussdp.budget.Ledger` instead: charges are atomic across threads and processes, survive
restarts, and refuse (``policy="refuse"``) instead of warning after the fact.

With ``accountant="advanced"`` and ``(epsilon, 0)`` spends (the private inference server's queries), the
ledger's decision is the tracker's own rule: the composed epsilon is ``min(basic, advanced)`` with
``delta' = budget.delta`` (:class:`gaussdp.accounting.AdvancedComposition`).
"""

from __future__ import annotations

import threading
from typing import Any

from gaussdp.budget._types import Budget, Receipt, Spent
from gaussdp.budget.ledger import Ledger
from gaussdp.errors import BudgetExhausted

__all__ = ["SessionLedger"]


class SessionLedger:
    """Sessions that share one budget shape, on a ledger (principal = ``prefix + session_id``).

    Args:
        ledger: where the spends live (``Ledger("sqlite:///...")`` for persistence).
        budget: every session's budget (the private inference server: ``Budget(max_epsilon, delta)``).
        accountant: how a session's spends compose (``"advanced"`` matches the private inference server's
            tracker; ``"pld"`` is tighter for Gaussian events such as ``mechanism.event``).
        prefix: namespace of this tracker's sessions in a shared ledger.
    """

    def __init__(
        self, ledger: Ledger, budget: Budget, *, accountant: str = "advanced", prefix: str = ""
    ) -> None:
        if not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a gaussdp.budget.Ledger, got ledger={ledger!r}")
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a gaussdp.budget.Budget, got budget={budget!r}")
        self.ledger, self.budget, self.accountant, self.prefix = ledger, budget, accountant, str(prefix)
        self._opened: set[str] = set()
        self._lock = threading.Lock()

    def principal(self, session_id: str) -> str:
        """The ledger principal of ``session_id`` (opened with this budget on first use)."""
        p = f"{self.prefix}{session_id}"
        with self._lock:
            known = p in self._opened
        if not known:
            self.ledger.open(p, self.budget, accountant=self.accountant)
            with self._lock:
                self._opened.add(p)
        return p

    def charge(self, session_id: str, event: Any, idempotency_key: str | None = None) -> Receipt:
        """Charge ``event`` to the session; :class:`~gaussdp.errors.BudgetExhausted` if it does not fit."""
        return self.ledger.charge(self.principal(session_id), event, idempotency_key)

    def try_charge(self, session_id: str, event: Any, idempotency_key: str | None = None) -> Receipt | None:
        """Like :meth:`charge`, but ``None`` instead of raising when the budget cannot pay (``ok=False``)."""
        try:
            return self.charge(session_id, event, idempotency_key)
        except BudgetExhausted:
            return None

    def spent(self, session_id: str) -> Spent:
        """The session's composed epsilon at the budget's delta (zero for a new session)."""
        return self.ledger.spent(self.principal(session_id))

    def events(self, session_id: str) -> list[tuple[Any, int]]:
        """The session's distinct events with their counts."""
        return self.ledger.events(self.principal(session_id))

    def sessions(self) -> list[str]:
        """Ids of this tracker's sessions on the ledger."""
        return [p[len(self.prefix) :] for p in self.ledger.principals(self.prefix)]
