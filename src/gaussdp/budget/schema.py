"""Schema version and forward migrations of the durable ledger stores (alembic).

The revisions live in ``budget/migrations/versions``; the version is kept in the table
``gdp_schema_version`` (alembic's version table, in the ledger's PostgreSQL schema). Opening a store
checks that version with one query and runs alembic only when it is behind (first open of a new
database, or of one made by an earlier gaussdp: the baseline adopts today's tables as they are).
Upgrades of one database are serialised (advisory lock on PostgreSQL, ``BEGIN IMMEDIATE`` on
SQLite), so any number of processes may open a ledger at once. A database whose version this gaussdp
does not know (made by a newer one) is refused rather than used.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_HEAD",
    "SCHEMA_VERSIONS",
    "SchemaTooNew",
    "check_sqlite_schema",
    "upgrade_postgres",
    "upgrade_sqlite",
]

# Revisions in order; the last is the head this code reads and writes (a test checks it is alembic's).
SCHEMA_VERSIONS = ("0001", "0002", "0003", "0004", "0005", "0006")
SCHEMA_HEAD = SCHEMA_VERSIONS[-1]
VERSION_TABLE = "gdp_schema_version"
_MIGRATIONS = Path(__file__).with_name("migrations")


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer gaussdp: its schema version is unknown here."""


def _check_known(version: str | None, where: str) -> bool:
    """True when ``version`` is the head; raise when it is unknown (a newer gaussdp's)."""
    if version is None:
        return False
    if version not in SCHEMA_VERSIONS:
        raise SchemaTooNew(
            f"{where} has schema version {version!r}, unknown to this gaussdp (it knows "
            f"{', '.join(SCHEMA_VERSIONS)}): upgrade gaussdp; nothing was changed"
        )
    return version == SCHEMA_HEAD


def _alembic_config(connection: Any, schema: str | None) -> Any:
    try:
        from alembic.config import Config
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "creating or upgrading a durable ledger's schema needs alembic: pip install 'gaussdp[service]'"
        ) from None
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = connection
    cfg.attributes["gdp_schema"] = schema
    return cfg


def sqlite_version(conn: sqlite3.Connection) -> str | None:
    try:
        r = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()
    except sqlite3.OperationalError:  # no version table yet
        return None
    return None if r is None else str(r[0])


def check_sqlite_schema(path: str, conn: sqlite3.Connection) -> None:
    """Refuse a SQLite ledger not at :data:`SCHEMA_HEAD` (for read-only opens, which cannot migrate)."""
    from gaussdp.errors import InvalidParameter

    if not _check_known(sqlite_version(conn), repr(path)):
        raise InvalidParameter(
            f"the SQLite ledger {path!r} is at schema version {sqlite_version(conn)!r}, not "
            f"{SCHEMA_HEAD!r}; opened read-only it cannot be migrated: open it once read-write "
            "(e.g. start `gaussdp serve` on it) to upgrade"
        )


def upgrade_sqlite(path: str, conn: sqlite3.Connection | None = None) -> None:
    """Bring the SQLite ledger at ``path`` to :data:`SCHEMA_HEAD` (a no-op when it is there)."""
    if conn is not None and _check_known(sqlite_version(conn), repr(path)):
        return
    from alembic import command
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    engine = create_engine(
        "sqlite://",
        creator=lambda: sqlite3.connect(path, timeout=60.0, isolation_level=None),
        poolclass=NullPool,
    )

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:  # the write lock first: concurrent upgrades queue
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    try:
        with engine.connect() as connection:
            command.upgrade(_alembic_config(connection, None), SCHEMA_HEAD)
    finally:
        engine.dispose()


def postgres_version(conn: Any, schema: str) -> str | None:
    r = conn.execute("SELECT to_regclass(%s)", (f"{schema}.{VERSION_TABLE}",)).fetchone()
    if r is None or r[0] is None:
        return None
    v = conn.execute(f"SELECT version_num FROM {schema}.{VERSION_TABLE}").fetchone()
    return None if v is None else str(v[0])


def upgrade_postgres(conninfo: str, schema: str, conn: Any = None) -> None:
    """Bring the ledger in ``schema`` of the database at ``conninfo`` to :data:`SCHEMA_HEAD`."""
    if conn is not None and _check_known(postgres_version(conn, schema), f"schema {schema!r}"):
        return
    import psycopg
    from alembic import command
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(conninfo), poolclass=NullPool
    )
    try:
        with engine.connect() as connection:
            command.upgrade(_alembic_config(connection, schema), SCHEMA_HEAD)
    finally:
        engine.dispose()
