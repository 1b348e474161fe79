"""settlements Redis could not take, kept until reconciled (owner: h-failopen, Redis outages)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 00:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "limits_journal",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("epoch", sa.String(length=40), nullable=False),
        sa.Column("change", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("limits_journal", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_limits_journal_created_at"), ["created_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("limits_journal", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_limits_journal_created_at"))
    op.drop_table("limits_journal")
