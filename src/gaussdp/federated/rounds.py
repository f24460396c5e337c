"""Federated rounds in the budget ledger: one principal per run (central DP) or per client (local DP).

Every charge of a federated run carries the idempotency key ``"<principal>#round=<r>"``, so that

* a round is charged at most once, even if the server retries after a crash (a replayed key raises:
  a second noisy update would not be covered by the one charge);
* a new server object on the same ledger URL and principal resumes the run: the rounds done and the
  privacy spent are read back from the ledger (``sqlite://`` and ``postgresql://`` persist);
* the federated anomaly detector's report, grouped by round, is rebuilt from the ledger's own records
  (:func:`round_report`), never from a second bookkeeping that could disagree with the ledger.
"""

from __future__ import annotations

import re
from typing import Any

from gaussdp._format import format_exact, format_upper
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyError

__all__ = ["RoundLedger", "privacy_accountant", "round_key", "round_of", "round_report"]

_ROUND = re.compile(r"#round=(\d+)(?:#|$)")


def round_key(principal: str, round_num: int, tag: str = "") -> str:
    """The idempotency key of ``principal``'s charge for round ``round_num`` (``tag`` for a second kind)."""
    return f"{principal}#round={int(round_num)}" + (f"#{tag}" if tag else "")


def round_of(idempotency_key: str | None) -> int | None:
    """The round number encoded in a federated idempotency key, or ``None``."""
    if not idempotency_key:
        return None
    m = _ROUND.search(idempotency_key)
    return int(m.group(1)) if m else None


def _as_ledger(ledger: Any) -> Any:
    if isinstance(ledger, str):
        from gaussdp.budget import Ledger

        return Ledger(ledger)
    if not hasattr(ledger, "charge") or not hasattr(ledger, "open"):
        raise TypeError(
            f"ledger must be a gaussdp.budget.Ledger or a ledger URL, got {type(ledger).__name__}"
        )
    return ledger


class RoundLedger:
    """A ledger principal seen as a sequence of federated rounds.

    Args:
        ledger: a :class:`gaussdp.budget.Ledger` or its URL.
        principal: the run (central DP) or the client (local DP).
        epsilon, delta: the budget the principal is opened with (opening again with the same budget
            resumes; a different budget is refused by the ledger: budgets never grow).
        accountant: the ledger's accountant for this principal (``"pld"`` by default).
    """

    def __init__(self, ledger: Any, principal: str, *, epsilon: float, delta: float, accountant: str = "pld"):
        from gaussdp.budget import Budget

        self.ledger = _as_ledger(ledger)
        self.principal = principal
        self.budget = Budget(epsilon, delta)
        self.accountant = accountant
        self.ledger.open(principal, self.budget, accountant=accountant)

    @property
    def delta(self) -> float:
        return self.budget.delta

    @property
    def rounds_done(self) -> int:
        """The highest round number charged to this principal (0 before the first round)."""
        rounds = [round_of(r.idempotency_key) for r in self.ledger.history(self.principal)]
        return max([r for r in rounds if r is not None], default=0)

    def epsilon_spent(self) -> float:
        """Composed epsilon of everything charged, at the budget's delta (the ledger's accountant)."""
        return float(self.ledger.spent(self.principal).epsilon)

    def allowance(self, event: Any) -> int:
        """How many more charges of ``event`` fit in the budget now."""
        return int(self.ledger.allowance(self.principal, event))

    def would_exceed(self, event: Any, rounds: int = 1) -> bool:
        """Whether ``rounds`` more charges of ``event`` would take the composed epsilon past the budget."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise InvalidParameter(f"rounds must be an int >= 1, got rounds={rounds!r}")
        return self.allowance(event) < rounds

    def epsilon_after(self, event: Any, rounds: int) -> float:
        """Composed epsilon (at the budget's delta) if ``rounds`` more charges of ``event`` were added."""
        from gaussdp.accounting import accountant

        acc = accountant(self.accountant)
        for ev, count in self.ledger.events(self.principal):
            acc.compose(ev, count)
        if rounds > 0:
            acc.compose(event, rounds)
        return float(acc.epsilon(self.budget.delta))

    def check_round(self, round_num: int, event: Any) -> None:
        """Raise :class:`BudgetExhausted` with a clear message if round ``round_num`` would not fit."""
        if self.would_exceed(event, 1):
            spent = self.epsilon_spent()
            after = self.epsilon_after(event, 1)
            raise BudgetExhausted(
                f"stopping before round {round_num} of {self.principal!r}: it would take the epsilon from "
                f"{format_upper(spent)} to {format_upper(after)} > budget epsilon="
                f"{format_exact(self.budget.epsilon)} at delta={format_exact(self.budget.delta)} "
                f"({self.accountant} accountant); nothing was sampled, charged or "
                "released"
            )

    def charge_round(self, round_num: int, event: Any, tag: str = "") -> Any:
        """Charge round ``round_num`` once (durably) before its release; a retry of the same round raises."""
        receipt = self.ledger.charge(
            self.principal, event, idempotency_key=round_key(self.principal, round_num, tag)
        )
        if receipt.replayed:
            raise PrivacyError(
                f"round {round_num} of {self.principal!r} was already charged (and possibly released); "
                "releasing it again would not be covered by that charge: continue with the next round"
            )
        return receipt

    def report(self) -> dict[str, Any]:
        """The anomaly detector's ``PrivacyTracker.get_report()`` for this principal, by round."""
        return privacy_accountant(self.ledger, self.principal).get_report()


def privacy_accountant(ledger: Any, principal: str) -> Any:
    """The federated anomaly detector's :class:`gaussdp.budget.PrivacyTracker` filled from the ledger.

    Every charge of ``principal`` becomes one expenditure of its round (from the idempotency key),
    with its exact event. The budget's delta is split evenly over the ``n`` charges (each spend is
    ``(epsilon_i, delta/n)``-DP with ``epsilon_i`` its own PLD epsilon), so that the accountant's
    total delta is the budget's delta and its tight total epsilon (the ledger's accountant) is the
    ledger's own figure. The ledger stays the source of truth; this is a read-only view.
    """
    from gaussdp.accounting import accountant, event_from_dict
    from gaussdp.budget.trackers import PrivacyExpenditure, PrivacyTracker

    led = _as_ledger(ledger)
    budget = led.budget(principal)
    acc = PrivacyTracker(target_epsilon=budget.epsilon, accountant=led.accountant(principal))
    records = led.history(principal)
    if not records:
        return acc
    per_delta = budget.delta / len(records)
    own: dict[str, float] = {}
    for rec in records:
        key = repr(sorted(rec.event.items()))
        event = event_from_dict(rec.event)
        if key not in own:
            own[key] = float(accountant("pld").compose(event).epsilon(per_delta))
        r = round_of(rec.idempotency_key)
        # Filled directly (not via record_expenditure) so that n records cost one PLD evaluation per
        # distinct event instead of a full re-composition per record; same validated values.
        acc.expenditures.append(
            PrivacyExpenditure(
                epsilon=own[key],
                delta=per_delta,
                round_num=r if r is not None else 0,
                description=f"{principal}: charge {rec.charge_id}",
                event=event,
            )
        )
    return acc


def round_report(ledger: Any, principals: list[str] | None = None, *, prefix: str = "") -> dict[str, Any]:
    """The anomaly detector's ``PrivacyTracker.get_report()``, built from the ledger's records, by round.

    Each principal is accounted by its own budget's accountant; ``total_epsilon`` is the largest
    composed epsilon over the principals (each principal is a different client, or one run, so their
    guarantees do not add up), at each principal's budget delta. Unlike the federated anomaly detector (basic
    composition, deltas summed), every figure is the ledger's tight composition.

    Returns:
        A dict with the federated anomaly detector's keys: ``total_epsilon``, ``total_delta``,
        ``num_expenditures``, ``target_epsilon``, ``remaining_budget``, ``budget_exceeded``,
        ``expenditures_by_round`` (``"round_<r>" -> [{"principal", "event", "charge_id", "description"}]``),
        plus ``per_principal`` with each principal's spent epsilon and budget.
    """
    led = _as_ledger(ledger)
    names = list(principals) if principals is not None else led.principals(prefix)
    by_round: dict[str, list[dict[str, Any]]] = {}
    per: dict[str, dict[str, float]] = {}
    n = 0
    for p in names:
        budget = led.budget(p)
        spent = led.spent(p)
        per[p] = {
            "epsilon": float(spent.epsilon),
            "delta": float(budget.delta),
            "target_epsilon": float(budget.epsilon),
            "remaining": float(budget.remaining(spent).epsilon),
        }
        for rec in led.history(p):
            n += 1
            r = round_of(rec.idempotency_key)
            key = f"round_{r}" if r is not None else "unrounded"
            by_round.setdefault(key, []).append(
                {
                    "principal": p,
                    "event": dict(rec.event),
                    "charge_id": rec.charge_id,
                    "description": f"{p}: {rec.event.get('type')} charged"
                    + (f" in round {r}" if r is not None else ""),
                }
            )
    worst = max(per.values(), key=lambda d: d["epsilon"] / d["target_epsilon"], default=None)
    ordered = dict(sorted(by_round.items(), key=lambda kv: _order(kv[0])))
    return {
        "total_epsilon": worst["epsilon"] if worst else 0.0,
        "total_delta": worst["delta"] if worst else 0.0,
        "num_expenditures": n,
        "target_epsilon": worst["target_epsilon"] if worst else None,
        "remaining_budget": worst["remaining"] if worst else None,
        "budget_exceeded": any(d["epsilon"] > d["target_epsilon"] for d in per.values()),
        "expenditures_by_round": ordered,
        "per_principal": per,
    }


def _order(key: str) -> tuple[int, int]:
    if key.startswith("round_"):
        return (0, int(key[len("round_") :]))
    return (1, 0)
