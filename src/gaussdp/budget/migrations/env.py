"""Alembic environment of the ledger's schema: run by :mod:`gaussdp.budget.schema`, never by hand.

The caller passes an open SQLAlchemy connection (``config.attributes["connection"]``) and, for
PostgreSQL, the schema holding the ledger's tables (``config.attributes["gdp_schema"]``). Every
migration runs in one transaction that first serialises concurrent upgrades: an advisory lock on
PostgreSQL, ``BEGIN IMMEDIATE`` (the database's write lock) on SQLite.
"""

from alembic import context
from sqlalchemy import text

config = context.config
connection = config.attributes["connection"]
schema = config.attributes.get("gdp_schema")

context.configure(
    connection=connection,
    version_table="gdp_schema_version",
    version_table_schema=schema,
    transactional_ddl=True,
)
with context.begin_transaction():
    if connection.dialect.name == "postgresql":
        connection.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"gaussdp-ledger-{schema}"}
        )
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
    context.run_migrations()
