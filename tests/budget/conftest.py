"""Fixtures for the ledger contract suite: one ledger per store (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

PG_BASE = os.environ.get("GAUSSDP_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def pg_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_BASE, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_schema() -> Iterator[str]:
    """A fresh schema on the shared ``test`` database for this test run, dropped afterwards."""
    if not pg_available():
        pytest.skip(f"PostgreSQL unreachable at {PG_BASE}")
    import psycopg

    schema = f"gdp_test_{os.getpid()}_{secrets.token_hex(4)}"
    yield schema
    with psycopg.connect(PG_BASE, autocommit=True) as conn:
        names = conn.execute(
            "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE %s", (schema + "%",)
        ).fetchall()
        for (name,) in names:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def pg_url(schema: str) -> str:
    sep = "&" if "?" in PG_BASE else "?"
    return f"{PG_BASE}{sep}schema={schema}"


@pytest.fixture
def fresh_pg_url(pg_schema: str) -> str:
    """A PostgreSQL ledger URL with a schema of its own (created on first use, dropped at the end)."""
    return pg_url(pg_schema + "_" + secrets.token_hex(3))


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A fresh, empty ledger URL per test for each store."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("fresh_pg_url"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def durable_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A fresh ledger URL for each durable store (several ledgers and processes may open it)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("fresh_pg_url"))
