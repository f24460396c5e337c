"""The ledger-backed privacy trackers of the federated anomaly detector and the inference server.

* The federated anomaly detector: :class:`PrivacyTracker`, basic composition by default as documented, with
  an ``accountant=`` option for tighter totals.
* The private inference server: :class:`PrivacyBudgetTracker`, per-session advanced composition; it
  refuses a spend that would exceed the budget (the original design only warned; ``policy="warn"``
  keeps that behaviour as an explicit opt-in).

Both can take a durable ledger (``ledger=``, a :class:`gaussdp.budget.Ledger` or its URL such as
``"sqlite:///ledger.db"``) so that their spends persist across objects and processes. They are faces
over the accounting layer and the ledger, so they sit in the budget layer, above both.

Neighbouring relation: add/remove of one record, as everywhere in gaussdp.
"""

from __future__ import annotations

import logging
import math
import re
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from gaussdp._format import format_exact, format_upper
from gaussdp._validate import (
    check_choice,
    check_delta,
    check_epsilon,
    real_number,
)
from gaussdp.accounting.advanced import advanced_bound
from gaussdp.accounting.events import (
    EpsilonDeltaEvent,
    Event,
)
from gaussdp.accounting.registry import accountant as make_accountant
from gaussdp.budget._types import Budget
from gaussdp.budget.adapters import SessionLedger
from gaussdp.budget.ledger import Ledger
from gaussdp.budget.store import UnknownPrincipal
from gaussdp.errors import InvalidParameter, PrivacyError, PrivacyWarning

__all__ = ["BudgetState", "PrivacyBudgetTracker", "PrivacyExpenditure", "PrivacyTracker"]

logger = logging.getLogger(__name__)

# Round number of a document-003 charge, kept in its ledger idempotency key (the same
# ``#round=N#...`` form as gaussdp.federated.rounds.round_key, so that module can read it too).
_ROUND = re.compile(r"#round=(-?\d+)(?:#|$)")


def _as_ledger(ledger: object, policy: Literal["refuse", "warn"] | None = None) -> tuple[Any, bool]:
    """``(Ledger, owned)``: ``ledger`` itself, or a new :class:`gaussdp.budget.Ledger` for a URL.

    ``owned`` is True when the ledger was opened here (the caller then closes it). With ``policy``,
    a given ledger must enforce the same policy as its caller.
    """
    if isinstance(ledger, str):
        return (Ledger(ledger) if policy is None else Ledger(ledger, policy=policy)), True
    if not isinstance(ledger, Ledger):
        raise TypeError(
            f"ledger must be a gaussdp.budget.Ledger or a ledger URL, got ledger={ledger!r} "
            f"({type(ledger).__name__})"
        )
    if policy is not None and ledger.policy != policy:
        raise InvalidParameter(
            f"the ledger's policy={ledger.policy!r} differs from policy={policy!r}; give a ledger "
            "with the same policy (or its URL)"
        )
    return ledger, False


# ----- the federated anomaly detector -----------------------------------------------------------------------
@dataclass(frozen=True)
class PrivacyExpenditure:
    """One recorded spend: (epsilon, delta) in a round, optionally the event that spent it."""

    epsilon: float
    delta: float
    round_num: int
    description: str = ""
    event: Event | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "description": self.description,
        }
        if self.event is not None:
            out["event"] = self.event.to_dict()
        return out


class PrivacyTracker:
    """Records privacy spends and totals them: basic composition by default, as documented.

    ``get_total_privacy(accountant="pld")`` composes the same spends with a tighter accountant: a
    spend recorded with ``event=`` (e.g. ``mechanism.event``) enters with its exact mechanism, the
    others as (epsilon, delta)-DP mechanisms. A total above ``target_epsilon`` logs a warning.

    With ``ledger=`` the spends are kept durably on a :class:`gaussdp.budget.Ledger`, under
    ``principal``, with the budget ``(target_epsilon, target_delta)`` and this accountant.
    :meth:`record_expenditure` charges the ledger *before* recording anything: a spend that does not
    fit raises :class:`~gaussdp.errors.BudgetExhausted` (instead of the warning after the fact) and
    nothing is recorded. The totals and the report are then read from the ledger, so a new
    accountant on the same ledger and principal sees every earlier spend. The totals are the
    ledger's: the composed epsilon at the budget's delta (``target_delta``), not the sum of the
    deltas. The ledger keeps the events and rounds, not the descriptions.

    Args:
        target_epsilon: the epsilon budget (with a ledger: of the principal; taken from the ledger
            when the principal is already open there and this is None).
        accountant: how spends compose (``"basic"``, as documented; also the ledger principal's
            accountant).
        ledger: ``None`` (in memory), a :class:`gaussdp.budget.Ledger`, or its URL.
        principal: the ledger principal of these spends.
        target_delta: the delta of the ledger budget (taken from the ledger for an open principal);
            it must exceed the sum of the recorded deltas. Unused without a ledger.

    Raises:
        InvalidParameter: a new ledger principal without ``target_epsilon`` and ``target_delta``.
        gaussdp.budget.PrincipalConflict: ``principal`` is open on the ledger with another budget or
            accountant.

    >>> acc = PrivacyTracker(target_epsilon=5.0)
    >>> acc.record_expenditure(epsilon=1.0, delta=1e-5, round_num=1)
    >>> acc.record_expenditure(epsilon=1.0, delta=1e-5, round_num=2)
    >>> acc.get_total_privacy(), acc.check_budget(), acc.get_remaining_budget()
    ((2.0, 2e-05), True, 3.0)
    """

    def __init__(
        self,
        target_epsilon: float | None = None,
        *,
        accountant: str = "basic",
        ledger: Any = None,
        principal: str = "doc003/default",
        target_delta: float | None = None,
    ) -> None:
        self.target_epsilon = (
            None if target_epsilon is None else check_epsilon(target_epsilon, "target_epsilon")
        )
        self.target_delta = None if target_delta is None else check_delta(target_delta, "target_delta")
        make_accountant(accountant)  # validate the name; totals must be upper bounds
        self.accountant_name = accountant
        self.expenditures: list[PrivacyExpenditure] = []
        self.ledger: Any = None
        self.principal: str | None = None
        self._owns_ledger = False
        if ledger is not None:
            self.ledger, self._owns_ledger = _as_ledger(ledger)
            try:
                self._open_principal(principal)
            except BaseException:
                self.close()
                raise

    def _open_principal(self, principal: str) -> None:
        try:
            on_record = self.ledger.budget(principal)
        except UnknownPrincipal:
            on_record = None
        eps = self.target_epsilon if self.target_epsilon is not None else getattr(on_record, "epsilon", None)
        dl = self.target_delta if self.target_delta is not None else getattr(on_record, "delta", None)
        if eps is None or dl is None:
            raise InvalidParameter(
                f"principal={principal!r} is new on the ledger: give target_epsilon and target_delta, "
                "the budget the ledger enforces"
            )
        self.ledger.open(principal, Budget(eps, dl), accountant=self.accountant_name)
        self.principal, self.target_epsilon, self.target_delta = principal, eps, dl

    def close(self) -> None:
        """Close the ledger if this accountant opened it from a URL (a given ledger stays open)."""
        if self._owns_ledger and self.ledger is not None:
            self.ledger.close()
            self._owns_ledger = False

    def record_expenditure(
        self,
        epsilon: float,
        delta: float,
        round_num: int,
        description: str = "",
        *,
        event: Event | None = None,
    ) -> None:
        """Record a spend (validated first: nothing is recorded when it raises).

        With a ledger, the spend (``event``, or an ``EpsilonDeltaEvent(epsilon, delta)``) is charged
        to the principal first, durably, and recorded here only once the ledger accepted it.

        Raises:
            InvalidParameter: bad values, or ``event`` is not (epsilon, delta)-DP (its own epsilon
                at ``delta`` exceeds ``epsilon``).
            BudgetExhausted: with a ledger, the spend does not fit in the budget; nothing was charged
                or recorded.
        """
        eps = real_number("epsilon", epsilon)
        if eps < 0.0:
            raise InvalidParameter(f"epsilon must be >= 0, got epsilon={epsilon!r}")
        d = real_number("delta", delta)
        if not 0.0 <= d < 1.0:
            raise InvalidParameter(f"delta must be in [0, 1), got delta={delta!r}")
        if isinstance(round_num, bool) or not isinstance(round_num, int):
            raise TypeError(f"round_num must be an integer, got round_num={round_num!r}")
        if event is not None:
            if not isinstance(event, Event):
                raise TypeError(f"event must be a gaussdp Event, got event={event!r}")
            if d <= 0.0:
                raise InvalidParameter("a Gaussian event needs delta > 0 to be (epsilon, delta)-DP")
            own = make_accountant("pld").compose(event).epsilon(d)
            if own > eps * (1.0 + 1e-9):
                raise InvalidParameter(
                    f"event {event!r} is only ({format_upper(own)}, {format_exact(d)})-DP, not "
                    f"({format_exact(eps)}, {format_exact(d)})-DP"
                )
        if self.ledger is not None:  # charge before recording: BudgetExhausted records nothing
            self.ledger.charge(
                self.principal,
                event if event is not None else EpsilonDeltaEvent(eps, d),
                idempotency_key=f"#round={round_num}#{uuid.uuid4().hex}",
            )
        self.expenditures.append(PrivacyExpenditure(eps, d, round_num, str(description), event))
        total_eps, _ = self.get_total_privacy()
        logger.debug(
            "recorded spend round=%s eps=%s delta=%s; total eps=%s",
            round_num,
            eps,
            d,
            format_upper(total_eps),
        )
        if self.target_epsilon is not None and total_eps > self.target_epsilon:
            logger.warning(
                "Privacy budget exceeded! Total epsilon=%s > target=%s",
                format_upper(total_eps),
                format_exact(self.target_epsilon),
            )

    def get_total_privacy(self, accountant: str | None = None) -> tuple[float, float]:
        """(total_epsilon, total_delta). Basic composition unless ``accountant`` says otherwise.

        With a tighter accountant, the total delta stays the basic one (sum of deltas) and the
        epsilon is that accountant's epsilon at it, never more than the basic sum.

        With a ledger: every spend on record for the principal, composed by the ledger at the
        budget's delta (``target_delta``); another ``accountant`` can only tighten that epsilon.
        """
        if self.ledger is not None:
            return self._ledger_totals(accountant)
        if not self.expenditures:
            return (0.0, 0.0)
        basic_eps = math.fsum(e.epsilon for e in self.expenditures)
        total_delta = math.fsum(e.delta for e in self.expenditures)
        name = accountant or self.accountant_name
        if name == "basic" or total_delta <= 0.0 or total_delta >= 1.0:
            return (basic_eps, total_delta)
        acc = make_accountant(name)
        for e in self.expenditures:
            acc.compose(e.event if e.event is not None else EpsilonDeltaEvent(e.epsilon, e.delta))
        return (min(basic_eps, acc.epsilon(total_delta)), total_delta)

    def _ledger_totals(self, accountant: str | None) -> tuple[float, float]:
        spent = self.ledger.spent(self.principal)
        if spent.epsilon == 0.0 and spent.delta == 0.0:
            return (0.0, 0.0)
        name = accountant or self.accountant_name
        if name == self.ledger.accountant(self.principal):
            return (float(spent.epsilon), float(spent.delta))
        acc = make_accountant(name)
        for ev, count in self.ledger.events(self.principal):
            acc.compose(ev, count)
        return (min(float(spent.epsilon), acc.epsilon(spent.delta)), float(spent.delta))

    def check_budget(self) -> bool:
        """True while the total epsilon is within ``target_epsilon`` (always True without one)."""
        if self.target_epsilon is None:
            return True
        return self.get_total_privacy()[0] <= self.target_epsilon

    def get_remaining_budget(self) -> float | None:
        """``target_epsilon - total_epsilon`` (>= 0), or None without a target."""
        if self.target_epsilon is None:
            return None
        return max(0.0, self.target_epsilon - self.get_total_privacy()[0])

    def get_report(self) -> dict[str, Any]:
        """Totals, budget state, and the spends grouped by round (``"round_<n>"``)."""
        total_epsilon, total_delta = self.get_total_privacy()
        by_round: dict[str, list[dict[str, Any]]] = {}
        extra: dict[str, Any] = {}
        if self.ledger is None:
            for e in self.expenditures:
                by_round.setdefault(f"round_{e.round_num}", []).append(e.to_dict())
            count = len(self.expenditures)
        else:  # every charge on record, also those of earlier objects and processes
            records = self.ledger.history(self.principal)
            for rec in records:
                m = _ROUND.search(rec.idempotency_key or "")
                entry: dict[str, Any] = {"event": rec.event, "charge_id": rec.charge_id}
                if rec.event.get("type") == EpsilonDeltaEvent.kind:
                    entry = {"epsilon": rec.event["epsilon"], "delta": rec.event["delta"], **entry}
                by_round.setdefault(f"round_{m.group(1) if m else 'unknown'}", []).append(entry)
            count = len(records)
            extra["ledger"] = {
                "url": self.ledger.url,
                "principal": self.principal,
                "budget": {"epsilon": self.target_epsilon, "delta": self.target_delta},
            }
        return {
            "total_epsilon": total_epsilon,
            "total_delta": total_delta,
            "num_expenditures": count,
            "target_epsilon": self.target_epsilon,
            "remaining_budget": self.get_remaining_budget(),
            "budget_exceeded": not self.check_budget(),
            "accountant": self.accountant_name,
            "neighbouring_relation": "add/remove",
            "expenditures_by_round": by_round,
            **extra,
        }


# ----- the private inference server -------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetState:
    """A session's spent privacy: ``total_epsilon`` at ``total_delta`` after ``num_queries``."""

    session_id: str
    total_epsilon: float
    total_delta: float
    num_queries: int
    max_epsilon: float
    exhausted: bool
    epsilons: tuple[tuple[float, float], ...] = field(default=(), repr=False)


class PrivacyBudgetTracker:
    """Per-session budgets composed by the advanced composition theorem (inference server), refusing.

    ``consume(epsilon, session_id)`` charges one query that is (epsilon, delta_query)-DP. The
    session's total is ``min(basic, advanced)`` with ``delta' = delta`` (both theorems, so the
    smaller holds), at total delta ``sum delta_query + delta``. A query that would take the total
    past ``max_epsilon`` is refused: ``(False, state)`` and nothing is charged. ``policy="warn"``
    is the document's behaviour (charge anyway, return False, warn) and weakens the guarantee.

    With ``ledger=`` each session is a principal ``prefix + session_id`` of a durable
    :class:`gaussdp.budget.Ledger`, opened with ``Budget(max_epsilon, delta)`` and the ``"advanced"``
    accountant (the same ``min(basic, advanced)`` rule). A query is charged to the ledger, atomically
    across threads and processes, only if it passes this rule; the spends survive the tracker, so a
    new tracker on the same ledger continues each session where it stopped. A ledger never forgets:
    :meth:`reset` is refused, use a new session id. One difference: the ledger's total delta is the
    budget's ``delta``, so queries with ``delta > 0`` are refused once their deltas sum to it.

    Args:
        max_epsilon: per-session budget.
        delta: delta' of the advanced composition theorem (with a ledger: the budget's delta).
        policy: ``"refuse"`` (default) or ``"warn"``; a given ledger must have the same policy.
        ledger: ``None`` (in memory), a :class:`gaussdp.budget.Ledger`, or its URL (e.g.
            ``"sqlite:///ledger.db"``; then opened with ``policy`` and closed by :meth:`close`).
        prefix: namespace of this tracker's sessions on the ledger.

    >>> t = PrivacyBudgetTracker(max_epsilon=10.0, delta=1e-5)
    >>> ok, state = t.consume(1.0, session_id="s1")
    >>> ok, state.total_epsilon
    (True, 1.0)
    """

    def __init__(
        self,
        max_epsilon: float = 10.0,
        delta: float = 1e-5,
        *,
        policy: Literal["refuse", "warn"] = "refuse",
        ledger: Any = None,
        prefix: str = "doc000/",
    ) -> None:
        self.max_epsilon = check_epsilon(max_epsilon, "max_epsilon")
        self.delta = check_delta(delta)
        check_choice("policy", policy, ("refuse", "warn"))
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got prefix={prefix!r}")
        self.policy = policy
        self.ledger: Any = None
        self._book: Any = None
        self._owns_ledger = False
        self._sessions: dict[str, list[tuple[float, float]]] = {}
        if ledger is not None:
            self.ledger, self._owns_ledger = _as_ledger(ledger, policy)
            self._book = SessionLedger(
                self.ledger, Budget(self.max_epsilon, self.delta), accountant="advanced", prefix=prefix
            )

    def close(self) -> None:
        """Close the ledger if this tracker opened it from a URL (a given ledger stays open)."""
        if self._owns_ledger and self.ledger is not None:
            self.ledger.close()
            self._owns_ledger = False

    def _spends(self, session_id: str) -> list[tuple[float, float]]:
        """The session's (epsilon, delta) queries: from the ledger when there is one."""
        if self._book is None:
            return self._sessions.get(session_id, [])
        spends: list[tuple[float, float]] = []
        for event, count in self._book.events(session_id):
            if not isinstance(event, EpsilonDeltaEvent):
                raise InvalidParameter(
                    f"session {session_id!r} holds {event!r} on the ledger, not an (epsilon, delta) query "
                    "of this tracker; use another prefix"
                )
            spends.extend([(event.epsilon, event.delta)] * count)
        return spends

    def _state(self, session_id: str, spends: list[tuple[float, float]]) -> BudgetState:
        if not spends:
            return BudgetState(session_id, 0.0, 0.0, 0, self.max_epsilon, False)
        basic = math.fsum(e for e, _ in spends)
        d_sum = math.fsum(d for _, d in spends)
        adv = advanced_bound([(e, 1) for e, _ in spends], self.delta)
        if adv < basic:
            total, total_delta = adv, d_sum + self.delta
        else:
            total, total_delta = basic, d_sum
        return BudgetState(
            session_id,
            total,
            total_delta,
            len(spends),
            self.max_epsilon,
            total >= self.max_epsilon,
            tuple(spends),
        )

    def state(self, session_id: str = "default") -> BudgetState:
        """The current state of a session (zero for an unknown session)."""
        return self._state(str(session_id), self._spends(str(session_id)))

    def consume(
        self, epsilon: float, session_id: str = "default", *, delta: float = 0.0
    ) -> tuple[bool, BudgetState]:
        """Charge one (epsilon, delta)-DP query to ``session_id``; returns ``(ok, state)``."""
        eps = check_epsilon(epsilon)
        d = real_number("delta", delta)
        if not 0.0 <= d < 1.0:
            raise InvalidParameter(f"delta must be in [0, 1), got delta={delta!r}")
        sid = str(session_id)
        if self._book is not None:
            return self._consume_on_ledger(sid, eps, d)
        spends = self._sessions.get(sid, [])
        candidate = self._state(sid, [*spends, (eps, d)])
        if candidate.total_epsilon <= self.max_epsilon:
            self._sessions[sid] = [*spends, (eps, d)]
            return True, candidate
        if self.policy == "refuse":
            self._log_refusal(sid, eps, candidate.total_epsilon)
            return False, self._state(sid, spends)
        self._sessions[sid] = [*spends, (eps, d)]
        self._warn_exceeded(sid, candidate.total_epsilon, stacklevel=3)
        return False, candidate

    def _consume_on_ledger(self, sid: str, eps: float, d: float) -> tuple[bool, BudgetState]:
        spends = self._spends(sid)
        candidate = self._state(sid, [*spends, (eps, d)])
        fits = candidate.total_epsilon <= self.max_epsilon
        if not fits and self.policy == "refuse":
            self._log_refusal(sid, eps, candidate.total_epsilon)
            return False, self._state(sid, spends)
        # The ledger decides again, atomically with its write: a concurrent spend (another tracker,
        # thread or process) may have taken the room this snapshot saw. Under policy="warn" it
        # records the query anyway (within_budget=False).
        receipt = self._book.try_charge(sid, EpsilonDeltaEvent(eps, d))
        state = self._state(sid, self._spends(sid))
        if receipt is None:  # refused by the ledger: nothing was charged
            logger.warning(
                "session %s: the ledger refused a query of epsilon=%s, delta=%s (budget max_epsilon=%s, "
                "delta=%s)",
                sid,
                format_exact(eps),
                format_exact(d),
                format_exact(self.max_epsilon),
                format_exact(self.delta),
            )
            return False, state
        if fits and receipt.within_budget:
            return True, state
        self._warn_exceeded(sid, state.total_epsilon, stacklevel=4)
        return False, state

    def _log_refusal(self, sid: str, eps: float, total: float) -> None:
        logger.warning(
            "session %s: refused a query of epsilon=%s (total would be %s > max_epsilon=%s)",
            sid,
            format_exact(eps),
            format_upper(total),
            format_exact(self.max_epsilon),
        )

    def _warn_exceeded(self, sid: str, total: float, *, stacklevel: int) -> None:
        warnings.warn(
            f"session {sid}: privacy budget exceeded (total epsilon={format_upper(total)} > "
            f"max_epsilon={format_exact(self.max_epsilon)}); policy='warn' charged it anyway",
            PrivacyWarning,
            stacklevel=stacklevel,
        )

    def reset(self, session_id: str) -> None:
        """Forget a session's spends (a new session gets a fresh budget).

        Raises:
            PrivacyError: the tracker is on a ledger, which never forgets a spend; use a new
                session id instead.
        """
        if self._book is not None:
            raise PrivacyError(
                f"cannot reset session {str(session_id)!r}: its spends are on the ledger "
                f"{self.ledger.url!r}, which never forgets a spend; use a new session id instead"
            )
        self._sessions.pop(str(session_id), None)
