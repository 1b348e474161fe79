"""Tenants and their API keys: create, read, change, rotate and revoke them, each change audited.

The platform admin (an admin key of the system tenant) manages every tenant, including its tier,
quota and ceilings; a tenant's admin key manages its own keys, within those ceilings; nothing
here crosses tenants otherwise. A key may belong to a user or a team of its tenant
(`owner_user_id`, `owner_team_id`); a caller with `own_keys` but not `admin` (a developer)
sees and manages only keys it owns, and makes them within its role. The routes
(`api/routes_tenancy.py`) only parse and answer; the rules live here and fail with domain
errors (`core/errors.py`). The database work runs on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError

from modelyard.control.audit import AuditAction, AuditLog
from modelyard.core.errors import Conflict, Forbidden, Invalid, NotFound
from modelyard.core.identity import Principal
from modelyard.core.roles import ROLE_SCOPES
from modelyard.protocol.management import (
    TENANT_CEILINGS,
    KeyCreate,
    KeyRotate,
    KeyUpdate,
    TenantCreate,
    TenantUpdate,
)
from modelyard.store import people
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import ApiKey, Tenant

# A new key: (the key itself, its stored hash, a displayable prefix) (`gateway.auth`).
NewKey = Callable[[], tuple[str, str, str]]
# A key limit -> the tenant ceiling that bounds it.
KEY_CEILINGS = {"rpm_limit": "max_rpm", "tpm_limit": "max_tpm"}


def tenant_view(t: Tenant) -> dict[str, Any]:
    return {
        "id": t.id,
        "object": "tenant",
        "name": t.name,
        "monthly_token_quota": t.monthly_token_quota,
        "tier": t.tier,
        **{name: getattr(t, name) for name in TENANT_CEILINGS},
        "system": t.is_system,
        "created_at": int(repo.as_utc(t.created_at).timestamp()),
    }


def _unix(ts: datetime | None) -> int | None:
    return None if ts is None else int(repo.as_utc(ts).timestamp())


def key_view(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "object": "api_key",
        "name": k.name,
        "tenant_id": k.tenant_id,
        "prefix": k.prefix,
        "scopes": k.scopes.split(","),
        "rpm_limit": k.rpm_limit,
        "tpm_limit": k.tpm_limit,
        "owner_user_id": k.owner_user_id,
        "owner_team_id": k.owner_team_id,
        "created_at": int(repo.as_utc(k.created_at).timestamp()),
        "revoked_at": int(repo.as_utc(k.revoked_at).timestamp()) if k.revoked_at else None,
        "expires_at": _unix(k.expires_at),
        "allowed_models": list(k.allowed_models) if k.allowed_models is not None else None,
        "last_used_at": _unix(k.last_used_at),
        # Until when the secret the last rotation replaced still works (None: none does).
        "previous_key_expires_at": _unix(k.previous_key_expires_at),
    }


# What a key change is recorded as, by the fields it touched (others: `api_key.update`).
_KEY_CHANGE_ACTIONS = {
    "expires_at": AuditAction.KEY_EXPIRY_CHANGE,
    "allowed_models": AuditAction.KEY_MODELS_CHANGE,
}


def _not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what} {ident!r} not found", code="not_found")


def within_ceiling(tenant: Tenant, field: str, value: int | None, default: bool) -> int | None:
    """A key limit checked against its tenant's ceiling: no limit (None) means the ceiling
    when `default` (a new key), else it is refused like a value above the ceiling."""
    ceiling_name = KEY_CEILINGS[field]
    ceiling: int | None = getattr(tenant, ceiling_name)
    if ceiling is None:
        return value
    if value is None and default:
        return ceiling
    if value is None or value > ceiling:
        shown = "unlimited" if value is None else str(value)
        raise Forbidden(
            f"{field} {shown} is above this organization's ceiling {ceiling_name}={ceiling}; "
            "keys can only be tightened within it (the platform administrator sets ceilings).",
            param=field,
            code="above_tenant_ceiling",
        )
    return value


def _own_key_body(principal: Principal, body: KeyCreate) -> KeyCreate:
    """A key a non-admin makes for itself: owned by it, within its role's scopes."""
    if principal.user_id is None or principal.role is None:
        raise Forbidden("Only a tenant admin can make keys.", code="insufficient_scope")
    if body.owner_team_id is not None or body.owner_user_id not in (None, principal.user_id):
        raise Forbidden("You can make keys for yourself only.", param="owner_user_id",
                        code="insufficient_scope")  # fmt: skip
    above = set(body.scopes) - ROLE_SCOPES[principal.role]
    if above:
        raise Forbidden(f"scopes {sorted(above)} are above your role {principal.role}",
                        param="scopes", code="insufficient_scope")  # fmt: skip
    return body.model_copy(update={"owner_user_id": principal.user_id})


def _check_owner(s: Any, tenant_id: str, body: KeyCreate) -> None:
    """The key's owner is a user or team of the key's tenant."""
    if body.owner_user_id is not None and people.get_user(s, tenant_id, body.owner_user_id) is None:
        raise _not_found("user", body.owner_user_id)
    if body.owner_team_id is not None and people.get_team(s, tenant_id, body.owner_team_id) is None:
        raise _not_found("team", body.owner_team_id)


def _visible(principal: Principal, k: ApiKey | None) -> ApiKey | None:
    """`k` if the caller manages it: any key of its tenant (admin), else its own."""
    if k is None or "admin" in principal.scopes:
        return k
    return k if principal.user_id is not None and k.owner_user_id == principal.user_id else None


class Tenancy:
    """The tenant and key service. `keys_changed` is told after any change that alters what a
    key may do (the authenticator's cache); `new_key` makes a key."""

    def __init__(
        self, db: Database, audit: AuditLog, keys_changed: Callable[[], None], new_key: NewKey
    ) -> None:
        self.db = db
        self.audit = audit
        self.keys_changed = keys_changed
        self.new_key = new_key

    # ----- tenants ----------------------------------------------------------------------------

    async def create_tenant(self, principal: Principal, body: TenantCreate) -> dict[str, Any]:
        principal.require_platform_admin()

        def create() -> dict[str, Any]:
            ceilings = {name: getattr(body, name) for name in TENANT_CEILINGS}
            try:
                with self.db.session() as s:
                    tenant = repo.create_tenant(
                        s, body.name, body.monthly_token_quota, tier=body.tier, **ceilings
                    )
                    return tenant_view(tenant)
            except IntegrityError as exc:
                raise Conflict(f"tenant {body.name!r} exists", code="tenant_exists") from exc

        view = await asyncio.to_thread(create)
        await self.audit.record(
            principal, "tenant.create", "tenant", view["id"], None, view, view["id"]
        )
        return view

    async def list_tenants(self, principal: Principal) -> list[dict[str, Any]]:
        def load() -> list[dict[str, Any]]:
            with self.db.session() as s:
                tenants = repo.list_tenants(s)
                return [
                    tenant_view(t)
                    for t in tenants
                    if principal.platform_admin or t.id == principal.tenant_id
                ]

        return await asyncio.to_thread(load)

    async def get_tenant(self, principal: Principal, tenant_id: str) -> dict[str, Any]:
        principal.tenant_filter(tenant_id)

        def load() -> dict[str, Any]:
            with self.db.session() as s:
                t = repo.get_tenant(s, tenant_id)
                if t is None:
                    raise _not_found("tenant", tenant_id)
                return tenant_view(t)

        return await asyncio.to_thread(load)

    async def update_tenant(
        self, principal: Principal, tenant_id: str, body: TenantUpdate
    ) -> dict[str, Any]:
        principal.require_platform_admin()
        before: dict[str, Any] = {}

        def update() -> dict[str, Any]:
            with self.db.session() as s:
                t = repo.get_tenant(s, tenant_id)
                if t is None:
                    raise _not_found("tenant", tenant_id)
                before.update(tenant_view(t))
                for name in ("monthly_token_quota", *TENANT_CEILINGS):
                    if name in body.model_fields_set:
                        setattr(t, name, getattr(body, name))
                if body.tier is not None:
                    t.tier = body.tier
                return tenant_view(t)

        result = await asyncio.to_thread(update)
        self.keys_changed()
        await self.audit.record(
            principal, "tenant.update", "tenant", tenant_id, before, result, tenant_id
        )
        return result

    # ----- keys -------------------------------------------------------------------------------

    async def create_key(self, principal: Principal, body: KeyCreate) -> dict[str, Any]:
        """The new key's view with the key itself under `key` (shown this once, never stored
        or audited)."""
        tenant_id = principal.tenant_id
        if body.tenant_id is not None and body.tenant_id != principal.tenant_id:
            principal.require_platform_admin()
            tenant_id = body.tenant_id
        if "admin" not in principal.scopes:
            body = _own_key_body(principal, body)
        key, key_hash, prefix = self.new_key()
        if body.expires_at is not None and body.expires_at <= repo.now():
            raise Invalid("expires_at is in the past", param="expires_at", code="invalid_value")

        def create() -> dict[str, Any]:
            with self.db.session() as s:
                tenant = repo.get_tenant(s, tenant_id)
                if tenant is None:
                    raise _not_found("tenant", tenant_id)
                _check_owner(s, tenant_id, body)
                row = repo.add_key(
                    s,
                    tenant_id,
                    body.name,
                    key_hash,
                    prefix,
                    list(body.scopes),
                    within_ceiling(tenant, "rpm_limit", body.rpm_limit, default=True),
                    within_ceiling(tenant, "tpm_limit", body.tpm_limit, default=True),
                    expires_at=body.expires_at,
                    allowed_models=body.allowed_models,
                )
                row.owner_user_id, row.owner_team_id = body.owner_user_id, body.owner_team_id
                s.flush()
                return {**key_view(row), "key": key}

        created = await asyncio.to_thread(create)
        public = {k: v for k, v in created.items() if k != "key"}  # never the secret
        await self.audit.record(
            principal, "api_key.create", "api_key", public["id"], None, public, tenant_id
        )
        return created

    async def list_keys(self, principal: Principal, tenant_id: str | None) -> list[dict[str, Any]]:
        scope = principal.tenant_filter(tenant_id)

        def load() -> list[dict[str, Any]]:
            with self.db.session() as s:
                return [key_view(k) for k in repo.list_keys(s, scope) if _visible(principal, k)]

        return await asyncio.to_thread(load)

    async def get_key(self, principal: Principal, key_id: str) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            with self.db.session() as s:
                k = _visible(principal, repo.get_key(s, principal.tenant_filter(), key_id))
                if k is None:
                    raise _not_found("key", key_id)
                return key_view(k)

        return await asyncio.to_thread(load)

    async def update_key(
        self, principal: Principal, key_id: str, body: KeyUpdate
    ) -> dict[str, Any]:
        before: dict[str, Any] = {}
        changed = body.model_fields_set

        def update() -> dict[str, Any]:
            with self.db.session() as s:
                k = _visible(principal, repo.get_key(s, principal.tenant_filter(), key_id))
                if k is None:
                    raise _not_found("key", key_id)
                before.update(key_view(k))
                if "name" in changed and body.name is not None:
                    k.name = body.name
                for field in KEY_CEILINGS:
                    if field in changed:
                        tenant = repo.get_tenant(s, k.tenant_id)
                        assert tenant is not None
                        value = within_ceiling(tenant, field, getattr(body, field), default=False)
                        setattr(k, field, value)
                if "expires_at" in changed:
                    k.expires_at = body.expires_at
                if "allowed_models" in changed:
                    k.allowed_models = body.allowed_models
                return key_view(k)

        result = await asyncio.to_thread(update)
        self.keys_changed()
        actions = {_KEY_CHANGE_ACTIONS.get(f, AuditAction.KEY_UPDATE) for f in changed}
        for action in sorted(actions or {AuditAction.KEY_UPDATE}):
            await self.audit.record(
                principal, action, "api_key", key_id, before, result, result["tenant_id"]
            )
        return result

    async def rotate_key(
        self, principal: Principal, key_id: str, body: KeyRotate
    ) -> dict[str, Any]:
        """A new secret for the key (under `key`, shown this once); the one it replaces keeps
        working for `grace_period_seconds`, and one replaced earlier stops at once."""
        before: dict[str, Any] = {}
        key, key_hash, prefix = self.new_key()

        def rotate() -> dict[str, Any]:
            with self.db.session() as s:
                k = _visible(principal, repo.get_key(s, principal.tenant_filter(), key_id))
                if k is None:
                    raise _not_found("key", key_id)
                if k.revoked_at is not None:
                    raise Conflict(f"key {key_id!r} is revoked", code="key_revoked")
                before.update(key_view(k))
                k.previous_key_hash = k.key_hash
                k.previous_key_expires_at = repo.now() + timedelta(
                    seconds=body.grace_period_seconds
                )
                k.key_hash, k.prefix = key_hash, prefix
                return {**key_view(k), "key": key}

        rotated = await asyncio.to_thread(rotate)
        self.keys_changed()
        public = {k: v for k, v in rotated.items() if k != "key"}  # never the secret
        await self.audit.record(
            principal, AuditAction.KEY_ROTATE, "api_key", key_id, before, public,
            public["tenant_id"],
        )  # fmt: skip
        return rotated

    async def revoke_key(self, principal: Principal, key_id: str) -> dict[str, Any]:
        before: dict[str, Any] = {}

        def revoke() -> dict[str, Any]:
            with self.db.session() as s:
                k = _visible(principal, repo.get_key(s, principal.tenant_filter(), key_id))
                if k is None:
                    raise _not_found("key", key_id)
                before.update(key_view(k))
                if k.revoked_at is None:
                    k.revoked_at = repo.now()
                return key_view(k)

        result = await asyncio.to_thread(revoke)
        self.keys_changed()
        await self.audit.record(
            principal, "api_key.revoke", "api_key", key_id, before, result, result["tenant_id"]
        )
        return result
