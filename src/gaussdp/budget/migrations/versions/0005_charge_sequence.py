"""Each charge carries its number within its principal (``gdp_charges.seq``), so that a charge whose
history the process already knows is one statement, checked by the database, instead of a locked
transaction that reads the history back.

``seq`` is one more than the principal's charges so far (the sum of its grouped counts). Counts only
grow, so a process whose cached history has that total holds the current history, and its decision,
made outside any lock on that history, is the one a lock would have made. Rows without ``seq``
(charges written before this revision) count through ``gdp_spent`` as before.

- SQLite: a ``BEFORE INSERT`` trigger aborts an insert whose ``seq`` is not one past the grouped
  counts (``gdp_stale_history``), an ``AFTER INSERT`` trigger adds the charge to ``gdp_spent``; the
  insert and both triggers run under the database's write lock.
- PostgreSQL: ``gdp_charge_next`` takes the principal's transaction-level advisory lock (a
  lock-manager lock, no row written; the general charge takes the same lock before its row lock,
  so charges of a principal never interleave and never deadlock), then the key-share lock the
  charge's foreign key takes anyway (so that a general charge of an earlier gaussdp, which only
  locks the row, is waited for and then seen), reads the total, and writes the charge and its
  grouped count only if the total is ``seq - 1``; an idempotency key used before writes nothing
  (``ON CONFLICT DO NOTHING``). It answers the charge's id, or NULL. ``gdp_charge_fast``
  (revision 0002) is no longer called by this gaussdp; it stays for processes of an earlier one
  still running while the database is upgraded.

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

_POSTGRES = [
    "ALTER TABLE {s}.gdp_charges ADD COLUMN IF NOT EXISTS seq BIGINT",
    """CREATE OR REPLACE FUNCTION {s}.gdp_charge_next(
    p_principal TEXT, p_key TEXT, p_idem TEXT, p_seq BIGINT, p_now DOUBLE PRECISION, p_key_id TEXT
) RETURNS BIGINT LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_id BIGINT;
BEGIN
    -- the principal's charges queue here (a lock-manager lock: no row is written); the general
    -- charge's transaction takes the same lock first: no two charges of a principal interleave
    PERFORM pg_advisory_xact_lock(1868720741, hashtext(p_principal));
    -- the lock the charge's foreign key takes anyway, taken before the history is read: a general
    -- charge of an earlier gaussdp (row lock only) in flight is waited for, and then seen
    PERFORM 1 FROM {s}.gdp_principals p WHERE p.principal = p_principal FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF (SELECT coalesce(sum(g.count), 0) FROM {s}.gdp_spent g WHERE g.principal = p_principal) + 1
            <> p_seq THEN
        RETURN NULL;  -- the history moved since the caller saw it
    END IF;
    INSERT INTO {s}.gdp_charges
        (principal, event_key, idempotency_key, created_at, within_budget, key_id, seq)
        VALUES (p_principal, p_key, p_idem, p_now, TRUE, p_key_id, p_seq)
        ON CONFLICT DO NOTHING RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        RETURN NULL;  -- the idempotency key was used before
    END IF;
    INSERT INTO {s}.gdp_spent AS g (principal, event_key, count) VALUES (p_principal, p_key, 1)
        ON CONFLICT (principal, event_key) DO UPDATE SET count = g.count + 1;
    RETURN v_id;
END
$fn$""",
]


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    bind = op.get_bind()
    for statement in [x.replace("{s}", s) for x in _POSTGRES] if s else _SQLITE:
        bind.exec_driver_sql(statement)
