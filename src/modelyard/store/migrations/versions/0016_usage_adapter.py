"""usage_records.adapter: the tenant's registry LoRA adapter a request called (owner: h-adapters)

`name:version`, beside the base endpoint that served it (`endpoint_id`, `model`); NULL for a
request to a model itself.

Revision ID: 0016
Revises: 0012
Create Date: 2026-12-05 03:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("adapter", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_column("adapter")
