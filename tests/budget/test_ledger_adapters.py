"""The source documents' trackers on a durable ledger: same decisions, spends that persist."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaussdp.accounting import EpsilonDeltaEvent
from gaussdp.budget import Budget, Ledger
from gaussdp.budget.adapters import SessionLedger


def test_document_000_tracker_rule_on_a_ledger_matches_the_in_memory_tracker(tmp_path: Path) -> None:
    from gaussdp.budget import PrivacyBudgetTracker

    tracker = PrivacyBudgetTracker(max_epsilon=10.0, delta=1e-5)
    in_memory = 0
    while tracker.consume(1.0, session_id="s1")[0]:
        in_memory += 1
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger(url) as ledger:
        sessions = SessionLedger(ledger, Budget(10.0, 1e-5), accountant="advanced", prefix="doc000/")
        durable = 0
        while sessions.try_charge("s1", EpsilonDeltaEvent(1.0)) is not None:
            durable += 1
        assert durable == in_memory >= 10  # advanced composition at delta'=1e-5 beats the plain sum here
        assert sessions.spent("s1").epsilon == pytest.approx(tracker.state("s1").total_epsilon)
    with Ledger(url) as ledger:  # a restart keeps the session spent
        sessions = SessionLedger(ledger, Budget(10.0, 1e-5), accountant="advanced", prefix="doc000/")
        assert sessions.try_charge("s1", EpsilonDeltaEvent(1.0)) is None
        assert sessions.events("s1") == [(EpsilonDeltaEvent(1.0), durable)]
        assert sessions.sessions() == ["s1"]


def test_document_003_spends_persist_and_refuse_past_the_target(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger(url) as ledger:
        rounds = SessionLedger(ledger, Budget(5.0, 1e-3), accountant="basic")
        for _ in range(5):
            rounds.charge("federation", EpsilonDeltaEvent(1.0, 1e-5))
        assert rounds.spent("federation").epsilon == pytest.approx(5.0)
        assert rounds.try_charge("federation", EpsilonDeltaEvent(0.5, 1e-5)) is None
    with Ledger(url) as ledger:
        assert len(ledger.history("federation")) == 5


def test_adapter_validates_its_arguments() -> None:
    with pytest.raises(TypeError, match="ledger"):
        SessionLedger("memory://", Budget(1.0, 1e-5))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="budget"):
        SessionLedger(Ledger(), (1.0, 1e-5))  # type: ignore[arg-type]


def test_a_budget_refuses_an_approximate_accountant():
    """The CLT 'gdp' accountant can fall below the true epsilon: no budget may be enforced with it."""
    from gaussdp.accounting import PrivacyBudget
    from gaussdp.budget import PrivacyTracker
    from gaussdp.errors import InvalidParameter

    ledger = Ledger("memory://")
    with pytest.raises(InvalidParameter, match="approximation"):
        ledger.open("p", Budget(1.0, 1e-5), accountant="gdp")
    with pytest.raises(InvalidParameter, match="approximation"):
        PrivacyTracker(target_epsilon=1.0, accountant="gdp")
    with pytest.raises(InvalidParameter, match="approximation"):
        PrivacyBudget(1.0, 1e-5, 10, accountant="gdp")
    ledger.open("q", Budget(1.0, 1e-5), accountant="pld")  # an upper-bound accountant is fine
