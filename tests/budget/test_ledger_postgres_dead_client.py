"""A charge queued on a principal's lock by a process that then dies must not commit (PostgreSQL).

Another connection holds the principal's row lock; a process queues charges behind it and is
SIGKILLed; then the lock is released. Before the fix (``client_connection_check_interval = 0``,
PostgreSQL's default) the one-statement charges of the dead process commit once the lock is free:
budget spent for releases that never happened. With the store's setting (100 ms) the server notices
the dead client and cancels them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import threading
import time

import pytest

pytest.importorskip("psycopg_pool")

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Budget, Ledger

pytestmark = pytest.mark.postgres
EVENT = GaussianEvent(noise_multiplier=20.0)
QUEUED = 8
FORK = mp.get_context("fork")


def _queue_charges(url: str, warmed: object, go: object) -> None:
    with Ledger(url) as ledger:
        ledger.charge("p", EVENT)  # warm: the next charges take the one-statement path
        warmed.set()  # type: ignore[attr-defined]
        go.wait()  # type: ignore[attr-defined]
        threads = [threading.Thread(target=ledger.charge, args=("p", EVENT)) for _ in range(QUEUED)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # blocked on the lock until the process is killed


@pytest.mark.parametrize("check_interval", ["0", "100ms"], ids=["before-fix", "with-fix"])
def test_charges_queued_by_a_dead_process_do_not_commit(
    fresh_pg_url: str, check_interval: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    import gaussdp.budget.postgres as pg

    monkeypatch.setitem(pg._SESSION_SETTINGS, "client_connection_check_interval", check_interval)
    app = f"gdp_dead_{secrets.token_hex(4)}"
    url = f"{fresh_pg_url}&application_name={app}&pool_size={QUEUED + 2}"
    base, schema = fresh_pg_url.split("?schema=")
    with Ledger(url) as ledger:
        ledger.open("p", Budget(1000.0, 1e-5))
    warmed, go = FORK.Event(), FORK.Event()
    proc = FORK.Process(target=_queue_charges, args=(url, warmed, go))
    proc.start()
    try:
        assert warmed.wait(60)
        with psycopg.connect(base) as holder:  # takes the principal's row lock, keeps it
            holder.execute(f"SELECT 1 FROM {schema}.gdp_principals WHERE principal = 'p' FOR UPDATE")
            go.set()
            deadline = time.monotonic() + 30
            with psycopg.connect(base, autocommit=True) as watch:
                while True:
                    waiting = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                        "AND wait_event_type = 'Lock'",
                        (app,),
                    ).fetchone()
                    assert waiting is not None
                    if waiting[0] == QUEUED:
                        break
                    assert time.monotonic() < deadline, f"only {waiting[0]} charges queued"
                    time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)  # the server process dies with its charges queued
            proc.join(10)
            time.sleep(1.0)  # several check intervals
            holder.commit()  # the lock is free: what is still queued runs now
        time.sleep(1.0)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
    with Ledger(fresh_pg_url) as ledger:
        after_death = len(ledger.history("p")) - 1  # the warm-up charge was answered
    print(
        f"\n[dead client] client_connection_check_interval={check_interval}: {QUEUED} charges queued, "
        f"{after_death} committed after their process died"
    )
    if check_interval == "0":
        assert after_death > 0  # the problem is real (and this test would see it come back)
    else:
        assert after_death == 0
