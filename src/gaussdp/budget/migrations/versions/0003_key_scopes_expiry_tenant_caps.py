"""API keys get scopes and an expiry (rotation sets the old key's); tenants get caps on what they
may grant their sessions (total epsilon, number of sessions).

``gdp_tenants`` keeps, beside a tenant's caps, the counters they are checked against (sessions
opened, epsilon granted), kept current by every open of one of its sessions while the row exists,
so that the check under the row's lock is O(1). Keys made before keep what they could do then:
read and release (scope ``release``), no expiry.

Revision ID: 0003
Revises: 0002
"""

from alembic import context, op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    p = f"{s}." if s else ""
    real = "DOUBLE PRECISION" if s else "REAL"
    bind = op.get_bind()
    bind.exec_driver_sql(f"ALTER TABLE {p}gdp_api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT 'release'")
    bind.exec_driver_sql(f"ALTER TABLE {p}gdp_api_keys ADD COLUMN expires_at {real}")
    bind.exec_driver_sql(
        f"CREATE TABLE {p}gdp_tenants (tenant TEXT PRIMARY KEY, max_sessions BIGINT, max_epsilon {real}, "
        f"sessions BIGINT NOT NULL DEFAULT 0, epsilon_granted {real} NOT NULL DEFAULT 0)"
    )
