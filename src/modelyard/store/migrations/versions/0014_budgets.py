"""prices per endpoint, budgets in dollars, their alerts, and a usage row's cost and team
(owner: h-budgets)

Revision ID: 0014
Revises: 0012
Create Date: 2026-12-05 03:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_prices",
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("input_micro", sa.BigInteger(), nullable=False),
        sa.Column("output_micro", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micro", sa.BigInteger(), nullable=True),
        sa.Column("batch_discount_bps", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("endpoint_id"),
    )
    with op.batch_alter_table("model_prices", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_model_prices_tenant_id"), ["tenant_id"], unique=False)
    op.create_table(
        "budgets",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("scope", sa.String(length=20), nullable=False),
        sa.Column("subject_id", sa.String(length=40), nullable=False),
        sa.Column("period", sa.String(length=20), nullable=False),
        sa.Column("limit_micro", sa.BigInteger(), nullable=False),
        sa.Column("soft_limit_micro", sa.BigInteger(), nullable=True),
        sa.Column("webhook_url", sa.String(length=2000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "scope", "subject_id", "period"),
    )
    with op.batch_alter_table("budgets", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_budgets_tenant_id"), ["tenant_id"], unique=False)
    op.create_table(
        "budget_alerts",
        sa.Column("budget_id", sa.String(length=40), nullable=False),
        sa.Column("period_key", sa.String(length=20), nullable=False),
        sa.Column("spent_micro", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("budget_id", "period_key"),
    )
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cost_micro", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("team_id", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_column("team_id")
        batch_op.drop_column("cost_micro")
    op.drop_table("budget_alerts")
    with op.batch_alter_table("budgets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_budgets_tenant_id"))
    op.drop_table("budgets")
    with op.batch_alter_table("model_prices", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_prices_tenant_id"))
    op.drop_table("model_prices")
