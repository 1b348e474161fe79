"""A tenant's users (with roles) and teams: create, read, change and delete them, each change
audited.

A tenant admin (or the platform admin, naming the tenant) manages them; any user of the tenant
with `read` (and a plain admin key) reads them. Deleting a user or a team revokes the keys it
owned and ends the user's console sessions; the keys' rows stay, for usage and audit. A role
change takes effect on the next request (the authenticator's cache is told).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from modelyard.control.audit import AuditAction, AuditLog, AuditTarget
from modelyard.core.errors import Conflict, Forbidden, NotFound
from modelyard.core.identity import Principal
from modelyard.protocol.people import MAX_TEAMS, MAX_USERS, TeamCreate, UserCreate, UserUpdate
from modelyard.store import people as repo
from modelyard.store import repository as base_repo
from modelyard.store.db import Database
from modelyard.store.people_tables import Team, User

LIST_LIMIT = 1000
T = TypeVar("T")


def user_view(u: User, teams: list[str]) -> dict[str, Any]:
    return {
        "id": u.id,
        "object": "user",
        "tenant_id": u.tenant_id,
        "email": u.email,
        "name": u.name,
        "role": u.role,
        "sso": u.subject is not None,
        "teams": teams,
        "created_at": int(base_repo.as_utc(u.created_at).timestamp()),
    }


def team_view(t: Team, members: list[str]) -> dict[str, Any]:
    return {
        "id": t.id,
        "object": "team",
        "tenant_id": t.tenant_id,
        "name": t.name,
        "members": members,
        "created_at": int(base_repo.as_utc(t.created_at).timestamp()),
    }


def _not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what} {ident!r} not found", code="not_found")


def _target_tenant(principal: Principal, requested: str | None) -> str:
    if requested is not None and requested != principal.tenant_id:
        principal.require_platform_admin()
        return requested
    return principal.tenant_id


class People:
    """The users and teams service. `keys_changed` is told after a change that alters what a
    key or session may do."""

    def __init__(self, db: Database, audit: AuditLog, keys_changed: Callable[[], None]) -> None:
        self.db = db
        self.audit = audit
        self.keys_changed = keys_changed

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(fn)

    # ----- users ------------------------------------------------------------------------------

    async def create_user(self, principal: Principal, body: UserCreate) -> dict[str, Any]:
        tenant_id = _target_tenant(principal, body.tenant_id)

        def create() -> dict[str, Any]:
            try:
                with self.db.session() as s:
                    if base_repo.get_tenant(s, tenant_id) is None:
                        raise _not_found("tenant", tenant_id)
                    if repo.count_users(s, tenant_id) >= MAX_USERS:
                        raise Forbidden(f"a tenant holds at most {MAX_USERS} users",
                                        code="too_many_users")  # fmt: skip
                    user = repo.add_user(s, tenant_id, body.email, body.name, body.role, None)
                    return user_view(user, [])
            except IntegrityError as exc:
                raise Conflict(f"user {body.email!r} exists", code="user_exists") from exc

        view: dict[str, Any] = await self._run(create)
        await self.audit.record(principal, AuditAction.USER_CREATE, AuditTarget.USER,
                                view["id"], None, view, tenant_id)  # fmt: skip
        return view

    async def list_users(
        self, principal: Principal, tenant_id: str | None, after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of users (by id, after `after`), and whether more follow."""
        scope = principal.tenant_filter(tenant_id)

        def load() -> tuple[list[dict[str, Any]], bool]:
            with self.db.session() as s:
                users = repo.list_users(s, scope, LIST_LIMIT + 1, after)
                page = [user_view(u, repo.user_teams(s, u.id)) for u in users[:LIST_LIMIT]]
                return page, len(users) > LIST_LIMIT

        result: tuple[list[dict[str, Any]], bool] = await self._run(load)
        return result

    async def get_user(self, principal: Principal, user_id: str) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            with self.db.session() as s:
                u = repo.get_user(s, principal.tenant_filter(), user_id)
                if u is None:
                    raise _not_found("user", user_id)
                return user_view(u, repo.user_teams(s, u.id))

        result: dict[str, Any] = await self._run(load)
        return result

    async def update_user(
        self, principal: Principal, user_id: str, body: UserUpdate
    ) -> dict[str, Any]:
        before: dict[str, Any] = {}

        def update() -> dict[str, Any]:
            with self.db.session() as s:
                u = repo.get_user(s, principal.tenant_filter(), user_id)
                if u is None:
                    raise _not_found("user", user_id)
                teams = repo.user_teams(s, u.id)
                before.update(user_view(u, teams))
                if body.name is not None:
                    u.name = body.name
                if body.role is not None:
                    u.role = body.role
                return user_view(u, teams)

        result: dict[str, Any] = await self._run(update)
        self.keys_changed()
        await self.audit.record(principal, AuditAction.USER_UPDATE, AuditTarget.USER, user_id,
                                before, result, result["tenant_id"])  # fmt: skip
        return result

    async def delete_user(self, principal: Principal, user_id: str) -> dict[str, Any]:
        def delete(s: Session) -> dict[str, Any]:
            u = repo.get_user(s, principal.tenant_filter(), user_id)
            if u is None:
                raise _not_found("user", user_id)
            view = user_view(u, repo.user_teams(s, u.id))
            repo.delete_user(s, u)
            return view

        return await self._delete(principal, AuditTarget.USER, user_id, delete)

    async def _delete(
        self,
        principal: Principal,
        target: AuditTarget,
        object_id: str,
        delete: Callable[[Session], dict[str, Any]],
    ) -> dict[str, Any]:
        """Run `delete` (which answers the deleted object's view) in one transaction, drop the
        authenticator's cache (the object's keys are revoked) and audit it."""

        def run() -> dict[str, Any]:
            with self.db.session() as s:
                return delete(s)

        before = await self._run(run)
        self.keys_changed()
        action = AuditAction.USER_DELETE if target is AuditTarget.USER else AuditAction.TEAM_DELETE
        await self.audit.record(principal, action, target, object_id, before, None,
                                before["tenant_id"])  # fmt: skip
        return {"id": object_id, "object": target.value, "deleted": True}

    # ----- teams ------------------------------------------------------------------------------

    async def create_team(self, principal: Principal, body: TeamCreate) -> dict[str, Any]:
        tenant_id = _target_tenant(principal, body.tenant_id)

        def create() -> dict[str, Any]:
            try:
                with self.db.session() as s:
                    if base_repo.get_tenant(s, tenant_id) is None:
                        raise _not_found("tenant", tenant_id)
                    if repo.count_teams(s, tenant_id) >= MAX_TEAMS:
                        raise Forbidden(f"a tenant holds at most {MAX_TEAMS} teams",
                                        code="too_many_teams")  # fmt: skip
                    return team_view(repo.add_team(s, tenant_id, body.name), [])
            except IntegrityError as exc:
                raise Conflict(f"team {body.name!r} exists", code="team_exists") from exc

        view: dict[str, Any] = await self._run(create)
        await self.audit.record(principal, AuditAction.TEAM_CREATE, AuditTarget.TEAM,
                                view["id"], None, view, tenant_id)  # fmt: skip
        return view

    async def list_teams(self, principal: Principal, tenant_id: str | None) -> list[dict[str, Any]]:
        scope = principal.tenant_filter(tenant_id)

        def load() -> list[dict[str, Any]]:
            with self.db.session() as s:
                teams = repo.list_teams(s, scope, LIST_LIMIT)
                return [team_view(t, repo.team_members(s, t.id)) for t in teams]

        result: list[dict[str, Any]] = await self._run(load)
        return result

    async def get_team(self, principal: Principal, team_id: str) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            with self.db.session() as s:
                t = repo.get_team(s, principal.tenant_filter(), team_id)
                if t is None:
                    raise _not_found("team", team_id)
                return team_view(t, repo.team_members(s, t.id))

        result: dict[str, Any] = await self._run(load)
        return result

    async def delete_team(self, principal: Principal, team_id: str) -> dict[str, Any]:
        def delete(s: Session) -> dict[str, Any]:
            t = repo.get_team(s, principal.tenant_filter(), team_id)
            if t is None:
                raise _not_found("team", team_id)
            view = team_view(t, repo.team_members(s, t.id))
            repo.delete_team(s, t)
            return view

        return await self._delete(principal, AuditTarget.TEAM, team_id, delete)

    async def set_member(
        self, principal: Principal, team_id: str, user_id: str, member: bool
    ) -> dict[str, Any]:
        """Add (`member`) or remove a user of the team's tenant; done twice, it changes nothing
        the second time (and records nothing)."""

        def change() -> tuple[dict[str, Any], bool]:
            with self.db.session() as s:
                t = repo.get_team(s, principal.tenant_filter(), team_id)
                if t is None:
                    raise _not_found("team", team_id)
                if repo.get_user(s, t.tenant_id, user_id) is None:
                    raise _not_found("user", user_id)
                if member:
                    changed = repo.add_member(s, team_id, user_id)
                else:
                    changed = repo.remove_member(s, team_id, user_id)
                s.flush()
                return team_view(t, repo.team_members(s, t.id)), changed

        view, changed = await self._run(change)
        if changed:
            action = AuditAction.TEAM_MEMBER_ADD if member else AuditAction.TEAM_MEMBER_REMOVE
            await self.audit.record(principal, action, AuditTarget.TEAM, team_id, None,
                                    {"user_id": user_id}, view["tenant_id"])  # fmt: skip
        return view

    async def me(self, principal: Principal) -> dict[str, Any]:
        """Who the caller is: the key or session, its tenant, the user and role if any."""
        user = await self.get_user(principal, principal.user_id) if principal.user_id else None
        return {
            "object": "caller",
            "key_id": principal.key_id,
            "tenant_id": principal.tenant_id,
            "tenant_name": principal.tenant_name,
            "scopes": sorted(principal.scopes),
            "role": principal.role,
            "user": user,
            "team_id": principal.team_id,
            "platform_admin": principal.platform_admin,
        }
