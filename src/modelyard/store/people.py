"""Queries on a tenant's users, teams, team membership and console sessions, one function per
query; every read takes the tenant explicitly (None: any tenant, for the platform admin)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from modelyard.store.people_tables import ConsoleSession, Team, TeamMember, User
from modelyard.store.repository import new_id, now
from modelyard.store.tables import ApiKey


def add_user(
    s: Session, tenant_id: str, email: str, name: str | None, role: str, subject: str | None
) -> User:
    user = User(id=new_id("usr"), tenant_id=tenant_id, email=email, name=name, role=role,
                subject=subject, created_at=now())  # fmt: skip
    s.add(user)
    s.flush()
    return user


def get_user(s: Session, tenant_id: str | None, user_id: str) -> User | None:
    user = s.get(User, user_id)
    if user is None or (tenant_id is not None and user.tenant_id != tenant_id):
        return None
    return user


def user_by_email(s: Session, tenant_id: str, email: str) -> User | None:
    return s.scalar(select(User).where(User.tenant_id == tenant_id, User.email == email))


def user_by_subject(s: Session, subject: str) -> User | None:
    return s.scalar(select(User).where(User.subject == subject))


def list_users(
    s: Session, tenant_id: str | None, limit: int, after: str | None = None
) -> Sequence[User]:
    """Users by id, from the one after `after`."""
    q = select(User).order_by(User.id).limit(limit)
    if tenant_id is not None:
        q = q.where(User.tenant_id == tenant_id)
    if after is not None:
        q = q.where(User.id > after)
    return s.scalars(q).all()


def count_users(s: Session, tenant_id: str) -> int:
    return int(s.scalar(select(func.count()).where(User.tenant_id == tenant_id)) or 0)


def delete_user(s: Session, user: User) -> None:
    """The user, their memberships and sessions; their keys are revoked and kept (usage and
    audit name them)."""
    s.execute(delete(TeamMember).where(TeamMember.user_id == user.id))
    s.execute(delete(ConsoleSession).where(ConsoleSession.user_id == user.id))
    s.execute(
        update(ApiKey)
        .where(ApiKey.owner_user_id == user.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now())
    )
    s.execute(update(ApiKey).where(ApiKey.owner_user_id == user.id).values(owner_user_id=None))
    s.delete(user)


def add_team(s: Session, tenant_id: str, name: str) -> Team:
    team = Team(id=new_id("team"), tenant_id=tenant_id, name=name, created_at=now())
    s.add(team)
    s.flush()
    return team


def get_team(s: Session, tenant_id: str | None, team_id: str) -> Team | None:
    team = s.get(Team, team_id)
    if team is None or (tenant_id is not None and team.tenant_id != tenant_id):
        return None
    return team


def list_teams(s: Session, tenant_id: str | None, limit: int) -> Sequence[Team]:
    q = select(Team).order_by(Team.created_at, Team.id).limit(limit)
    if tenant_id is not None:
        q = q.where(Team.tenant_id == tenant_id)
    return s.scalars(q).all()


def count_teams(s: Session, tenant_id: str) -> int:
    return int(s.scalar(select(func.count()).where(Team.tenant_id == tenant_id)) or 0)


def delete_team(s: Session, team: Team) -> None:
    """The team and its memberships; the team's keys are revoked and kept (usage names them)."""
    s.execute(delete(TeamMember).where(TeamMember.team_id == team.id))
    s.execute(
        update(ApiKey)
        .where(ApiKey.owner_team_id == team.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now())
    )
    s.execute(update(ApiKey).where(ApiKey.owner_team_id == team.id).values(owner_team_id=None))
    s.delete(team)


def team_members(s: Session, team_id: str) -> list[str]:
    q = select(TeamMember.user_id).where(TeamMember.team_id == team_id)
    return sorted(s.scalars(q).all())


def user_teams(s: Session, user_id: str) -> list[str]:
    q = select(TeamMember.team_id).where(TeamMember.user_id == user_id)
    return sorted(s.scalars(q).all())


def add_member(s: Session, team_id: str, user_id: str) -> bool:
    """False when the user already is a member."""
    if s.get(TeamMember, (team_id, user_id)) is not None:
        return False
    s.add(TeamMember(team_id=team_id, user_id=user_id))
    s.flush()
    return True


def remove_member(s: Session, team_id: str, user_id: str) -> bool:
    member = s.get(TeamMember, (team_id, user_id))
    if member is None:
        return False
    s.delete(member)
    return True


def add_session(s: Session, user_id: str, token_hash: str, expires_at: datetime) -> ConsoleSession:
    row = ConsoleSession(id=new_id("ses"), user_id=user_id, token_hash=token_hash,
                         created_at=now(), expires_at=expires_at)  # fmt: skip
    s.add(row)
    s.flush()
    return row


def session_by_hash(s: Session, token_hash: str) -> ConsoleSession | None:
    return s.scalar(select(ConsoleSession).where(ConsoleSession.token_hash == token_hash))


def end_session(s: Session, session_id: str) -> None:
    s.execute(delete(ConsoleSession).where(ConsoleSession.id == session_id))


def trim_sessions(s: Session, user_id: str, keep: int) -> None:
    """Keep the user's `keep` newest sessions, end the rest."""
    q = (
        select(ConsoleSession.id)
        .where(ConsoleSession.user_id == user_id)
        .order_by(ConsoleSession.created_at.desc(), ConsoleSession.id)
        .offset(keep)
    )
    old = list(s.scalars(q).all())
    if old:
        s.execute(delete(ConsoleSession).where(ConsoleSession.id.in_(old)))


def drop_expired_sessions(s: Session) -> None:
    s.execute(delete(ConsoleSession).where(ConsoleSession.expires_at < now()))
