"""API keys: expiry, rotation's grace secret, allowed models, last use (owner: h-keys)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 03:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("allowed_models", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("previous_key_hash", sa.String(length=64), nullable=True))
        batch_op.add_column(
            sa.Column("previous_key_expires_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.create_index(
            batch_op.f("ix_api_keys_previous_key_hash"), ["previous_key_hash"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_previous_key_hash"))
        batch_op.drop_column("previous_key_expires_at")
        batch_op.drop_column("previous_key_hash")
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("allowed_models")
        batch_op.drop_column("expires_at")
