"""One database layer for every durable row: the ledger's stores (:mod:`~gaussdp.budget.sqlite`,
:mod:`~gaussdp.budget.postgres`), their API keys and tenant caps, and the service's job store
(:mod:`gaussdp.service.jobs`).

It holds what does not depend on privacy: the URLs (:func:`parse_url`, one spelling for every
caller), the connections (:func:`connect_sqlite` with the ledger's pragmas; :func:`postgres_pool`),
the dialect (:class:`Dialect`: placeholders, the schema's prefix, the clock, prefix matching), the
queries that read and write the same way on both databases (:class:`SharedQueries`: histories,
exports, principals, API keys, tenant caps) and the row mappers. What stays per dialect is what
locks: the charge paths, and opening a session within its tenant's caps.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from gaussdp.budget.store import ApiKeyRow, PrincipalRow, StoredCharge, TenantLimits, UnknownPrincipal
from gaussdp.errors import InvalidParameter

__all__ = [
    "POSTGRES_PREFIXES",
    "SQLITE",
    "Dialect",
    "PostgresURL",
    "SQLiteURL",
    "SharedQueries",
    "check_sqlite_ledger",
    "connect_sqlite",
    "parse_url",
    "postgres_dialect",
    "postgres_pool",
    "principal_row",
]

POSTGRES_PREFIXES = ("postgresql://", "postgres://")


# -- URLs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SQLiteURL:
    """``sqlite:///relative.db`` or ``sqlite:////absolute.db``, options ``synchronous`` and
    ``busy_timeout_ms``."""

    path: str
    synchronous: str = "full"
    busy_timeout_ms: int = 60_000


@dataclass(frozen=True)
class PostgresURL:
    """A libpq URI; ``schema``, ``pool_size`` and ``pool_timeout_s`` are ours (taken out of it)."""

    conninfo: str
    schema: str = "public"
    pool_size: int = 16
    pool_timeout_s: float = 10.0


def parse_url(url: str) -> SQLiteURL | PostgresURL:
    """The durable database of ``url`` (``sqlite:///...`` or ``postgresql://...``).

    Raises:
        InvalidParameter: another scheme, a malformed SQLite URL, or an unknown SQLite option.
    """
    if url.startswith("sqlite://"):
        rest = url[len("sqlite://") :]
        if not rest.startswith("/"):
            raise InvalidParameter(f"a SQLite url looks like sqlite:///ledger.db, got url={url!r}")
        path, _, query = rest[1:].partition("?")
        options = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(options) - {"synchronous", "busy_timeout_ms"}
        if unknown:
            raise InvalidParameter(f"unknown SQLite url option(s) {sorted(unknown)} in url={url!r}")
        return SQLiteURL(
            unquote(path),
            synchronous=options.get("synchronous", "full"),
            busy_timeout_ms=int(options.get("busy_timeout_ms", 60_000)),
        )
    if url.startswith(POSTGRES_PREFIXES):
        parts = urlsplit(url)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        ours = ("schema", "pool_size", "pool_timeout_s")
        libpq = [(k, v) for k, v in pairs if k not in ours]
        return PostgresURL(
            urlunsplit(parts._replace(query=urlencode(libpq))),
            schema=next((v for k, v in pairs if k == "schema"), "public"),
            pool_size=int(next((v for k, v in pairs if k == "pool_size"), "16")),
            pool_timeout_s=float(next((v for k, v in pairs if k == "pool_timeout_s"), "10")),
        )
    raise InvalidParameter(
        "url must start with sqlite:/// or postgresql://, got url=" + repr(url.split("@")[-1])
    )


# -- connections -----------------------------------------------------------------------------------
def connect_sqlite(
    path: str, *, busy_timeout_ms: int, synchronous: str = "FULL", read_only: bool = False
) -> sqlite3.Connection:
    """A connection to the ledger's SQLite file with the ledger's pragmas: WAL, ``synchronous``,
    foreign keys, ``busy_timeout``; autocommit (callers issue ``BEGIN [IMMEDIATE]`` themselves).

    ``read_only``: through a ``mode=ro`` URI (a missing file is an error, never a new empty ledger),
    and without the journal-mode switch (a write).
    """
    target, uri = path, False
    if read_only:
        # mode=ro never creates the database. A WAL database read with mode=ro alone makes SQLite
        # create its -wal and -shm files when they are missing; they are missing only when no
        # connection has it open and every change is in the main file, so then it is read as
        # immutable (no side files). Where they exist they are used, and nothing new is created.
        resolved = Path(path).resolve()
        query = "mode=ro" if Path(f"{resolved}-wal").exists() else "mode=ro&immutable=1"
        target, uri = f"file:{quote(str(resolved))}?{query}", True
    try:
        conn = sqlite3.connect(
            target,
            uri=uri,
            timeout=busy_timeout_ms / 1000.0,
            isolation_level=None,  # BEGIN IMMEDIATE / COMMIT are issued by the callers
            check_same_thread=False,  # a pooled connection is used by one thread at a time
        )
    except sqlite3.OperationalError as exc:
        raise sqlite3.OperationalError(f"cannot open the SQLite ledger {path!r}: {exc}") from exc
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    if read_only:
        return conn
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode.lower() != "wal":
        conn.close()
        raise InvalidParameter(f"could not switch {path!r} to WAL mode (got {mode!r})")
    conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def check_sqlite_ledger(path: str) -> None:
    """Refuse a path that is not a ledger at the current schema, without creating or changing it.

    Raises:
        InvalidParameter: no such file, or a file without the ledger's tables.
        SchemaTooNew: see :func:`gaussdp.budget.schema.check_sqlite_schema` (or an older schema).
    """
    from gaussdp.budget.schema import check_sqlite_schema

    if not Path(path).is_file():
        raise InvalidParameter(f"no SQLite ledger at {path!r} (opened read-only: nothing is created)")
    conn = connect_sqlite(path, busy_timeout_ms=60_000, read_only=True)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "gdp_principals" not in tables:
            raise InvalidParameter(f"{path!r} is not a gaussdp ledger (no gdp_principals table)")
        check_sqlite_schema(path, conn)  # a read-only open cannot migrate: refuse an older schema
    finally:
        conn.close()


def postgres_pool(conninfo: str, *, max_size: int, name: str, **options: Any) -> Any:
    """A psycopg connection pool of autocommit connections (``min_size=1``, opened now)."""
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "a PostgreSQL ledger needs psycopg 3 and psycopg_pool: pip install 'gaussdp[service]'"
        ) from None
    return ConnectionPool(
        conninfo,
        min_size=1,
        max_size=max(1, int(max_size)),
        kwargs={"autocommit": True},
        open=True,
        name=name,
        **options,
    )


# -- the dialect -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dialect:
    """How one database spells what the shared queries need.

    Queries are written once with ``?`` placeholders, ``{p}`` before table names (the schema's
    prefix), ``{now}`` for the server's clock in Unix seconds, ``{least}`` for the smaller of two
    values and ``{starts}`` for "the principal starts with" (two parameters: the prefix's length and
    the prefix); :meth:`sql` renders them.
    """

    name: str
    prefix: str
    now: str
    least: str
    starts: str
    placeholder: str

    def sql(self, text: str) -> str:
        text = text.replace("{starts}", self.starts).replace("{least}", self.least)
        text = text.replace("{p}", self.prefix).replace("{now}", self.now)
        return text.replace("?", self.placeholder) if self.placeholder != "?" else text


SQLITE = Dialect(
    name="sqlite",
    prefix="",
    now="((julianday('now') - 2440587.5) * 86400.0)",  # Unix seconds, sub-second
    least="min",
    starts="substr(principal, 1, ?) = ?",
    placeholder="?",
)


def postgres_dialect(schema: str) -> Dialect:
    return Dialect(
        name="postgres",
        prefix=f"{schema}.",
        now="extract(epoch from clock_timestamp())::double precision",
        least="least",
        starts="left(principal, ?) = ?",
        placeholder="%s",
    )


# -- row mappers -----------------------------------------------------------------------------------
def principal_row(principal: str, r: Sequence[Any]) -> PrincipalRow:
    """``(epsilon, delta, accountant, created_at)`` of ``principal``."""
    return PrincipalRow(principal, r[0], r[1], r[2], r[3])


def _charge(r: Sequence[Any], principal: str | None = None) -> StoredCharge:
    """``(id, [principal,] event_key, idempotency_key, created_at, within_budget, key_id)``."""
    if principal is None:
        principal, r = r[1], (r[0], *r[2:])
    return StoredCharge(int(r[0]), principal, r[1], r[2], r[3], bool(r[4]), key_id=r[5])


def _api_key(r: Sequence[Any]) -> ApiKeyRow:
    return ApiKeyRow(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6])


def _tenant_limits(r: Sequence[Any]) -> TenantLimits:
    return TenantLimits(r[0], r[1], r[2], int(r[3]), float(r[4]))


_PRINCIPAL = "SELECT epsilon, delta, accountant, created_at FROM {p}gdp_principals WHERE principal = ?"
_KEYS = "SELECT key_id, tenant, key_hash, created_at, revoked, scopes, expires_at FROM {p}gdp_api_keys"
_CHARGE_COLUMNS = "id, event_key, idempotency_key, created_at, within_budget, key_id"


class SharedQueries:
    """The store methods that read and write the same way on SQLite and PostgreSQL.

    A store mixes this in and gives :meth:`_run`: run one statement (rendered by its dialect) and
    fetch ``"one"``, ``"all"`` or the ``"rowcount"``; ``retry`` says whether the statement is safe
    to run again after a broken connection (reads and idempotent writes).
    """

    dialect: Dialect

    def _run(self, sql: str, args: Sequence[Any], fetch: str, *, retry: bool = True) -> Any:
        raise NotImplementedError

    # principals and charges
    def get_principal(self, principal: str) -> PrincipalRow | None:
        r = self._run(_PRINCIPAL, (principal,), "one")
        return None if r is None else principal_row(principal, r)

    def list_principals(self, prefix: str = "") -> list[str]:
        sql = "SELECT principal FROM {p}gdp_principals WHERE {starts} ORDER BY principal"
        return [r[0] for r in self._run(sql, (len(prefix), prefix), "all")]

    def history(self, principal: str, limit: int | None = None) -> list[StoredCharge]:
        if self.get_principal(principal) is None:
            raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
        sql = f"SELECT {_CHARGE_COLUMNS} FROM {{p}}gdp_charges WHERE principal = ? ORDER BY id DESC"
        args: tuple[Any, ...] = (principal,)
        if limit is not None:
            sql += " LIMIT ?"
            args = (principal, int(limit))
        return [_charge(r, principal) for r in reversed(self._run(sql, args, "all"))]

    def charges_after(
        self, prefix: str, after_id: int, limit: int, *, exact: bool = False
    ) -> list[StoredCharge]:
        where = "principal = ?" if exact else "{starts}"
        args: tuple[Any, ...] = (prefix,) if exact else (len(prefix), prefix)
        sql = (
            "SELECT id, principal, event_key, idempotency_key, created_at, within_budget, key_id "
            f"FROM {{p}}gdp_charges WHERE {where} AND id > ? ORDER BY id LIMIT ?"
        )
        return [_charge(r) for r in self._run(sql, (*args, int(after_id), int(limit)), "all")]

    # API keys
    def put_api_key(self, row: ApiKeyRow) -> None:
        sql = (
            "INSERT INTO {p}gdp_api_keys (key_id, tenant, key_hash, created_at, revoked, scopes, "
            "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
        )
        args = (row.key_id, row.tenant, row.key_hash, row.created_at, row.revoked, row.scopes, row.expires_at)
        self._run(sql, args, "rowcount", retry=False)  # not idempotent: a retry could raise a conflict

    def get_api_key(self, key_id: str) -> ApiKeyRow | None:
        r = self._run(_KEYS + " WHERE key_id = ?", (key_id,), "one")
        return None if r is None else _api_key(r)

    def list_api_keys(self) -> list[ApiKeyRow]:
        return [_api_key(r) for r in self._run(_KEYS + " ORDER BY tenant, created_at", (), "all")]

    def revoke_api_key(self, key_id: str) -> bool:
        sql = "UPDATE {p}gdp_api_keys SET revoked = TRUE WHERE key_id = ?"
        return bool(self._run(sql, (key_id,), "rowcount") > 0)  # idempotent

    def expire_api_key(self, key_id: str, expires_at: float) -> bool:
        sql = "UPDATE {p}gdp_api_keys SET expires_at = {least}(coalesce(expires_at, ?), ?) WHERE key_id = ?"
        return bool(self._run(sql, (expires_at, expires_at, key_id), "rowcount") > 0)

    # tenant caps (opening a session within them locks, per dialect)
    def get_tenant_limits(self, tenant: str) -> TenantLimits | None:
        sql = (
            "SELECT tenant, max_sessions, max_epsilon, sessions, epsilon_granted FROM {p}gdp_tenants "
            "WHERE tenant = ?"
        )
        r = self._run(sql, (tenant,), "one")
        return None if r is None else _tenant_limits(r)
