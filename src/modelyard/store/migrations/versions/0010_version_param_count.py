"""model_versions.param_count: the size figure recorded when a version is pushed (owner: h1)

NULL for versions pushed before this revision: the platform computes it once, off its event
loop with the bounded parser (`core/model_files.py`), and stores it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 21:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("param_count", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_column("param_count")
