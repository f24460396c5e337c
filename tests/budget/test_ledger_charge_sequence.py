"""The one-statement charge (migration 0005, SQLite and PostgreSQL): a charge numbered ``seq`` is
written only when the principal has exactly ``seq - 1`` charges, so a process deciding on a stale
cached history falls back to the general path under the lock instead of spending on it."""

from __future__ import annotations

import sqlite3

import pytest

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Budget, Ledger
from gaussdp.budget._compose import event_key
from gaussdp.errors import BudgetExhausted

pytest.importorskip("alembic")

EVENT = GaussianEvent(noise_multiplier=8.0)
BUDGET = Budget(epsilon=2.0, delta=1e-5)


@pytest.fixture
def url(durable_url: str) -> str:
    return durable_url


def test_a_stale_cached_history_cannot_spend_past_the_budget(url: str) -> None:
    with Ledger(url) as a, Ledger(url) as b:
        a.open("p", BUDGET)
        n = a.allowance("p", EVENT)
        assert 3 <= n <= 100
        for _ in range(2):
            a.charge("p", EVENT)  # a now holds a history and a box that covers up to n charges
        while True:  # b spends the rest, behind a's back
            try:
                b.charge("p", EVENT)
            except BudgetExhausted:
                break
        assert b.history("p")[-1].charge_id > 2
        with pytest.raises(BudgetExhausted):  # a's cache says 2 charges: the database says n
            a.charge("p", EVENT)
        assert len(a.history("p")) == n
        assert a.store.groups("p") == {event_key(EVENT): n}
        assert _seqs(a, url) == list(range(1, n + 1))  # numbered densely, by both paths


def _seqs(ledger: Ledger, url: str) -> list[int]:
    sql = "SELECT seq FROM {p}gdp_charges WHERE principal = 'p' ORDER BY id"
    if url.startswith("sqlite"):
        with sqlite3.connect(url[len("sqlite:///") :]) as conn:
            return [r[0] for r in conn.execute(sql.format(p=""))]
    store = ledger.store
    with store._connection() as conn:  # type: ignore[attr-defined]
        return [r[0] for r in conn.execute(sql.format(p=store.schema + "."))]  # type: ignore[attr-defined]


def test_alternating_ledgers_keep_counts_and_receipts_exact(url: str) -> None:
    events = [GaussianEvent(noise_multiplier=m) for m in (50.0, 60.0, 70.0)]
    with Ledger(url) as a, Ledger(url) as b:
        a.open("p", Budget(epsilon=10.0, delta=1e-5))
        counts: dict[str, int] = {}
        for i in range(60):
            ledger, e = (a, b, b, a, a)[i % 5], events[i % 3]
            receipt = ledger.charge("p", e)
            counts[event_key(e)] = counts.get(event_key(e), 0) + 1
            assert receipt.composed == tuple(sorted(counts.items()))
        assert sorted(a.store.groups("p").items()) == sorted(counts.items())


def test_charge_next_writes_nothing_unless_the_total_matches(url: str) -> None:
    with Ledger(url) as ledger:
        ledger.open("p", BUDGET)
        key = event_key(EVENT)
        store = ledger.store
        next_charge = store.charge_next  # type: ignore[attr-defined]
        assert next_charge("p", key, None, 2) is None  # no charge yet: the next is number 1
        assert next_charge("q", key, None, 1) is None  # unknown principal
        first = next_charge("p", key, "k", 1)
        assert first is not None
        assert next_charge("p", key, "k", 2) is None  # the idempotency key was used
        assert next_charge("p", key, None, 1) is None  # number 1 is taken: a stale history
        assert store.groups("p") == {key: 1}
        assert [c.charge_id for c in store.history("p")] == [first.charge_id]
        assert ledger.charge("p", EVENT, "k").replayed  # the general path answers the replay


def test_event_keys_are_remembered_only_for_events_that_cannot_change() -> None:
    from dataclasses import dataclass
    from typing import Any

    e = GaussianEvent(noise_multiplier=2.0)
    assert event_key(e) == event_key(e) == event_key(GaussianEvent(noise_multiplier=2.0))

    @dataclass  # not frozen: its key follows its fields
    class Mutable:
        scale: float

        def to_dict(self) -> dict[str, Any]:
            return {"type": "custom", "scale": self.scale}

    m = Mutable(1.0)
    first = event_key(m)
    m.scale = 2.0
    assert event_key(m) != first and '"scale":2.0' in event_key(m)

    @dataclass(frozen=True)  # frozen, but holding a mutable list
    class Holder:
        values: list[float]

        def to_dict(self) -> dict[str, Any]:
            return {"type": "custom", "values": list(self.values)}

    h = Holder([1.0])
    first = event_key(h)
    h.values.append(2.0)
    assert event_key(h) != first
