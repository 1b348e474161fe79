"""endpoint versions, weights and SLO (owner: versions helper)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 08:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "endpoint_versions",
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("version_id", sa.String(length=40), nullable=False),
        sa.Column("artifact", sa.String(length=1000), nullable=False),
        sa.Column("role", sa.String(length=20), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("engine_options", sa.JSON(), nullable=False),
        sa.Column("slo", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("warm_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["endpoint_id"], ["endpoints.id"]),
        sa.PrimaryKeyConstraint("endpoint_id", "version_id"),
    )
    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("last_rollback", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("endpoints", schema=None) as batch_op:
        batch_op.drop_column("last_rollback")
    op.drop_table("endpoint_versions")
