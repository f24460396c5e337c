"""PostgreSQL ledger store (``postgresql://...``): for services with several processes or machines.

One transaction per charge: ``SELECT ... FOR UPDATE`` on the principal's row serialises charges of
that principal (and only that principal) across every connection, the history is read under that
lock, and the new charge is written with one statement before ``COMMIT``. The common charge (the
process already knows the principal's history and its certified box covers the charge) is one
statement instead: the server-side function ``gdp_charge_next`` (migration 0005) writes the charge
numbered one past that history's total only if the total is still that, and writes nothing
otherwise (the general transaction then decides). Both take the principal's advisory lock first.
``psycopg`` (3) and ``psycopg_pool`` are imported only when a PostgreSQL ledger is opened
(``service`` extra).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from gaussdp.budget._db import (
    PostgresURL,
    SharedQueries,
    parse_url,
    postgres_dialect,
    postgres_pool,
    principal_row,
)
from gaussdp.budget.schema import upgrade_postgres
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

__all__ = ["PostgresStore"]

logger = logging.getLogger("gaussdp.budget")

T = TypeVar("T")

# A broken connection (server restarted, backend terminated, network cut) is retried this many times
# in all, with exponential back-off from _BACKOFF_S, for work that is safe to repeat: reads, and
# charges whose write had not been sent yet. A charge whose write may have reached the server is
# never retried (it could be charged twice): it fails with StoreUnavailable (503).
_ATTEMPTS = 3
_BACKOFF_S = 0.05

# Session settings of every pooled connection (set once, when the pool opens it):
# - client_connection_check_interval: while a statement runs (e.g. a charge queued on a principal's
#   row lock), the server checks this often that the client is still connected and cancels the
#   statement if not, so that a charge queued by a process that has since died does not commit
#   (budget spent for nothing). PostgreSQL >= 14; older servers ignore it (see _configure).
# - idle_in_transaction_session_timeout: a client that stops mid-transaction (a hung process holding
#   a principal's lock) is disconnected and its transaction rolled back.
# - lock_timeout: a charge waits at most this long for a principal's lock, then fails (503) instead
#   of holding a request and a connection forever.
_SESSION_SETTINGS = {
    "client_connection_check_interval": "100ms",
    "idle_in_transaction_session_timeout": "10s",
    "lock_timeout": "30s",
}

# A pooled connection idle for longer than this is checked with a round trip before use (see _check).
_IDLE_CHECK_S = 5.0

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _broken_connection(exc: BaseException | None, pool_timeout: type[Exception]) -> bool:
    """A connection the server closed or lost (retry on a new one); not a timeout or a lock wait."""
    if exc is None or isinstance(exc, pool_timeout):
        return False  # the pool already waited its timeout for a connection: do not wait again
    sqlstate = getattr(exc, "sqlstate", None)
    # no SQLSTATE: the connection itself failed; 08: connection exception; 57P01-3: server shutdown
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in ("57P01", "57P02", "57P03")


class _Reopened(Exception):
    """The principal was opened by another connection between the read and the insert."""


# The name under which each connection prepares the call of gdp_charge_next (per session).
_NEXT_NAME = b"gdp_charge_next"
_TUPLES_OK = 2  # libpq's PGRES_TUPLES_OK
_COMMAND_OK = 1  # libpq's PGRES_COMMAND_OK
_CONNECTION_BAD = 1  # libpq's CONNECTION_BAD
_SQLSTATE = 67  # libpq's PG_DIAG_SQLSTATE ('C'): undefined prepared statement is 26000
_TRANS_IDLE = 0  # libpq's PQTRANS_IDLE


class PostgresStore(SharedQueries):
    """A connection pool to one PostgreSQL database; the tables live in ``schema`` (default public)."""

    def __init__(
        self, conninfo: str, *, schema: str = "public", pool_size: int = 16, pool_timeout_s: float = 10.0
    ) -> None:
        try:
            import psycopg
            from psycopg_pool import PoolTimeout
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "a PostgreSQL ledger needs psycopg 3 and psycopg_pool: pip install 'gaussdp[service]'"
            ) from None
        if not _IDENT.match(schema):
            raise InvalidParameter(f"schema must be a lower-case SQL identifier, got schema={schema!r}")
        if not pool_timeout_s > 0:
            raise InvalidParameter(f"pool_timeout_s must be > 0, got pool_timeout_s={pool_timeout_s!r}")
        self.schema = schema
        self.dialect = postgres_dialect(schema)
        self._operational_error: type[Exception] = psycopg.OperationalError
        self._pool_timeout: type[Exception] = PoolTimeout
        self._error_from_result = psycopg.errors.error_from_result
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()  # see _get; None wakes a waiter
        self._lock = threading.Lock()
        self._taken = 0  # connections taken from the pool and not given back
        self._pool_timeout_s = float(pool_timeout_s)
        self._closed = False
        # connections on which the one-statement charge is prepared (a new connection prepares it)
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self._next_sql = f"SELECT {schema}.gdp_charge_next($1, $2, $3, $4::bigint, $5::float8, $6)".encode()
        self._last_checked: dict[int, float] = {}  # id(connection) -> monotonic time of its last check
        self._max_size = max(1, int(pool_size))
        self._pool = postgres_pool(
            conninfo,
            max_size=pool_size,
            name="gaussdp-ledger",
            # Every connection is checked before it is handed out, so that connections the server
            # closed (restart, pg_terminate_backend) are replaced instead of failing requests; the
            # check costs a round trip only where it can find something (see _check).
            check=self._check,
            configure=self._configure,
            timeout=float(pool_timeout_s),  # a request waits at most this long for a connection
        )
        s = schema
        self._sql = {
            "queue": "SELECT pg_advisory_xact_lock(1868720741, hashtext(%s))",
            "lock": f"SELECT epsilon, delta, accountant, created_at FROM {s}.gdp_principals "
            "WHERE principal = %s FOR UPDATE",
            "groups": f"SELECT event_key, count FROM {s}.gdp_spent WHERE principal = %s",
            "by_key": f"SELECT id, event_key, created_at, within_budget, key_id FROM {s}.gdp_charges "
            "WHERE principal = %s AND idempotency_key = %s",
            # One statement writes both the grouped count and the charge log row.
            "write": f"WITH up AS (INSERT INTO {s}.gdp_spent (principal, event_key, count) "
            "VALUES (%s, %s, 1) "
            f"ON CONFLICT (principal, event_key) DO UPDATE SET count = {s}.gdp_spent.count + 1) "
            f"INSERT INTO {s}.gdp_charges "
            "(principal, event_key, idempotency_key, created_at, within_budget, key_id, seq) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
            "principal": f"SELECT epsilon, delta, accountant, created_at FROM {s}.gdp_principals "
            "WHERE principal = %s",
        }
        try:
            with self._connection() as conn:  # tables and the charge function: budget/migrations
                upgrade_postgres(conninfo, schema, conn)
        except BaseException:
            self._pool.close()
            raise

    @classmethod
    def from_url(cls, url: str) -> PostgresStore:
        parsed = parse_url(url)
        if not isinstance(parsed, PostgresURL):
            raise InvalidParameter("a PostgreSQL url starts with postgresql://")
        return cls(
            parsed.conninfo,
            schema=parsed.schema,
            pool_size=parsed.pool_size,
            pool_timeout_s=parsed.pool_timeout_s,
        )

    def _check(self, conn: Any) -> None:
        """Raise if ``conn`` is broken; a round trip only when its socket has something to read or
        it sat idle for more than ``_IDLE_CHECK_S``.

        A server that ends a session (restart, ``pg_terminate_backend``, idle timeouts) sends a FATAL
        message and closes the socket, which makes the socket readable; a healthy idle connection
        has nothing to read (a stray notice is read by the round trip, harmlessly). The empty
        round trip on every checkout was half of the round trips of a one-statement charge.
        Connections silently cut by the network (no FIN) are caught by the idle check.
        """
        import select

        now = time.monotonic()
        last = self._last_checked.get(id(conn))
        self._last_checked[id(conn)] = now
        try:
            readable = bool(select.select([conn.fileno()], [], [], 0)[0])
        except Exception:  # closed or unusable: let the round trip say so
            readable = True
        if readable or last is None or now - last > _IDLE_CHECK_S:
            conn.execute("")  # what ConnectionPool.check_connection does (autocommit connections)
        if len(self._last_checked) > 4 * self._max_size + 64:  # ids of connections the pool dropped
            self._last_checked.clear()

    @staticmethod
    def _configure(conn: Any) -> None:
        for name, value in _SESSION_SETTINGS.items():
            try:
                conn.execute("SELECT set_config(%s, %s, false)", (name, value))
            except Exception as exc:  # e.g. an older server without the setting
                if conn.info.transaction_status != 0:  # not idle: leave no failed transaction behind
                    conn.rollback()
                if name != "client_connection_check_interval":
                    raise
                logger.warning("PostgreSQL ledger: %s not supported (%s)", name, exc)

    def _get(self, timeout: float | None = None) -> Any:
        """A checked connection: an idle one this store used before, else a new one from the pool.

        Connections this store took from the pool go back to ``_idle`` (a plain queue), not to the
        pool: psycopg_pool's checkout and return cost about 20 us of CPU per charge under load
        (locks, conditions, its worker threads), as much as the charge's own round trip. The pool
        still opens and configures them, and takes back the broken ones and those left in a
        transaction (it closes or resets them); at most ``pool_size`` are taken, and a caller finding
        none idle waits for one up to the pool's timeout.
        """
        wait = self._pool_timeout_s if timeout is None else timeout
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                with self._lock:
                    take = self._taken < self._max_size
                    if take:
                        self._taken += 1
                if take:
                    try:
                        return self._pool.getconn(timeout=wait)  # checked by _check there
                    except BaseException:
                        self._returned()
                        raise
                try:
                    conn = self._idle.get(timeout=wait)
                except queue.Empty:
                    raise self._pool_timeout(f"no ledger connection free within {wait:g} s") from None
            if conn is None:  # a connection went back to the pool: there may be room for a new one
                continue
            try:
                self._check(conn)
            except Exception:  # broken (the server restarted, the backend was terminated)
                self._give_back(conn)  # the pool closes it
                continue
            return conn

    def _returned(self) -> None:
        with self._lock:
            self._taken -= 1
        self._idle.put(None)  # wakes a caller waiting in _get to take a new connection instead

    def _give_back(self, conn: Any) -> None:
        self._pool.putconn(conn)
        self._returned()

    def _put(self, conn: Any) -> None:
        if self._closed or conn.closed or conn.pgconn.transaction_status != _TRANS_IDLE:
            self._give_back(conn)
        else:
            self._idle.put(conn)

    @contextmanager
    def _connection(self, timeout: float | None = None) -> Iterator[Any]:
        """A checked connection; a broken or unreachable database is StoreUnavailable."""
        try:
            conn = self._get(timeout)
        except self._operational_error as exc:
            raise StoreUnavailable(f"the PostgreSQL ledger cannot be reached: {exc}") from exc
        try:
            yield conn
        except self._operational_error as exc:
            raise StoreUnavailable(f"the PostgreSQL ledger cannot be reached: {exc}") from exc
        finally:
            self._put(conn)

    def _retrying(self, work: Callable[[Any], T]) -> T:
        """Run ``work(conn)`` (safe to repeat), retrying on a broken connection a bounded number of times."""
        for attempt in range(_ATTEMPTS):
            try:
                with self._connection() as conn:
                    return work(conn)
            except StoreUnavailable as exc:
                if attempt + 1 == _ATTEMPTS or not _broken_connection(exc.__cause__, self._pool_timeout):
                    raise
                time.sleep(_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run(self, sql: str, args: Sequence[Any], fetch: str, *, retry: bool = True) -> Any:
        text, params = self.dialect.sql(sql), tuple(args)

        def work(conn: Any) -> Any:
            cur = conn.execute(text, params)
            if fetch == "rowcount":
                return cur.rowcount
            return cur.fetchone() if fetch == "one" else cur.fetchall()

        if retry:
            return self._retrying(work)
        with self._connection() as conn:
            return work(conn)

    def ping(self) -> None:
        """One round trip to the database within 2 s (a readiness probe)."""
        with self._connection(timeout=2.0) as conn:
            conn.execute("SELECT 1").fetchone()

    def open_principal(self, principal: str, epsilon: float, delta: float, accountant: str) -> PrincipalRow:
        now = time.time()

        def work(conn: Any) -> Any:  # idempotent (ON CONFLICT DO NOTHING): safe to retry
            conn.execute(
                f"INSERT INTO {self.schema}.gdp_principals "
                "(principal, epsilon, delta, accountant, created_at) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (principal) DO NOTHING",
                (principal, epsilon, delta, accountant, now),
            )
            return conn.execute(self._sql["principal"], (principal,)).fetchone()

        r = self._retrying(work)
        if r is None:  # a database fault
            raise RuntimeError(f"ledger principal {principal!r} missing right after it was opened")
        return principal_row(principal, r)

    def groups(self, principal: str) -> dict[str, int]:
        def work(conn: Any) -> Any:
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                if conn.execute(self._sql["principal"], (principal,)).fetchone() is None:
                    raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
                return conn.execute(self._sql["groups"], (principal,)).fetchall()

        return {k: int(c) for k, c in self._retrying(work)}

    def charge(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        decide: Decide,
        key_id: str | None = None,
    ) -> StoredCharge:
        for attempt in range(_ATTEMPTS):
            sent = [False]  # whether the write may have reached the server
            try:
                return self._charge_once(principal, event_key, idempotency_key, decide, key_id, sent)
            except StoreUnavailable as exc:
                if (
                    sent[0]
                    or attempt + 1 == _ATTEMPTS
                    or not _broken_connection(exc.__cause__, self._pool_timeout)
                ):
                    raise
                time.sleep(_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _charge_once(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        decide: Decide,
        key_id: str | None,
        sent: list[bool],
    ) -> StoredCharge:
        # Pipeline mode: BEGIN, the lock, the idempotency lookup and the history read go to the server
        # in one round trip, the write and COMMIT in a second. The server still runs them in order:
        # each SELECT after the lock takes its snapshot (READ COMMITTED) only once the lock is granted,
        # so the history it reads is current. (A join inside the locking statement would not be.)
        with self._connection() as conn, conn.pipeline() as pipe:
            with conn.transaction():
                conn.execute(self._sql["queue"], (principal,))  # as gdp_charge_next does, first
                lock = conn.execute(self._sql["lock"], (principal,))  # the principal's row lock
                by_key = (
                    conn.execute(self._sql["by_key"], (principal, idempotency_key))
                    if idempotency_key is not None
                    else None
                )
                hist = conn.execute(self._sql["groups"], (principal,))
                pipe.sync()
                r = lock.fetchone()
                if r is None:
                    raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
                row = PrincipalRow(principal, r[0], r[1], r[2], r[3])
                e = by_key.fetchone() if by_key is not None else None
                if e is not None:
                    earlier = StoredCharge(
                        e[0], principal, e[1], idempotency_key, e[2], bool(e[3]), key_id=e[4]
                    )
                    return replayed_charge(earlier, event_key)
                groups = {k: int(c) for k, c in hist.fetchall()}
                within = decide(row, groups)  # may raise: leaving the transaction block rolls back
                now = time.time()
                sent[0] = True
                seq = sum(groups.values()) + 1  # exact: no other charge of the principal is in flight
                write = conn.execute(
                    self._sql["write"],
                    (principal, event_key, principal, event_key, idempotency_key, now, within, key_id, seq),
                )
            pipe.sync()  # COMMIT has been queued by the transaction block; wait for it
            w = write.fetchone()
            if w is None:  # a database fault
                raise RuntimeError(f"the charge of {principal!r} returned no row from PostgreSQL")
        return StoredCharge(int(w[0]), principal, event_key, idempotency_key, now, within, key_id=key_id)

    def charge_next(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        seq: int,
        key_id: str | None = None,
    ) -> StoredCharge | None:
        """Charge if the principal has exactly ``seq - 1`` charges (the history the caller decided on).

        One round trip, one statement (``gdp_charge_next``, migration 0005): no row lock beyond the
        key-share lock of the charge's own foreign key. Returns None, having written nothing, where
        the general :meth:`charge` must decide: the history moved, the idempotency key was used
        before, or the principal is unknown. Not retried on a broken connection (the one statement
        both decides and writes).
        """
        now = time.time()
        with self._connection() as conn:
            enc = conn.info.encoding
            charge_id = self._exec_next(
                conn,
                [
                    principal.encode(enc),
                    event_key.encode(enc),
                    None if idempotency_key is None else idempotency_key.encode(enc),
                    str(int(seq)).encode(),
                    repr(now).encode(),
                    None if key_id is None else key_id.encode(enc),
                ],
            )
        if charge_id is None:
            return None
        return StoredCharge(int(charge_id), principal, event_key, idempotency_key, now, True, key_id=key_id)

    def _exec_next(self, conn: Any, params: list[bytes | None]) -> bytes | None:
        """``gdp_charge_next``'s answer (the charge id as text, or None), through libpq directly.

        psycopg's own execute path costs about 70 us of client CPU per call (adaptation, its
        prepared-statement cache, result loaders) against about 25 us for the libpq call itself, and
        on a busy machine the client's CPU is the charge's throughput. The statement is prepared once
        per connection; every parameter is text. libpq releases the GIL while it waits.
        """
        pg = conn.pgconn
        for attempt in range(2):
            if conn not in self._prepared:
                res = pg.prepare(_NEXT_NAME, self._next_sql)
                if res.status != _COMMAND_OK:
                    raise self._fail(pg, res)
                self._prepared.add(conn)
            res = pg.exec_prepared(_NEXT_NAME, params)
            if res.status == _TUPLES_OK:
                break
            # psycopg deallocates every prepared statement of a connection when it rolls a transaction
            # back (DEALLOCATE ALL): prepare again. Nothing ran (the error is raised before execution).
            if attempt == 0 and res.error_field(_SQLSTATE) == b"26000":
                self._prepared.discard(conn)
                continue
            raise self._fail(pg, res)
        if res.ntuples != 1:  # a database fault
            raise RuntimeError(f"gdp_charge_next returned {res.ntuples} rows")
        value: bytes | None = res.get_value(0, 0)
        return value

    def _fail(self, pg: Any, res: Any) -> Exception:
        """The exception psycopg would raise for ``res``: a lost connection is an OperationalError."""
        if pg.status == _CONNECTION_BAD:
            return self._operational_error(
                f"connection lost: {(res.error_message or pg.error_message).decode(errors='replace')}"
            )
        return self._error_from_result(res, encoding="utf-8")

    def open_principal_within(
        self, principal: str, epsilon: float, delta: float, accountant: str, tenant: str
    ) -> PrincipalRow:
        s = self.schema

        def work(conn: Any) -> Any:
            with conn.transaction():
                r = conn.execute(self._sql["principal"], (principal,)).fetchone()
                if r is not None:
                    return r
                # The tenant's row lock serialises the opens of its sessions while caps exist.
                caps = conn.execute(f"SELECT 1 FROM {s}.gdp_tenants WHERE tenant = %s FOR UPDATE", (tenant,))
                if caps.fetchone() is not None:
                    ok = conn.execute(
                        f"UPDATE {s}.gdp_tenants SET sessions = sessions + 1, "
                        "epsilon_granted = epsilon_granted + %s WHERE tenant = %s "
                        "AND (max_sessions IS NULL OR sessions + 1 <= max_sessions) "
                        "AND (max_epsilon IS NULL OR epsilon_granted + %s <= max_epsilon) RETURNING 1",
                        (epsilon, tenant, epsilon),
                    ).fetchone()
                    if ok is None:
                        raise TenantLimitExceeded(cap_message(tenant, epsilon))
                inserted = conn.execute(
                    f"INSERT INTO {s}.gdp_principals (principal, epsilon, delta, accountant, created_at) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (principal) DO NOTHING RETURNING epsilon",
                    (principal, epsilon, delta, accountant, time.time()),
                ).fetchone()
                if inserted is None:  # opened concurrently: count nothing (roll back the counters)
                    raise _Reopened
                return conn.execute(self._sql["principal"], (principal,)).fetchone()

        try:
            r = self._retrying(work)
        except _Reopened:
            r = self._retrying(lambda conn: conn.execute(self._sql["principal"], (principal,)).fetchone())
        if r is None:  # a database fault
            raise RuntimeError(f"ledger principal {principal!r} missing right after it was opened")
        return principal_row(principal, r)

    def set_tenant_limits(self, tenant: str, max_sessions: int | None, max_epsilon: float | None) -> None:
        s, prefix = self.schema, tenant + "/"
        with self._connection() as conn, conn.transaction():
            conn.execute(
                f"INSERT INTO {s}.gdp_tenants (tenant, max_sessions, max_epsilon) VALUES (%s, %s, %s) "
                "ON CONFLICT (tenant) DO NOTHING",
                (tenant, max_sessions, max_epsilon),
            )
            conn.execute(f"SELECT 1 FROM {s}.gdp_tenants WHERE tenant = %s FOR UPDATE", (tenant,))
            # with the row locked, no session of the tenant opens while they are counted
            conn.execute(
                f"UPDATE {s}.gdp_tenants t SET max_sessions = %s, max_epsilon = %s, sessions = c.n, "
                "epsilon_granted = c.e FROM (SELECT count(*) AS n, coalesce(sum(epsilon), 0) AS e "
                f"FROM {s}.gdp_principals WHERE left(principal, %s) = %s) c WHERE t.tenant = %s",
                (max_sessions, max_epsilon, len(prefix), prefix, tenant),
            )

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                self._give_back(conn)
        self._pool.close()
