"""Tenants, API keys and usage: the administrative API.

The platform admin (an admin key of the system tenant) manages every tenant, including its tier,
quota and ceilings; a tenant's admin key manages its own keys, within those ceilings, and reads
its own usage; nothing here crosses tenants otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from sqlalchemy.exc import IntegrityError

from modelyard.api.deps import get_admin, get_services
from modelyard.api.services import Services
from modelyard.control.usage import parse_time, summarize, to_csv
from modelyard.core.identity import Principal
from modelyard.gateway.auth import generate_key
from modelyard.protocol.errors import APIError
from modelyard.protocol.management import (
    TENANT_CEILINGS,
    KeyCreate,
    KeyUpdate,
    TenantCreate,
    TenantUpdate,
)
from modelyard.protocol.responses import JSONResponse
from modelyard.store import repository as repo
from modelyard.store.tables import ApiKey, Tenant

router = APIRouter()


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
        "created_at": int(repo.as_utc(k.created_at).timestamp()),
        "revoked_at": int(repo.as_utc(k.revoked_at).timestamp()) if k.revoked_at else None,
    }


def _not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"{what} {ident!r} not found", code="not_found")


_KEY_CEILINGS = {"rpm_limit": "max_rpm", "tpm_limit": "max_tpm"}


def _within_ceiling(tenant: Tenant, field: str, value: int | None, default: bool) -> int | None:
    """A key limit checked against its tenant's ceiling: no limit (None) means the ceiling
    when `default` (a new key), else it is refused like a value above the ceiling."""
    ceiling_name = _KEY_CEILINGS[field]
    ceiling: int | None = getattr(tenant, ceiling_name)
    if ceiling is None:
        return value
    if value is None and default:
        return ceiling
    if value is None or value > ceiling:
        shown = "unlimited" if value is None else str(value)
        raise APIError(
            403,
            f"{field} {shown} is above this organization's ceiling {ceiling_name}={ceiling}; "
            "keys can only be tightened within it (the platform administrator sets ceilings).",
            param=field,
            code="above_tenant_ceiling",
        )
    return value


# ----- tenants --------------------------------------------------------------------------------


@router.post("/v1/tenants", status_code=201)
async def create_tenant(
    body: TenantCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    principal.require_platform_admin()

    def create() -> dict[str, Any]:
        ceilings = {name: getattr(body, name) for name in TENANT_CEILINGS}
        try:
            with services.db.session() as s:
                tenant = repo.create_tenant(
                    s, body.name, body.monthly_token_quota, tier=body.tier, **ceilings
                )
                return tenant_view(tenant)
        except IntegrityError as exc:
            raise APIError(409, f"tenant {body.name!r} exists", code="tenant_exists") from exc

    view = await asyncio.to_thread(create)
    await services.audit.record(
        principal, "tenant.create", "tenant", view["id"], None, view, view["id"]
    )
    return JSONResponse(view, status_code=201)


@router.get("/v1/tenants")
async def list_tenants(
    principal: Principal = Depends(get_admin), services: Services = Depends(get_services)
) -> dict[str, Any]:
    def load() -> list[dict[str, Any]]:
        with services.db.session() as s:
            tenants = repo.list_tenants(s)
            return [
                tenant_view(t)
                for t in tenants
                if principal.platform_admin or t.id == principal.tenant_id
            ]

    return {"object": "list", "data": await asyncio.to_thread(load)}


@router.get("/v1/tenants/{tenant_id}")
async def get_tenant(
    tenant_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    principal.tenant_filter(tenant_id)

    def load() -> dict[str, Any]:
        with services.db.session() as s:
            t = repo.get_tenant(s, tenant_id)
            if t is None:
                raise _not_found("tenant", tenant_id)
            return tenant_view(t)

    return await asyncio.to_thread(load)


@router.patch("/v1/tenants/{tenant_id}")
async def update_tenant(
    tenant_id: str,
    body: TenantUpdate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    principal.require_platform_admin()

    before: dict[str, Any] = {}

    def update() -> dict[str, Any]:
        with services.db.session() as s:
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
    services.auth.invalidate()
    await services.audit.record(
        principal, "tenant.update", "tenant", tenant_id, before, result, tenant_id
    )
    return result


# ----- keys -----------------------------------------------------------------------------------


@router.post("/v1/keys", status_code=201)
async def create_key(
    body: KeyCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    tenant_id = principal.tenant_id
    if body.tenant_id is not None and body.tenant_id != principal.tenant_id:
        principal.require_platform_admin()
        tenant_id = body.tenant_id
    key, key_hash, prefix = generate_key()

    def create() -> dict[str, Any]:
        with services.db.session() as s:
            tenant = repo.get_tenant(s, tenant_id)
            if tenant is None:
                raise _not_found("tenant", tenant_id)
            row = repo.add_key(
                s,
                tenant_id,
                body.name,
                key_hash,
                prefix,
                list(body.scopes),
                _within_ceiling(tenant, "rpm_limit", body.rpm_limit, default=True),
                _within_ceiling(tenant, "tpm_limit", body.tpm_limit, default=True),
            )
            return {**key_view(row), "key": key}

    created = await asyncio.to_thread(create)
    public = {k: v for k, v in created.items() if k != "key"}  # never the secret
    await services.audit.record(
        principal, "api_key.create", "api_key", public["id"], None, public, tenant_id
    )
    return JSONResponse(created, status_code=201)


@router.get("/v1/keys")
async def list_keys(
    tenant_id: str | None = None,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    scope = principal.tenant_filter(tenant_id)

    def load() -> list[dict[str, Any]]:
        with services.db.session() as s:
            return [key_view(k) for k in repo.list_keys(s, scope)]

    return {"object": "list", "data": await asyncio.to_thread(load)}


@router.get("/v1/keys/{key_id}")
async def get_key(
    key_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    def load() -> dict[str, Any]:
        with services.db.session() as s:
            k = repo.get_key(s, principal.tenant_filter(), key_id)
            if k is None:
                raise _not_found("key", key_id)
            return key_view(k)

    return await asyncio.to_thread(load)


@router.patch("/v1/keys/{key_id}")
async def update_key(
    key_id: str,
    body: KeyUpdate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    before: dict[str, Any] = {}

    def update() -> dict[str, Any]:
        with services.db.session() as s:
            k = repo.get_key(s, principal.tenant_filter(), key_id)
            if k is None:
                raise _not_found("key", key_id)
            before.update(key_view(k))
            if "name" in body.model_fields_set and body.name is not None:
                k.name = body.name
            for field in _KEY_CEILINGS:
                if field in body.model_fields_set:
                    tenant = repo.get_tenant(s, k.tenant_id)
                    assert tenant is not None
                    value = _within_ceiling(tenant, field, getattr(body, field), default=False)
                    setattr(k, field, value)
            return key_view(k)

    result = await asyncio.to_thread(update)
    services.auth.invalidate()
    await services.audit.record(
        principal, "api_key.update", "api_key", key_id, before, result, result["tenant_id"]
    )
    return result


@router.delete("/v1/keys/{key_id}")
async def revoke_key(
    key_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    before: dict[str, Any] = {}

    def revoke() -> dict[str, Any]:
        with services.db.session() as s:
            k = repo.get_key(s, principal.tenant_filter(), key_id)
            if k is None:
                raise _not_found("key", key_id)
            before.update(key_view(k))
            if k.revoked_at is None:
                k.revoked_at = repo.now()
            return key_view(k)

    result = await asyncio.to_thread(revoke)
    services.auth.invalidate()
    await services.audit.record(
        principal, "api_key.revoke", "api_key", key_id, before, result, result["tenant_id"]
    )
    return result


# ----- usage ----------------------------------------------------------------------------------


def _window(start: str | None, end: str | None) -> tuple[Any, Any]:
    now = repo.now()
    end_ts = parse_time(end, "end") or now
    start_ts = parse_time(start, "start") or end_ts.replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    if start_ts >= end_ts:
        raise APIError(400, "start must be before end", param="start")
    return start_ts, end_ts


@router.get("/v1/usage")
async def usage(
    start: str | None = Query(None, description="Unix seconds or ISO 8601 (default: month start)"),
    end: str | None = Query(None, description="Unix seconds or ISO 8601 (default: now)"),
    group_by: str = Query("model", description="model, key or day"),
    tenant_id: str | None = Query(None, description="Platform admin only."),
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    start_ts, end_ts = _window(start, end)
    scope = principal.tenant_filter(tenant_id)
    await services.recorder.flush()

    def load() -> list[Any]:
        with services.db.session() as s:
            return list(repo.usage_rows(s, scope, start_ts, end_ts))

    rows = await asyncio.to_thread(load)
    groups = summarize(rows, group_by, services.settings.prices, services.settings.batch_discount)
    return {
        "object": "usage",
        "start": int(start_ts.timestamp()),
        "end": int(end_ts.timestamp()),
        "group_by": group_by,
        "data": groups,
        "totals": {
            k: sum(g[k] for g in groups)
            for k in (
                "requests",
                "prompt_tokens",
                "completion_tokens",
                "cached_tokens",
                "total_tokens",
                "cost_usd",
            )
        },
    }


@router.get(
    "/v1/usage/export",
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}},
)
async def usage_export(
    start: str | None = None,
    end: str | None = None,
    tenant_id: str | None = None,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> Response:
    start_ts, end_ts = _window(start, end)
    scope = principal.tenant_filter(tenant_id)
    await services.recorder.flush()

    def load() -> str:
        with services.db.session() as s:
            rows = repo.usage_rows(s, scope, start_ts, end_ts)
            return to_csv(rows, services.settings.prices, services.settings.batch_discount)

    body = await asyncio.to_thread(load)
    return Response(
        body,
        media_type="text/csv",
        headers={"content-disposition": 'attachment; filename="usage.csv"'},
    )
