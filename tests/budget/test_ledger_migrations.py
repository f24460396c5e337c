"""Schema version and forward migrations (alembic), from the schema gaussdp used before them.

A database made by the previous gaussdp (tables, no version table) is created here with that
release's DDL, filled, then opened: it is migrated to the head, every row kept, and the new columns
work. Concurrent first opens serialise; a database from a newer gaussdp is refused.
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("alembic")

from gaussdp.accounting import GaussianEvent
from gaussdp.budget import Budget, Ledger
from gaussdp.budget._compose import event_key
from gaussdp.budget.schema import SCHEMA_HEAD, SchemaTooNew

EVENT = GaussianEvent(noise_multiplier=4.0)
EVENT_KEY = event_key(EVENT)

# The schema of gaussdp before versioned migrations (src/gaussdp/budget/{sqlite,postgres}.py), frozen.
OLD_SQLITE = """
CREATE TABLE gdp_principals (principal TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL,
    accountant TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE gdp_spent (principal TEXT NOT NULL REFERENCES gdp_principals(principal),
    event_key TEXT NOT NULL, count INTEGER NOT NULL CHECK (count > 0),
    PRIMARY KEY (principal, event_key)) WITHOUT ROWID;
CREATE TABLE gdp_charges (id INTEGER PRIMARY KEY AUTOINCREMENT,
    principal TEXT NOT NULL REFERENCES gdp_principals(principal), event_key TEXT NOT NULL,
    idempotency_key TEXT, created_at REAL NOT NULL, within_budget INTEGER NOT NULL,
    UNIQUE (principal, idempotency_key));
CREATE INDEX gdp_charges_principal ON gdp_charges (principal, id);
CREATE TABLE gdp_api_keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_hash TEXT NOT NULL,
    created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0);
"""
OLD_POSTGRES = """
CREATE SCHEMA {s};
CREATE TABLE {s}.gdp_principals (principal TEXT PRIMARY KEY, epsilon DOUBLE PRECISION NOT NULL,
    delta DOUBLE PRECISION NOT NULL, accountant TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL);
CREATE TABLE {s}.gdp_spent (principal TEXT NOT NULL REFERENCES {s}.gdp_principals(principal),
    event_key TEXT NOT NULL, count BIGINT NOT NULL CHECK (count > 0), PRIMARY KEY (principal, event_key));
CREATE TABLE {s}.gdp_charges (id BIGSERIAL PRIMARY KEY,
    principal TEXT NOT NULL REFERENCES {s}.gdp_principals(principal), event_key TEXT NOT NULL,
    idempotency_key TEXT, created_at DOUBLE PRECISION NOT NULL, within_budget BOOLEAN NOT NULL,
    UNIQUE (principal, idempotency_key));
CREATE INDEX gdp_charges_principal ON {s}.gdp_charges (principal, id);
CREATE TABLE {s}.gdp_api_keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, revoked BOOLEAN NOT NULL DEFAULT FALSE);
CREATE FUNCTION {s}.gdp_charge_fast(p_principal TEXT, p_key TEXT, p_idem TEXT, p_others_md5 TEXT,
    p_allowed BIGINT, p_now DOUBLE PRECISION) RETURNS VOID LANGUAGE sql AS 'SELECT NULL';
"""
ROWS = [
    "INSERT INTO {p}gdp_principals VALUES ('t/s', 2.0, 1e-5, 'pld', 1.0)",
    "INSERT INTO {p}gdp_spent VALUES ('t/s', '{event}', 2)",
    "INSERT INTO {p}gdp_charges (principal, event_key, idempotency_key, created_at, within_budget) "
    "VALUES ('t/s', '{event}', 'k1', 2.0, {true})",
    "INSERT INTO {p}gdp_charges (principal, event_key, idempotency_key, created_at, within_budget) "
    "VALUES ('t/s', '{event}', NULL, 3.0, {true})",
    "INSERT INTO {p}gdp_api_keys VALUES ('0123456789abcdef', 't', 'hash', 4.0, {false})",
]


def _row_sql(sql: str, prefix: str, true: str, false: str) -> str:
    return (
        sql.replace("{p}", prefix)
        .replace("{true}", true)
        .replace("{false}", false)
        .replace("{event}", EVENT_KEY)
    )


def _check_migrated(url: str) -> None:
    with Ledger(url) as ledger:
        before = ledger.spent("t/s")
        history = ledger.history("t/s")
        assert [(c.charge_id, c.idempotency_key, c.key_id) for c in history] == [
            (1, "k1", None),
            (2, None, None),
        ]
        assert ledger.events("t/s") == [(EVENT, 2)]
        assert ledger.budget("t/s") == Budget(2.0, 1e-5)
        keys = ledger.store.list_api_keys()
        assert [(k.key_id, k.scopes, k.expires_at) for k in keys] == [("0123456789abcdef", "release", None)]
        assert ledger.store.get_tenant_limits("t") is None
        assert ledger.charge("t/s", EVENT, "k1").replayed  # old idempotency keys still hold
        receipt = ledger.charge("t/s", EVENT, key_id="fedcba9876543210")  # the new column
        assert ledger.history("t/s")[-1].key_id == "fedcba9876543210"
        assert receipt.charge_id == 3
        assert ledger.spent("t/s").epsilon > before.epsilon


def test_sqlite_database_of_the_previous_schema_is_migrated_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SQLITE)
        for sql in ROWS:
            conn.execute(_row_sql(sql, "", "1", "0"))
    _check_migrated(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM gdp_schema_version").fetchall() == [(SCHEMA_HEAD,)]
    _check_reopen_is_one_query(f"sqlite:///{path}")


@pytest.mark.postgres
def test_postgres_schema_of_the_previous_release_is_migrated_with_its_rows(fresh_pg_url: str) -> None:
    import psycopg

    base, schema = fresh_pg_url.split("?schema=")
    with psycopg.connect(base, autocommit=True) as conn:
        for sql in OLD_POSTGRES.format(s=schema).split(";"):
            if sql.strip():
                conn.execute(sql)
        for sql in ROWS:
            conn.execute(_row_sql(sql, schema + ".", "TRUE", "FALSE"))
        conn.execute(f"SELECT setval('{schema}.gdp_charges_id_seq', 2)")
    _check_migrated(fresh_pg_url)
    with psycopg.connect(base) as conn:
        assert conn.execute(f"SELECT version_num FROM {schema}.gdp_schema_version").fetchall() == [
            (SCHEMA_HEAD,)
        ]
        functions = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = 'gdp_charge_fast'",
            (schema,),
        ).fetchall()
    # the previous release's function is replaced by the one that records the key id
    assert [f.split(".")[-1] for (f,) in functions] == [
        "gdp_charge_fast(text,text,text,text,bigint,double precision,text)"
    ]
    _check_reopen_is_one_query(fresh_pg_url)


def _check_reopen_is_one_query(url: str) -> None:
    # Up to date: opening again decides with one version query and never runs alembic.
    from unittest import mock

    with mock.patch("alembic.command.upgrade", side_effect=AssertionError("alembic ran")):
        with Ledger(url) as ledger:
            assert ledger.history("t/s")[-1].charge_id == 3


def _open(url: str, q: object) -> None:
    try:
        with Ledger(url) as ledger:
            ledger.open("p", Budget(1.0, 1e-5))
        q.put("ok")  # type: ignore[attr-defined]
    except Exception as exc:  # reported to the parent
        q.put(repr(exc))  # type: ignore[attr-defined]


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_concurrent_first_opens_migrate_once(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}" if store == "sqlite" else request.getfixturevalue("fresh_pg_url")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_open, args=(url, q)) for _ in range(6)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok"] * len(procs)
    with Ledger(url) as ledger:
        assert ledger.principals() == ["p"]


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    Ledger(url).close()
    with sqlite3.connect(tmp_path / "new.db") as conn:
        conn.execute("UPDATE gdp_schema_version SET version_num = '9999'")
    with pytest.raises(SchemaTooNew, match="9999"):
        Ledger(url)


def test_schema_head_is_alembics_head() -> None:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from gaussdp.budget import schema

    cfg = Config()
    cfg.set_main_option("script_location", str(schema._MIGRATIONS))
    script = ScriptDirectory.from_config(cfg)
    assert script.get_current_head() == schema.SCHEMA_HEAD
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert tuple(revisions) == schema.SCHEMA_VERSIONS
