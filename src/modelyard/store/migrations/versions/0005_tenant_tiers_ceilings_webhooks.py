"""tenant tier, ceilings set by the platform admin, per-tenant webhook secret

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 05:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CEILINGS = (
    "max_rpm",
    "max_tpm",
    "max_concurrent_requests",
    "max_concurrent_batch_items",
    "max_endpoints",
    "max_replicas",
)


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("tier", sa.String(length=20), nullable=False, server_default="standard")
        )
        for name in _CEILINGS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("webhook_secret", sa.String(length=100), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("webhook_secret")
        for name in reversed(_CEILINGS):
            batch_op.drop_column(name)
        batch_op.drop_column("tier")
