"""Each charge records the id of the API key that made it (``gdp_charges.key_id``, NULL for
charges made before, or without a key); PostgreSQL's one-round-trip charge function writes it.

Revision ID: 0002
Revises: 0001
"""

from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_FAST_CHARGE = """
CREATE OR REPLACE FUNCTION {s}.gdp_charge_fast(
    p_principal TEXT, p_key TEXT, p_idem TEXT, p_others_md5 TEXT, p_allowed BIGINT, p_now DOUBLE PRECISION,
    p_key_id TEXT
) RETURNS TABLE (o_status TEXT, o_id BIGINT, o_created DOUBLE PRECISION, o_within BOOLEAN,
                 o_count BIGINT, o_key TEXT)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
DECLARE
    v_count BIGINT;
    v_others TEXT;
    v_id BIGINT;
BEGIN
    PERFORM 1 FROM {s}.gdp_principals p WHERE p.principal = p_principal FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::TEXT, NULL::BIGINT, NULL::DOUBLE PRECISION, NULL::BOOLEAN,
                            NULL::BIGINT, NULL::TEXT;
        RETURN;
    END IF;
    IF p_idem IS NOT NULL THEN
        RETURN QUERY SELECT 'replay'::TEXT, c.id, c.created_at, c.within_budget, NULL::BIGINT, c.event_key
            FROM {s}.gdp_charges c WHERE c.principal = p_principal AND c.idempotency_key = p_idem;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    SELECT coalesce(max(g.count) FILTER (WHERE g.event_key = p_key), 0),
           md5(coalesce(string_agg(g.event_key || ':' || g.count::TEXT, ',' ORDER BY g.event_key COLLATE "C")
                        FILTER (WHERE g.event_key <> p_key), ''))
        INTO v_count, v_others
        FROM {s}.gdp_spent g WHERE g.principal = p_principal;
    IF v_others <> p_others_md5 OR v_count + 1 > p_allowed THEN
        RETURN QUERY SELECT 'slow'::TEXT, NULL::BIGINT, NULL::DOUBLE PRECISION, NULL::BOOLEAN,
                            NULL::BIGINT, NULL::TEXT;
        RETURN;
    END IF;
    INSERT INTO {s}.gdp_spent AS g (principal, event_key, count) VALUES (p_principal, p_key, 1)
        ON CONFLICT (principal, event_key) DO UPDATE SET count = g.count + 1;
    INSERT INTO {s}.gdp_charges (principal, event_key, idempotency_key, created_at, within_budget, key_id)
        VALUES (p_principal, p_key, p_idem, p_now, TRUE, p_key_id) RETURNING id INTO v_id;
    RETURN QUERY SELECT 'ok'::TEXT, v_id, p_now, TRUE, v_count + 1, p_key;
END
$fn$
"""


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    bind = op.get_bind()
    if not s:
        bind.exec_driver_sql("ALTER TABLE gdp_charges ADD COLUMN key_id TEXT")
        return
    bind.exec_driver_sql(f"ALTER TABLE {s}.gdp_charges ADD COLUMN IF NOT EXISTS key_id TEXT")
    bind.exec_driver_sql(
        f"DROP FUNCTION IF EXISTS {s}.gdp_charge_fast(text, text, text, text, bigint, double precision)"
    )
    bind.exec_driver_sql(_FAST_CHARGE.replace("{s}", s))
