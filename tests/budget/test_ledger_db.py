"""The one database layer (gaussdp.budget._db): one URL parser, one SQLite connection with the
ledger's pragmas, one dialect, and the queries both stores share, used by the job store too."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gaussdp.budget import Budget, Ledger
from gaussdp.budget._db import (
    SQLITE,
    PostgresURL,
    SQLiteURL,
    check_sqlite_ledger,
    connect_sqlite,
    parse_url,
    postgres_dialect,
)
from gaussdp.errors import InvalidParameter


def test_sqlite_urls_parse_to_a_path_and_the_ledger_options() -> None:
    assert parse_url("sqlite:///ledger.db") == SQLiteURL("ledger.db")
    assert parse_url("sqlite:////var/lib/a%20b.db?synchronous=normal&busy_timeout_ms=5") == SQLiteURL(
        "/var/lib/a b.db", synchronous="normal", busy_timeout_ms=5
    )
    with pytest.raises(InvalidParameter, match="unknown SQLite url option"):
        parse_url("sqlite:///ledger.db?journal=delete")
    with pytest.raises(InvalidParameter, match=r"sqlite:///ledger\.db"):
        parse_url("sqlite://ledger.db")


def test_postgres_urls_keep_libpq_options_and_take_ours_out() -> None:
    parsed = parse_url("postgresql://u:pw@h:5/db?schema=s1&pool_size=3&pool_timeout_s=2.5&sslmode=require")
    assert parsed == PostgresURL("postgresql://u:pw@h:5/db?sslmode=require", "s1", 3, 2.5)
    assert parse_url("postgres://h/db") == PostgresURL("postgres://h/db")


def test_other_schemes_are_refused_without_their_password() -> None:
    with pytest.raises(InvalidParameter) as refused:
        parse_url("mysql://root:secret@host/db")
    assert "secret" not in str(refused.value) and "host/db" in str(refused.value)


def test_the_dialect_renders_one_query_for_each_database() -> None:
    q = "SELECT x FROM {p}t WHERE {starts} AND y = {least}(?, ?) AND t < {now}"
    assert SQLITE.sql(q) == (
        "SELECT x FROM t WHERE substr(principal, 1, ?) = ? AND y = min(?, ?) "
        "AND t < ((julianday('now') - 2440587.5) * 86400.0)"
    )
    pg = postgres_dialect("s1").sql(q)
    assert pg.startswith("SELECT x FROM s1.t WHERE left(principal, %s) = %s AND y = least(%s, %s)")
    assert "?" not in pg


def test_connections_get_the_ledger_s_pragmas(tmp_path: Path) -> None:
    conn = connect_sqlite(str(tmp_path / "x.db"), busy_timeout_ms=1234, synchronous="normal")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    finally:
        conn.close()


def test_a_read_only_check_creates_nothing_and_names_what_is_wrong(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    with pytest.raises(InvalidParameter, match="no SQLite ledger"):
        check_sqlite_ledger(str(missing))
    assert not missing.exists()
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(InvalidParameter, match="not a gaussdp ledger"):
        check_sqlite_ledger(str(other))
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as led:
        led.open("p", Budget(1.0, 1e-5))
    check_sqlite_ledger(str(tmp_path / "ledger.db"))  # a ledger at the current schema passes


def test_the_job_store_opens_the_ledger_s_url_with_its_options(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from gaussdp.service.jobs import JobStore

    url = f"sqlite:///{tmp_path / 'ledger.db'}?synchronous=normal&busy_timeout_ms=2500"
    with pytest.raises(InvalidParameter, match="no SQLite ledger"):
        JobStore(url)  # before the ledger exists: nothing is created
    assert not (tmp_path / "ledger.db").exists()
    Ledger(url).close()
    jobs = JobStore(url)
    try:
        assert jobs.corpus_usage("t") == (0, 0)
        conn = jobs._sqlite()
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 2500
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1
    finally:
        jobs.close()
    with pytest.raises(InvalidParameter, match="fine-tuning needs a durable ledger"):
        JobStore("memory://")
