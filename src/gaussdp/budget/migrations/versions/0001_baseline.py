"""Baseline: the ledger's schema as released before versioned migrations (gaussdp <= issue 18).

Every statement is IF NOT EXISTS: a database created by an earlier gaussdp (tables present, no
version table) is adopted as it is, its rows kept.

Revision ID: 0001
Revises:
"""

from alembic import context, op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE = """
CREATE TABLE IF NOT EXISTS gdp_principals (
    principal TEXT PRIMARY KEY,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    accountant TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS gdp_spent (
    principal TEXT NOT NULL REFERENCES gdp_principals(principal),
    event_key TEXT NOT NULL,
    count INTEGER NOT NULL CHECK (count > 0),
    PRIMARY KEY (principal, event_key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gdp_charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    principal TEXT NOT NULL REFERENCES gdp_principals(principal),
    event_key TEXT NOT NULL,
    idempotency_key TEXT,
    created_at REAL NOT NULL,
    within_budget INTEGER NOT NULL,
    UNIQUE (principal, idempotency_key)
);
CREATE INDEX IF NOT EXISTS gdp_charges_principal ON gdp_charges (principal, id);
CREATE TABLE IF NOT EXISTS gdp_api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
)
"""

_POSTGRES = """
CREATE TABLE IF NOT EXISTS {s}.gdp_principals (
    principal TEXT PRIMARY KEY,
    epsilon DOUBLE PRECISION NOT NULL,
    delta DOUBLE PRECISION NOT NULL,
    accountant TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.gdp_spent (
    principal TEXT NOT NULL REFERENCES {s}.gdp_principals(principal),
    event_key TEXT NOT NULL,
    count BIGINT NOT NULL CHECK (count > 0),
    PRIMARY KEY (principal, event_key)
);
CREATE TABLE IF NOT EXISTS {s}.gdp_charges (
    id BIGSERIAL PRIMARY KEY,
    principal TEXT NOT NULL REFERENCES {s}.gdp_principals(principal),
    event_key TEXT NOT NULL,
    idempotency_key TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    within_budget BOOLEAN NOT NULL,
    UNIQUE (principal, idempotency_key)
);
CREATE INDEX IF NOT EXISTS gdp_charges_principal ON {s}.gdp_charges (principal, id);
CREATE TABLE IF NOT EXISTS {s}.gdp_api_keys (
    key_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    revoked BOOLEAN NOT NULL DEFAULT FALSE
)
"""


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    ddl = _POSTGRES.replace("{s}", s) if s else _SQLITE
    for statement in ddl.split(";"):
        if statement.strip():
            op.get_bind().exec_driver_sql(statement)
    # The one-round-trip charge function of the baseline is replaced by revision 0002; it is not
    # recreated here.
