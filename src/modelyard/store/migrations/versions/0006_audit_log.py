"""audit log: who changed what (endpoints, keys, tenants, registry versions), before and after

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 08:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("actor_key_id", sa.String(length=40), nullable=True),
        sa.Column("actor_tenant_id", sa.String(length=40), nullable=True),
        sa.Column("action", sa.String(length=60), nullable=False),
        sa.Column("target_type", sa.String(length=40), nullable=False),
        sa.Column("target_id", sa.String(length=300), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
    )
    op.create_index("ix_audit_tenant_at", "audit_events", ["tenant_id", "at"])
    op.create_index("ix_audit_at", "audit_events", ["at"])
    op.create_index("ix_audit_target", "audit_events", ["target_type", "target_id"])


def downgrade() -> None:
    op.drop_index("ix_audit_target", table_name="audit_events")
    op.drop_index("ix_audit_at", table_name="audit_events")
    op.drop_index("ix_audit_tenant_at", table_name="audit_events")
    op.drop_table("audit_events")
