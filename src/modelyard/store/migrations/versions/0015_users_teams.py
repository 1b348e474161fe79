"""users and teams: a tenant's users with roles, teams and membership, console sessions, and
the owner (a user or a team) of an API key

Revision ID: 0015
Revises: 0012
Create Date: 2026-12-05 03:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("email", sa.String(length=254), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("role", sa.String(length=20), nullable=False),
        sa.Column("subject", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "email"),
        sa.UniqueConstraint("subject"),
    )
    op.create_index("ix_users_tenant_id", "users", ["tenant_id"])
    op.create_table(
        "teams",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name"),
    )
    op.create_index("ix_teams_tenant_id", "teams", ["tenant_id"])
    op.create_table(
        "team_members",
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["team_id"], ["teams.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("team_id", "user_id"),
    )
    op.create_index("ix_team_members_user_id", "team_members", ["user_id"])
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_index("ix_console_sessions_user_id", "console_sessions", ["user_id"])
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner_user_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("owner_team_id", sa.String(length=40), nullable=True))
        batch_op.create_index("ix_api_keys_owner_user_id", ["owner_user_id"])
        batch_op.create_index("ix_api_keys_owner_team_id", ["owner_team_id"])
        batch_op.create_foreign_key("fk_api_keys_owner_user", "users", ["owner_user_id"], ["id"])
        batch_op.create_foreign_key("fk_api_keys_owner_team", "teams", ["owner_team_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint("fk_api_keys_owner_team", type_="foreignkey")
        batch_op.drop_constraint("fk_api_keys_owner_user", type_="foreignkey")
        batch_op.drop_index("ix_api_keys_owner_team_id")
        batch_op.drop_index("ix_api_keys_owner_user_id")
        batch_op.drop_column("owner_team_id")
        batch_op.drop_column("owner_user_id")
    op.drop_index("ix_console_sessions_user_id", table_name="console_sessions")
    op.drop_table("console_sessions")
    op.drop_index("ix_team_members_user_id", table_name="team_members")
    op.drop_table("team_members")
    op.drop_index("ix_teams_tenant_id", table_name="teams")
    op.drop_table("teams")
    op.drop_index("ix_users_tenant_id", table_name="users")
    op.drop_table("users")
