"""Resumable fine-tuning jobs with a validation metric: ``gdp_finetune_jobs.steps_lost`` and
``gdp_finetune_jobs.validation_loss``.

A job interrupted by a crash is re-queued and resumed from its last checkpoint (unless the operator
chose the old rule, interrupted = failed). ``steps_lost`` counts, over all attempts, the steps whose
noisy update was released (reported on the row) but not in the checkpoint the job resumed from:
they stay counted as released, and are never run again (``gaussdp.finetune.train``).
``validation_loss`` is the adapter's latest loss on the job's public validation corpus.

Revision ID: 0006
Revises: 0005
"""

from alembic import context, op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = context.config.attributes.get("gdp_schema")
    p = f"{s}." if s else ""
    exists = "IF NOT EXISTS " if s else ""
    real = "DOUBLE PRECISION" if s else "REAL"
    bind = op.get_bind()
    bind.exec_driver_sql(
        f"ALTER TABLE {p}gdp_finetune_jobs ADD COLUMN {exists}steps_lost INTEGER NOT NULL DEFAULT 0"
    )
    bind.exec_driver_sql(f"ALTER TABLE {p}gdp_finetune_jobs ADD COLUMN {exists}validation_loss {real}")
