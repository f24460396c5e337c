"""SQLite: each charge carries its number within its principal (``gdp_charges.seq``), and the
database itself checks and counts it, so that a charge whose history the process already knows is
one ``INSERT`` (one statement, one implicit transaction) instead of five statements.

``seq`` must be one more than the principal's charges so far (the sum of its grouped counts): a
``BEFORE INSERT`` trigger aborts the insert otherwise (``gdp_stale_history``), and an ``AFTER INSERT``
trigger adds the charge to its grouped count in ``gdp_spent``. Counts only grow, so a process whose
cached history has that total holds the current history: its decision, made outside the lock on that
history, is the one the lock would have made. Rows without ``seq`` (charges written before this
revision) fire neither trigger. PostgreSQL keeps its one-round-trip function (revision 0002): this
revision changes nothing there.

Revision ID: 0005
Revises: 0004
"""

from alembic import context, op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_SQLITE = [
    "ALTER TABLE gdp_charges ADD COLUMN seq INTEGER",
    """CREATE TRIGGER gdp_charges_seq_check BEFORE INSERT ON gdp_charges WHEN NEW.seq IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'gdp_stale_history') WHERE NEW.seq <> 1 + (
        SELECT coalesce(sum(count), 0) FROM gdp_spent WHERE principal = NEW.principal);
END""",
    """CREATE TRIGGER gdp_charges_count AFTER INSERT ON gdp_charges WHEN NEW.seq IS NOT NULL
BEGIN
    INSERT INTO gdp_spent (principal, event_key, count) VALUES (NEW.principal, NEW.event_key, 1)
        ON CONFLICT (principal, event_key) DO UPDATE SET count = count + 1;
END""",
]


def upgrade() -> None:
    if context.config.attributes.get("gdp_schema"):  # PostgreSQL: nothing changes
        return
    bind = op.get_bind()
    for statement in _SQLITE:
        bind.exec_driver_sql(statement)
