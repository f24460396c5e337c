"""One contract suite for every ledger store: memory://, sqlite:///, postgresql:// (marked postgres)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from gaussdp.accounting import GaussianEvent, accountant
from gaussdp.budget import Budget, BudgetExhausted, IdempotencyKeyUsed, Ledger, Spent, UnknownPrincipal
from gaussdp.errors import InvalidParameter, PrivacyError, PrivacyWarning, UnsafeInput

BUDGET = Budget(epsilon=2.0, delta=1e-5)
EVENT = GaussianEvent(noise_multiplier=4.0)


def expected_allowance(event, budget: Budget, name: str = "pld", others=()) -> int:  # type: ignore[no-untyped-def]
    """Largest n with epsilon(others + n x event) <= budget, by linear scan with the accountant itself."""
    n = 0
    while True:
        acc = accountant(name)
        for e, c in others:
            acc.compose(e, c)
        if acc.compose(event, n + 1).epsilon(budget.delta) > budget.epsilon:
            return n
        n += 1


@pytest.fixture
def ledger(ledger_url: str):  # type: ignore[no-untyped-def]
    with Ledger(ledger_url) as led:
        yield led


def test_open_is_idempotent_and_budgets_never_change(ledger: Ledger) -> None:
    assert ledger.open("alice", BUDGET) == BUDGET
    assert ledger.open("alice", Budget(2.0, 1e-5)) == BUDGET
    with pytest.raises(InvalidParameter, match="already open with budget"):
        ledger.open("alice", Budget(3.0, 1e-5))
    with pytest.raises(InvalidParameter, match="already open"):
        ledger.open("alice", BUDGET, accountant="rdp")
    assert ledger.budget("alice") == BUDGET
    assert ledger.accountant("alice") == "pld"
    assert ledger.spent("alice").epsilon == 0.0
    assert ledger.remaining("alice").epsilon == BUDGET.epsilon


def test_charges_exactly_what_the_budget_allows_and_refusals_record_nothing(ledger: Ledger) -> None:
    n = expected_allowance(EVENT, BUDGET)
    assert 3 <= n <= 100  # the test is about the ledger, not a degenerate budget
    ledger.open("p", BUDGET)
    assert ledger.allowance("p", EVENT) == n
    receipts = [ledger.charge("p", EVENT) for _ in range(n)]
    assert all(r.within_budget and not r.replayed for r in receipts)
    assert len({r.charge_id for r in receipts}) == n
    spent = ledger.spent("p")
    assert spent.epsilon == pytest.approx(accountant("pld").compose(EVENT, n).epsilon(BUDGET.delta))
    assert spent.epsilon <= BUDGET.epsilon
    with pytest.raises(BudgetExhausted, match="nothing was charged"):
        ledger.charge("p", EVENT)
    assert len(ledger.history("p")) == n
    assert ledger.spent("p") == spent
    assert ledger.allowance("p", EVENT) == 0
    # A bigger-noise event may still fit where the refused one did not.
    quiet = GaussianEvent(noise_multiplier=400.0)
    assert ledger.allowance("p", quiet) == expected_allowance(quiet, BUDGET, others=[(EVENT, n)])
    ledger.charge("p", quiet)
    assert [c for _, c in sorted(ledger.events("p"), key=lambda ec: ec[1])] == [1, n]


def test_principals_are_independent(ledger: Ledger) -> None:
    n = expected_allowance(EVENT, BUDGET)
    ledger.open("a", BUDGET)
    ledger.open("b", BUDGET)
    for _ in range(n):
        ledger.charge("a", EVENT)
    with pytest.raises(BudgetExhausted):
        ledger.charge("a", EVENT)
    ledger.charge("b", EVENT)
    assert ledger.spent("b").epsilon < ledger.spent("a").epsilon
    assert ledger.principals() == ["a", "b"]
    assert ledger.principals("b") == ["b"]


def test_idempotency_key_is_charged_once(ledger: Ledger) -> None:
    ledger.open("p", BUDGET)
    first = ledger.charge("p", EVENT, idempotency_key="req-1")
    again = ledger.charge("p", EVENT, idempotency_key="req-1")
    assert again.replayed and not first.replayed
    assert again.charge_id == first.charge_id
    assert len(ledger.history("p")) == 1
    with pytest.raises(InvalidParameter, match="different event"):
        ledger.charge("p", GaussianEvent(noise_multiplier=9.0), idempotency_key="req-1")
    ledger.charge("p", EVENT, idempotency_key="req-2")
    assert [h.idempotency_key for h in ledger.history("p")] == ["req-1", "req-2"]
    assert [h.idempotency_key for h in ledger.history("p", limit=1)] == ["req-2"]
    # The same key under another principal is another charge.
    ledger.open("q", BUDGET)
    assert not ledger.charge("q", EVENT, idempotency_key="req-1").replayed


def test_history_records_events_that_round_trip(ledger: Ledger) -> None:
    from gaussdp.accounting import event_from_dict

    ledger.open("p", BUDGET)
    ledger.charge("p", EVENT)
    ledger.charge("p", GaussianEvent(noise_multiplier=50.0))
    hist = ledger.history("p")
    assert [event_from_dict(h.event) for h in hist] == [EVENT, GaussianEvent(noise_multiplier=50.0)]
    assert hist[0].charge_id < hist[1].charge_id
    assert hist[0].created_at <= hist[1].created_at
    assert all(h.within_budget for h in hist)


def test_unknown_principal_and_bad_arguments(ledger: Ledger) -> None:
    with pytest.raises(UnknownPrincipal):
        ledger.charge("nobody", EVENT)
    with pytest.raises(UnknownPrincipal):
        ledger.spent("nobody")
    with pytest.raises(TypeError, match="budget"):
        ledger.open("p", (1.0, 1e-5))  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="accountant"):
        ledger.open("p", BUDGET, accountant="no-such-accountant")
    with pytest.raises(InvalidParameter, match="principal"):
        ledger.open("", BUDGET)
    with pytest.raises(TypeError, match="principal"):
        ledger.open(7, BUDGET)  # type: ignore[arg-type]
    ledger.open("p", BUDGET)
    with pytest.raises(TypeError, match="event"):
        ledger.charge("p", {"epsilon": 1.0})
    with pytest.raises(InvalidParameter, match="idempotency_key"):
        ledger.charge("p", EVENT, idempotency_key="")
    assert ledger.history("p") == []


def test_warn_policy_records_past_the_budget_and_says_so(ledger_url: str, caplog) -> None:  # type: ignore[no-untyped-def]
    n = expected_allowance(EVENT, BUDGET)
    with caplog.at_level(logging.WARNING, logger="gaussdp.budget"), Ledger(ledger_url, policy="warn") as led:
        led.open("p", BUDGET)
        for _ in range(n):
            assert led.charge("p", EVENT).within_budget
        with pytest.warns(PrivacyWarning, match="exhausted"):
            late = led.charge("p", EVENT)
        assert not late.within_budget
        assert len(led.history("p")) == n + 1
        assert led.spent("p").epsilon > BUDGET.epsilon
        assert led.remaining("p").epsilon == 0.0
    assert any("exhausted" in r.getMessage() for r in caplog.records)


def test_release_charges_first_and_refuses_without_releasing(ledger: Ledger) -> None:
    calls: list[np.ndarray] = []

    class Mechanism:  # what the ledger needs of a mechanism: .event and .release(x)
        event = EVENT

        def release(self, x: np.ndarray) -> np.ndarray:
            assert len(ledger.history("p")) == len(calls) + 1, "released before the charge was on record"
            calls.append(x)
            return x + 1.0

    n = expected_allowance(EVENT, BUDGET)
    ledger.open("p", BUDGET)
    for _ in range(n):
        ledger.release("p", Mechanism(), np.zeros(3))
    with pytest.raises(BudgetExhausted):
        ledger.release("p", Mechanism(), np.zeros(3))
    assert len(calls) == n
    with pytest.raises(UnsafeInput):
        ledger.release("p", Mechanism(), np.array([np.nan]))
    assert len(ledger.history("p")) == n


def test_release_under_a_replayed_key_refuses(ledger: Ledger) -> None:
    class Mechanism:
        event = EVENT

        def release(self, x: np.ndarray) -> np.ndarray:
            return x

    ledger.open("p", BUDGET)
    ledger.release("p", Mechanism(), np.zeros(2), idempotency_key="k")
    with pytest.raises(PrivacyError, match="already charged and released"):
        ledger.release("p", Mechanism(), np.zeros(2), idempotency_key="k")
    assert len(ledger.history("p")) == 1


def test_release_with_the_core_mechanism(ledger: Ledger) -> None:
    from gaussdp.mechanism import GaussianMechanism

    mech = GaussianMechanism(epsilon=1.0, delta=1e-6, sensitivity=1.0)
    ledger.open("p", Budget(epsilon=3.0, delta=1e-5))
    out = ledger.release("p", mech, np.ones(8))
    assert out.value.shape == (8,)
    assert ledger.history("p")[0].event == mech.event.to_dict()


def test_release_answers_its_receipt_spent_and_remaining(ledger: Ledger) -> None:
    from gaussdp.mechanism import GaussianMechanism

    mech = GaussianMechanism(epsilon=1.0, delta=1e-6, sensitivity=1.0)
    ledger.open("p", Budget(epsilon=3.0, delta=1e-5))
    first = ledger.release("p", mech, np.ones(4), idempotency_key="k1", key_id="key-1")
    (record,) = ledger.history("p")
    assert first.charge_id == first.receipt.charge_id == record.charge_id and record.key_id == "key-1"
    assert not first.receipt.replayed and first.receipt.idempotency_key == "k1"
    second = ledger.release("p", mech, np.ones(4))
    # each release's spend is the one right after its own charge, even when read later
    assert 0 < first.spent.epsilon < second.spent.epsilon == ledger.spent("p").epsilon
    assert first.spent.delta == second.spent.delta == 1e-5
    assert second.remaining == ledger.remaining("p") == Spent(3.0 - second.spent.epsilon, 1e-5)
    assert first.remaining.epsilon == pytest.approx(3.0 - first.spent.epsilon)


def test_a_fresh_charge_under_a_replayed_key_raises(ledger: Ledger) -> None:
    ledger.open("p", BUDGET)
    first = ledger.charge("p", EVENT, "k")
    assert ledger.charge("p", EVENT, "k").replayed  # a plain retry returns the earlier receipt
    with pytest.raises(IdempotencyKeyUsed, match="already charged") as used:
        ledger.charge("p", EVENT, "k", fresh=True)
    assert isinstance(used.value, PrivacyError) and used.value.receipt.charge_id == first.charge_id
    assert len(ledger.history("p")) == 1
    assert not ledger.charge("p", EVENT, "k2", fresh=True).replayed  # a new key is charged
    assert len(ledger.history("p")) == 2


def test_budget_remaining_is_floored_at_zero() -> None:
    assert BUDGET.remaining(Spent(0.5, 1e-5)) == Spent(1.5, 1e-5)
    assert BUDGET.remaining(Spent(2.5, 1e-5)) == Spent(0.0, 1e-5)  # policy="warn" may overspend


def test_threads_never_spend_past_the_budget(ledger: Ledger) -> None:
    n = expected_allowance(EVENT, BUDGET)
    ledger.open("p", BUDGET)
    ok: list[int] = []
    refused: list[int] = []

    def client() -> None:
        for _ in range(4):
            try:
                ledger.charge("p", EVENT)
                ok.append(1)
            except BudgetExhausted:
                refused.append(1)

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == n
    assert len(refused) == 16 * 4 - n
    assert len(ledger.history("p")) == n


def test_durable_stores_survive_reopening(ledger_url: str) -> None:
    if ledger_url.startswith("memory://"):
        pytest.skip("memory:// is not durable by design")
    with Ledger(ledger_url) as led:
        led.open("p", BUDGET)
        led.charge("p", EVENT, idempotency_key="a")
        spent = led.spent("p")
    with Ledger(ledger_url) as led:
        assert led.spent("p") == spent
        assert led.charge("p", EVENT, idempotency_key="a").replayed
        assert led.budget("p") == BUDGET


def test_bad_policy_and_url() -> None:
    with pytest.raises(InvalidParameter, match="policy"):
        Ledger("memory://", policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="url"):
        Ledger("redis://localhost")
    with pytest.raises(InvalidParameter, match="memory"):
        Ledger("sqlite:///:memory:")


def test_spent_as_of_a_receipt_needs_no_store_read(ledger: Ledger) -> None:
    ledger.open("p", BUDGET)
    first = ledger.charge("p", EVENT)
    second = ledger.charge("p", EVENT)
    assert ledger.spent("p", as_of=first).epsilon < ledger.spent("p", as_of=second).epsilon
    assert ledger.spent("p", as_of=second) == ledger.spent("p")
    ledger.open("q", BUDGET)
    with pytest.raises(InvalidParameter, match="as_of"):
        ledger.spent("q", as_of=first)


def test_concurrent_retries_of_one_key_charge_once(ledger: Ledger) -> None:
    ledger.open("p", BUDGET)
    receipts = []

    def retry() -> None:
        receipts.append(ledger.charge("p", EVENT, idempotency_key="same"))

    threads = [threading.Thread(target=retry) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(not r.replayed for r in receipts) == 1
    assert len({r.charge_id for r in receipts}) == 1
    assert len(ledger.history("p")) == 1


def test_a_stale_view_of_the_history_never_overspends(ledger_url: str) -> None:
    """Two ledgers (two processes) on one store: what one remembers must never decide for the other."""
    with Ledger(ledger_url) as a:
        b = Ledger(store=a.store) if ledger_url.startswith("memory") else Ledger(ledger_url)
        a.open("p", BUDGET)
        a.charge("p", EVENT)  # a now remembers the history {EVENT: 1}
        big = GaussianEvent(noise_multiplier=2.5)
        n_big = expected_allowance(big, BUDGET, others=[(EVENT, 1)])
        assert n_big >= 1
        for _ in range(n_big):
            b.charge("p", big)  # behind a's back
        total = expected_allowance(EVENT, BUDGET, others=[(big, n_big)])
        ok = 0
        while True:
            try:
                a.charge("p", EVENT)
            except BudgetExhausted:
                break
            ok += 1
        assert ok == total - 1
        assert a.spent("p").epsilon <= BUDGET.epsilon
        assert len(a.history("p")) == 1 + n_big + ok
        if b.store is not a.store:
            b.close()
