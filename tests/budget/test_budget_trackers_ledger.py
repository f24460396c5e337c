"""Document 000's tracker and document 003's accountant on a durable ledger (issue 4).

Real classes on a real SQLite file; every decision is compared with the in-memory object.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Ledger, PrincipalConflict, PrivacyBudgetTracker, PrivacyTracker
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyError, PrivacyWarning

# Mixed query sizes: after the first refusal, smaller queries may still fit, so the whole
# sequence of decisions (not only the first refusal) must match.
_QUERIES = [0.5, 1.0, 0.25, 2.0, 0.3, 1.5]


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'l.db'}"


def _run(tracker: PrivacyBudgetTracker, n: int, session_id: str) -> list[bool]:
    return [tracker.consume(eps, session_id)[0] for eps in itertools.islice(itertools.cycle(_QUERIES), n)]


@pytest.mark.parametrize(("max_epsilon", "delta"), [(10.0, 1e-5), (3.0, 1e-6)])
def test_tracker_on_a_ledger_refuses_exactly_where_the_in_memory_tracker_does(
    tmp_path: Path, max_epsilon: float, delta: float
) -> None:
    memory = PrivacyBudgetTracker(max_epsilon=max_epsilon, delta=delta)
    durable = PrivacyBudgetTracker(max_epsilon=max_epsilon, delta=delta, ledger=_url(tmp_path))
    try:
        for sid in ("a", "b"):
            expected = _run(memory, 40, sid)
            assert _run(durable, 40, sid) == expected
            assert True in expected and False in expected  # both accepted and refused queries
            m, d = memory.state(sid), durable.state(sid)
            assert d.num_queries == m.num_queries
            assert d.total_epsilon == pytest.approx(m.total_epsilon, rel=1e-12)
            assert d.total_delta == pytest.approx(m.total_delta)
            assert d.total_epsilon <= max_epsilon
            assert sorted(d.epsilons) == sorted(m.epsilons)
        # Equal to document 000's own consume(1.0) loop too.
        one = PrivacyBudgetTracker(max_epsilon=max_epsilon, delta=delta)
        expected_ones = [one.consume(1.0, "ones")[0] for _ in range(15)]
        assert [durable.consume(1.0, "ones")[0] for _ in range(15)] == expected_ones
    finally:
        durable.close()


def test_tracker_spends_persist_across_new_trackers(tmp_path: Path) -> None:
    url = _url(tmp_path)
    first = PrivacyBudgetTracker(max_epsilon=5.0, delta=1e-5, ledger=url)
    while first.consume(1.0, "s1")[0]:
        pass
    assert first.consume(0.5, "s2")[0]
    spent = first.state("s1")
    first.close()

    second = PrivacyBudgetTracker(max_epsilon=5.0, delta=1e-5, ledger=url)
    try:
        assert second.state("s1") == spent and spent.num_queries >= 5
        ok, state = second.consume(1.0, "s1")
        assert not ok and state == spent  # still spent after the restart; nothing charged
        assert second.state("s2").num_queries == 1
        assert second.consume(0.5, "s2")[0] and second.state("s2").num_queries == 2
        assert sorted(second._book.sessions()) == ["s1", "s2"]
    finally:
        second.close()

    # A ledger object (not a URL) works too and stays open; its charges are under the prefix.
    with Ledger(url) as ledger:
        third = PrivacyBudgetTracker(max_epsilon=5.0, delta=1e-5, ledger=ledger)
        assert third.state("s1") == spent
        third.close()
        assert ledger.principals("doc000/") == ["doc000/s1", "doc000/s2"]
        assert len(ledger.history("doc000/s1")) == spent.num_queries
        # The same sessions with another budget are refused, not silently re-budgeted.
        with pytest.raises(PrincipalConflict):
            PrivacyBudgetTracker(max_epsilon=50.0, delta=1e-5, ledger=ledger).consume(1.0, "s1")
        with pytest.raises(InvalidParameter, match="policy"):
            PrivacyBudgetTracker(ledger=ledger, policy="warn")
    with pytest.raises(TypeError, match="ledger"):
        PrivacyBudgetTracker(ledger=42)


def test_tracker_reset_is_refused_on_a_ledger(tmp_path: Path) -> None:
    tracker = PrivacyBudgetTracker(max_epsilon=2.0, ledger=_url(tmp_path))
    try:
        assert tracker.consume(2.0, "s")[0]
        with pytest.raises(PrivacyError, match="never forgets"):
            tracker.reset("s")
        assert tracker.state("s").num_queries == 1
        assert not tracker.consume(0.1, "s")[0]
        assert tracker.consume(0.1, "s-new")[0]  # the way forward: a new session id
    finally:
        tracker.close()
    memory = PrivacyBudgetTracker(max_epsilon=2.0)  # in memory, reset still forgets
    memory.consume(2.0, "s")
    memory.reset("s")
    assert memory.state("s").num_queries == 0


def test_tracker_warn_policy_on_a_ledger_charges_and_warns(tmp_path: Path) -> None:
    with Ledger(_url(tmp_path), policy="warn") as ledger:
        tracker = PrivacyBudgetTracker(max_epsilon=1.0, policy="warn", ledger=ledger)
        assert tracker.consume(1.0)[0]
        with pytest.warns(PrivacyWarning) as caught:  # the ledger's warning and the tracker's
            ok, state = tracker.consume(1.0)
        assert not ok and state.num_queries == 2
        assert any("exceeded" in str(w.message) for w in caught)
        assert [r.within_budget for r in ledger.history("doc000/default")] == [True, False]


def test_accountant_charges_the_ledger_before_recording(tmp_path: Path) -> None:
    url = _url(tmp_path)
    memory = PrivacyTracker(target_epsilon=3.0)
    acc = PrivacyTracker(target_epsilon=3.0, target_delta=1e-3, ledger=url, principal="doc003/fed")
    try:
        for r in (1, 2, 3):
            memory.record_expenditure(1.0, 1e-5, r)
            acc.record_expenditure(1.0, 1e-5, r, description=f"round {r}")
        assert acc.get_total_privacy()[0] == pytest.approx(memory.get_total_privacy()[0]) == 3.0
        # In memory the fourth spend is recorded and only warned about; on the ledger it is refused
        # before anything is recorded.
        memory.record_expenditure(0.5, 1e-5, 4)
        assert not memory.check_budget()
        with pytest.raises(BudgetExhausted):
            acc.record_expenditure(0.5, 1e-5, 4)
        assert len(acc.expenditures) == 3
        assert acc.check_budget() and acc.get_remaining_budget() == pytest.approx(0.0)
        assert acc.get_total_privacy() == pytest.approx((3.0, 1e-3))  # at the budget's delta
        assert acc.ledger.history("doc003/fed")[-1].idempotency_key.startswith("#round=3#")
        report = acc.get_report()
        assert report["num_expenditures"] == 3 and not report["budget_exceeded"]
        assert report["expenditures_by_round"]["round_2"][0]["epsilon"] == 1.0
    finally:
        acc.close()

    # A fresh accountant on the same file reads the totals and the report back, and keeps refusing.
    again = PrivacyTracker(ledger=url, principal="doc003/fed")
    try:
        assert (again.target_epsilon, again.target_delta) == (3.0, 1e-3)
        assert again.expenditures == []
        assert again.get_total_privacy() == pytest.approx((3.0, 1e-3))
        fresh = again.get_report()
        assert {k: v for k, v in fresh.items() if k != "ledger"} == {
            k: v for k, v in report.items() if k != "ledger"
        }
        assert sorted(fresh["expenditures_by_round"]) == ["round_1", "round_2", "round_3"]
        with pytest.raises(BudgetExhausted):
            again.record_expenditure(1.0, 1e-5, 5, event=GaussianEvent(5.0))
        assert again.expenditures == []
    finally:
        again.close()


def test_accountant_ledger_arguments(tmp_path: Path) -> None:
    url = _url(tmp_path)
    with pytest.raises(InvalidParameter, match="target_delta"):
        PrivacyTracker(target_epsilon=1.0, ledger=url, principal="p")
    acc = PrivacyTracker(target_epsilon=1.0, target_delta=1e-5, ledger=url, principal="p")
    assert acc.get_total_privacy() == (0.0, 0.0) and acc.get_report()["num_expenditures"] == 0
    acc.close()
    with pytest.raises(PrincipalConflict):
        PrivacyTracker(target_epsilon=2.0, ledger=url, principal="p")
    with pytest.raises(PrincipalConflict):
        PrivacyTracker(ledger=url, principal="p", accountant="pld")
