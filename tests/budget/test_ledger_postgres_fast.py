"""PostgreSQL's one-statement charge (``gdp_charge_next``, called through libpq with a statement
prepared per connection) survives what psycopg does to a connection's prepared statements."""

from __future__ import annotations

import pytest

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Budget, Ledger
from gaussdp.errors import BudgetExhausted

pytestmark = pytest.mark.postgres


def test_fast_charge_prepares_again_after_deallocate_all(fresh_pg_url: str) -> None:
    # one pooled connection: the statement the fast path prepared is the one DEALLOCATE ALL removes
    with Ledger(fresh_pg_url + "&pool_size=1") as ledger:
        ledger.open("p", Budget(epsilon=10.0, delta=1e-5))
        event = GaussianEvent(noise_multiplier=50.0)
        ids = [ledger.charge("p", event).charge_id for _ in range(3)]  # the third takes the fast path
        # what psycopg sends after a rollback, on the connection the fast path prepared its statement on
        with ledger.store._connection() as conn:  # type: ignore[attr-defined]
            conn.execute("DEALLOCATE ALL")
        ids.append(ledger.charge("p", event).charge_id)
        ids.append(ledger.charge("p", event, idempotency_key="k").charge_id)
        replay = ledger.charge("p", event, idempotency_key="k")
        assert replay.replayed and replay.charge_id == ids[-1]
        assert len(ledger.history("p")) == 5 == len(set(ids))


def test_fast_charge_after_a_refused_charge_rolled_back(fresh_pg_url: str) -> None:
    with Ledger(fresh_pg_url + "&pool_size=1") as ledger:
        ledger.open("p", Budget(epsilon=1.0, delta=1e-5))
        small = GaussianEvent(noise_multiplier=200.0)
        for _ in range(3):
            ledger.charge("p", small)
        with pytest.raises(BudgetExhausted):  # the general path: its transaction is rolled back
            ledger.charge("p", GaussianEvent(noise_multiplier=0.5))
        for _ in range(3):
            ledger.charge("p", small)
        assert len(ledger.history("p")) == 6
