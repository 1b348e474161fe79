"""routing entries the leading controller publishes for gateways (owner: cluster helper)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 11:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "routing_entries",
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("removed", sa.Boolean(), nullable=False),
        sa.Column("entry", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("endpoint_id"),
    )
    with op.batch_alter_table("routing_entries", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_routing_entries_generation"), ["generation"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("routing_entries", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_routing_entries_generation"))
    op.drop_table("routing_entries")
