"""adapter_prices: a registry LoRA adapter's own prices, over its base endpoint's (owner: adprice)

Keyed by the adapter's registry model id (`models.id`), with its tenant; the columns of
`model_prices`.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05 03:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_prices",
        sa.Column("model_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("input_micro", sa.BigInteger(), nullable=False),
        sa.Column("output_micro", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micro", sa.BigInteger(), nullable=True),
        sa.Column("batch_discount_bps", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_id"),
    )
    with op.batch_alter_table("adapter_prices", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_adapter_prices_tenant_id"), ["tenant_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("adapter_prices", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapter_prices_tenant_id"))
    op.drop_table("adapter_prices")
