"""Fine-tuning: uploaded corpora and fine-tuning jobs live in the ledger's database.

``gdp_corpora`` holds each corpus's metadata (the text itself is a file under the service's data
directory); ``gdp_finetune_jobs`` is the job queue and its state: workers claim a ``queued`` row in
one short transaction, heartbeat while they train, and write progress and the outcome to the row.
Keeping jobs beside the charges means one database, one backup and one consistency story: a job is
queued only after its charge is committed (``gaussdp.service.finetune``).

Revision ID: 0004
Revises: 0003
"""

from alembic import context, op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    p = f"{s}." if s else ""
    real = "DOUBLE PRECISION" if s else "REAL"
    bind = op.get_bind()
    bind.exec_driver_sql(
        f"CREATE TABLE {p}gdp_corpora (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, "
        f"format TEXT NOT NULL, bytes BIGINT NOT NULL, records BIGINT NOT NULL, sha256 TEXT NOT NULL, "
        f"local_dp TEXT, path TEXT NOT NULL, created_at {real} NOT NULL)"
    )
    bind.exec_driver_sql(f"CREATE INDEX gdp_corpora_tenant ON {p}gdp_corpora (tenant, created_at)")
    bind.exec_driver_sql(
        f"CREATE TABLE {p}gdp_finetune_jobs (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
        "corpus_id TEXT NOT NULL, model TEXT NOT NULL, principal TEXT NOT NULL, config TEXT NOT NULL, "
        f"event TEXT NOT NULL, epsilon {real} NOT NULL, delta {real} NOT NULL, "
        "charge_id BIGINT, state TEXT NOT NULL, step BIGINT NOT NULL DEFAULT 0, steps BIGINT NOT NULL, "
        f"epsilon_so_far {real} NOT NULL DEFAULT 0, loss {real}, error TEXT, "
        "cancel_requested INTEGER NOT NULL DEFAULT 0, worker TEXT, attempts INTEGER NOT NULL DEFAULT 0, "
        f"heartbeat_at {real}, created_at {real} NOT NULL, started_at {real}, finished_at {real}, "
        "adapter_path TEXT)"
    )
    bind.exec_driver_sql(f"CREATE INDEX gdp_finetune_jobs_state ON {p}gdp_finetune_jobs (state, created_at)")
    bind.exec_driver_sql(
        f"CREATE INDEX gdp_finetune_jobs_tenant ON {p}gdp_finetune_jobs (tenant, created_at)"
    )
