"""SQLite ledger store (``sqlite:///path.db``): the embedded default.

WAL journal (readers never block the writer), one ``BEGIN IMMEDIATE`` transaction per charge (the
write lock is taken *before* the history is read, so two processes can never both see the same
history and both spend the last of a budget), ``busy_timeout`` so that contending writers queue
instead of failing, and ``synchronous=FULL`` by default so that a committed charge survives a power
cut, not only a process crash.

The common charge is one statement: where the ledger already knows the principal's history (it
charged it last) and its certified box covers the charge, :meth:`SQLiteStore.charge_next` inserts
the charge numbered one past that history's total, and the triggers of migration 0005 check the
number against the grouped counts under the write lock and add the charge to them, in the same
implicit transaction. A number that does not match (another process charged meanwhile) writes
nothing and the charge takes the general transaction above.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gaussdp.budget._db import (
    SQLITE,
    SharedQueries,
    SQLiteURL,
    check_sqlite_ledger,
    connect_sqlite,
    parse_url,
    principal_row,
)
from gaussdp.budget.schema import upgrade_sqlite
from gaussdp.budget.store import (
    Decide,
    PrincipalRow,
    StoredCharge,
    StoreUnavailable,
    TenantLimitExceeded,
    UnknownPrincipal,
    cap_message,
    replayed_charge,
)
from gaussdp.errors import InvalidParameter

__all__ = ["SQLiteStore"]


# A charge row with its number within its principal; the triggers of migration 0005 check the number
# and add the charge to gdp_spent in the same statement.
_INSERT_CHARGE = (
    "INSERT INTO gdp_charges (principal, event_key, idempotency_key, created_at, within_budget, key_id, seq)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class SQLiteStore(SharedQueries):
    """One database file shared by any number of threads and processes on one machine."""

    dialect = SQLITE

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "full",
        busy_timeout_ms: int = 60_000,
        read_only: bool = False,
    ) -> None:
        if synchronous.lower() not in ("full", "normal", "extra"):
            raise InvalidParameter(
                f"synchronous must be full, normal or extra, got synchronous={synchronous!r}"
            )
        self.path = str(path)
        if self.path in ("", ":memory:") or self.path.startswith("file::memory:"):
            raise InvalidParameter("an in-memory SQLite database cannot be shared; use url='memory://'")
        self._synchronous = synchronous.upper()
        self._busy_timeout_ms = int(busy_timeout_ms)
        # read_only: for commands that only look (``gaussdp ledger show``). The file is opened through a
        # ``mode=ro`` URI, so a mistyped path is an error instead of a new, empty ledger.
        self.read_only = bool(read_only)
        self._pool: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._all: list[sqlite3.Connection] = []
        # Writers of this process queue on a lock (FIFO-ish, no sleeping) instead of in SQLite's busy
        # handler, whose back-off sleeps of up to 100 ms dominate tail latency under contention.
        # Other processes still meet each other in the busy handler: correctness never depends on it.
        self._write_lock = threading.Lock()
        if self.read_only:
            check_sqlite_ledger(self.path)
            return
        with self._conn() as conn:  # the tables: budget/migrations (one query when up to date)
            upgrade_sqlite(self.path, conn)

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False) -> SQLiteStore:
        parsed = parse_url(url)
        if not isinstance(parsed, SQLiteURL):
            raise InvalidParameter(f"a SQLite url looks like sqlite:///ledger.db, got url={url!r}")
        return cls(
            parsed.path,
            synchronous=parsed.synchronous,
            busy_timeout_ms=parsed.busy_timeout_ms,
            read_only=read_only,
        )

    def _connect(self) -> sqlite3.Connection:
        conn = connect_sqlite(
            self.path,
            busy_timeout_ms=self._busy_timeout_ms,
            synchronous=self._synchronous,
            read_only=self.read_only,
        )
        self._all.append(conn)
        return conn

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            conn = self._pool.get_nowait()
        except queue.Empty:
            conn = self._connect()
        try:
            yield conn
        finally:
            if conn.in_transaction:  # never hand a connection back holding the write lock
                conn.execute("ROLLBACK")
            self._pool.put(conn)

    def _run(self, sql: str, args: Sequence[Any], fetch: str, *, retry: bool = True) -> Any:
        with self._conn() as conn:
            cur = conn.execute(SQLITE.sql(sql), tuple(args))
            return (
                cur.rowcount if fetch == "rowcount" else cur.fetchone() if fetch == "one" else cur.fetchall()
            )

    def open_principal(self, principal: str, epsilon: float, delta: float, accountant: str) -> PrincipalRow:
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO gdp_principals (principal, epsilon, delta, accountant, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (principal) DO NOTHING",
                (principal, epsilon, delta, accountant, time.time()),
            )
            row = self._principal(conn, principal)
            if row is None:  # a database fault
                raise RuntimeError(f"ledger principal {principal!r} missing right after it was opened")
            return row

    @staticmethod
    def _principal(conn: sqlite3.Connection, principal: str) -> PrincipalRow | None:
        r = conn.execute(
            "SELECT principal, epsilon, delta, accountant, created_at FROM gdp_principals "
            "WHERE principal = ?",
            (principal,),
        ).fetchone()
        return None if r is None else principal_row(r[0], r[1:])

    def groups(self, principal: str) -> dict[str, int]:
        with self._conn() as conn:
            conn.execute("BEGIN")  # one consistent snapshot of both tables
            try:
                if self._principal(conn, principal) is None:
                    raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
                rows = conn.execute(
                    "SELECT event_key, count FROM gdp_spent WHERE principal = ?", (principal,)
                ).fetchall()
            finally:
                conn.execute("COMMIT")
        return dict(rows)

    def charge(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        decide: Decide,
        key_id: str | None = None,
    ) -> StoredCharge:
        with self._write_lock, self._conn() as conn:
            # The write lock is taken first: the history read below cannot go stale before our commit.
            conn.execute("BEGIN IMMEDIATE")
            try:
                # the principal's row and its grouped history in one statement (less time in the lock)
                rows = conn.execute(
                    "SELECT p.epsilon, p.delta, p.accountant, p.created_at, s.event_key, s.count "
                    "FROM gdp_principals p LEFT JOIN gdp_spent s ON s.principal = p.principal "
                    "WHERE p.principal = ?",
                    (principal,),
                ).fetchall()
                if not rows:
                    raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
                r0 = rows[0]
                row = PrincipalRow(principal, r0[0], r0[1], r0[2], r0[3])
                if idempotency_key is not None:
                    r = conn.execute(
                        "SELECT id, event_key, created_at, within_budget, key_id FROM gdp_charges "
                        "WHERE principal = ? AND idempotency_key = ?",
                        (principal, idempotency_key),
                    ).fetchone()
                    if r is not None:
                        conn.execute("COMMIT")
                        earlier = StoredCharge(
                            r[0], principal, r[1], idempotency_key, r[2], bool(r[3]), key_id=r[4]
                        )
                        return replayed_charge(earlier, event_key)
                groups = {r[4]: r[5] for r in rows if r[4] is not None}
                within = decide(row, groups)  # may raise: the ROLLBACK below records nothing
                now = time.time()
                # the charge's number and, by the triggers of migration 0005, its grouped count
                seq = sum(groups.values()) + 1
                cur = conn.execute(
                    _INSERT_CHARGE, (principal, event_key, idempotency_key, now, int(within), key_id, seq)
                )
                charge_id = cur.lastrowid
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if charge_id is None:  # a database fault
            raise RuntimeError(f"the charge of {principal!r} was committed without a charge id")
        return StoredCharge(charge_id, principal, event_key, idempotency_key, now, within, key_id=key_id)

    def charge_next(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        seq: int,
        key_id: str | None = None,
    ) -> StoredCharge | None:
        """Charge if the principal has exactly ``seq - 1`` charges (the history the caller decided on).

        One ``INSERT`` in its own transaction: the triggers of migration 0005 check ``seq`` against
        the grouped counts under the write lock and add the charge to them. Returns None, having
        written nothing, where the general :meth:`charge` must decide: the history moved, the
        idempotency key was used before, or the principal is unknown.
        """
        now = time.time()
        with self._write_lock, self._conn() as conn:
            try:
                cur = conn.execute(
                    _INSERT_CHARGE, (principal, event_key, idempotency_key, now, 1, key_id, int(seq))
                )
            except sqlite3.IntegrityError:
                return None
        charge_id = cur.lastrowid
        if charge_id is None:  # a database fault
            raise RuntimeError(f"the charge of {principal!r} was committed without a charge id")
        return StoredCharge(charge_id, principal, event_key, idempotency_key, now, True, key_id=key_id)

    def open_principal_within(
        self, principal: str, epsilon: float, delta: float, accountant: str, tenant: str
    ) -> PrincipalRow:
        with self._write_lock, self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._principal(conn, principal)
                if row is None:
                    has_caps = conn.execute(
                        "SELECT 1 FROM gdp_tenants WHERE tenant = ?", (tenant,)
                    ).fetchone()
                    if has_caps is not None:
                        cur = conn.execute(
                            "UPDATE gdp_tenants SET sessions = sessions + 1, "
                            "epsilon_granted = epsilon_granted + ? "
                            "WHERE tenant = ? AND (max_sessions IS NULL OR sessions + 1 <= max_sessions) "
                            "AND (max_epsilon IS NULL OR epsilon_granted + ? <= max_epsilon)",
                            (epsilon, tenant, epsilon),
                        )
                        if cur.rowcount == 0:
                            raise TenantLimitExceeded(cap_message(tenant, epsilon))
                    conn.execute(
                        "INSERT INTO gdp_principals (principal, epsilon, delta, accountant, created_at) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (principal, epsilon, delta, accountant, time.time()),
                    )
                    row = self._principal(conn, principal)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        if row is None:  # a database fault
            raise RuntimeError(f"ledger principal {principal!r} missing right after it was opened")
        return row

    def set_tenant_limits(self, tenant: str, max_sessions: int | None, max_epsilon: float | None) -> None:
        prefix = tenant + "/"
        with self._write_lock, self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")  # no session of the tenant opens while it is counted
            try:
                conn.execute(
                    "INSERT INTO gdp_tenants (tenant, max_sessions, max_epsilon, sessions, epsilon_granted) "
                    "SELECT ?, ?, ?, count(*), coalesce(sum(epsilon), 0) FROM gdp_principals "
                    "WHERE substr(principal, 1, ?) = ? "
                    "ON CONFLICT (tenant) DO UPDATE SET max_sessions = excluded.max_sessions, "
                    "max_epsilon = excluded.max_epsilon, sessions = excluded.sessions, "
                    "epsilon_granted = excluded.epsilon_granted",
                    (tenant, max_sessions, max_epsilon, len(prefix), prefix),
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def ping(self) -> None:
        """Read the database file (a trivial query on a pooled connection)."""
        try:
            with self._conn() as conn:
                conn.execute("SELECT count(*) FROM gdp_principals WHERE 0").fetchone()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the SQLite ledger {self.path!r} cannot be read: {exc}") from exc

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        for conn in self._all:
            conn.close()
        self._all.clear()
