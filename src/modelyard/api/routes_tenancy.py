"""Tenants, API keys and usage: the administrative API's routes.

Each route parses its request and answers with what the tenant and key service
(`control/tenancy.py`) returns; the rules (who may do what, key ceilings, auditing) live there.
A tenant's admin key reads its own usage; the platform admin reads any tenant's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from modelyard.api.deps import get_admin, get_key_owner, get_services, get_tenant_reader
from modelyard.api.services import Services
from modelyard.control.usage import parse_time, summarize, to_csv
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError
from modelyard.protocol.management import (
    KeyCreate,
    KeyRotate,
    KeyUpdate,
    TenantCreate,
    TenantUpdate,
)
from modelyard.protocol.responses import JSONResponse
from modelyard.store import repository as repo

router = APIRouter()

# ----- tenants --------------------------------------------------------------------------------


@router.post("/v1/tenants", status_code=201)
async def create_tenant(
    body: TenantCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    view = await services.tenancy.create_tenant(principal, body)
    return JSONResponse(view, status_code=201)


@router.get("/v1/tenants")
async def list_tenants(
    principal: Principal = Depends(get_admin), services: Services = Depends(get_services)
) -> dict[str, Any]:
    return {"object": "list", "data": await services.tenancy.list_tenants(principal)}


@router.get("/v1/tenants/{tenant_id}")
async def get_tenant(
    tenant_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.tenancy.get_tenant(principal, tenant_id)


@router.patch("/v1/tenants/{tenant_id}")
async def update_tenant(
    tenant_id: str,
    body: TenantUpdate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.tenancy.update_tenant(principal, tenant_id, body)


# ----- keys -----------------------------------------------------------------------------------


@router.post("/v1/keys", status_code=201)
async def create_key(
    body: KeyCreate,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> JSONResponse:
    created = await services.tenancy.create_key(principal, body)
    return JSONResponse(created, status_code=201)


@router.get("/v1/keys")
async def list_keys(
    tenant_id: str | None = None,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    await services.auth.flush_last_used()  # this gateway's last uses, exact
    return {"object": "list", "data": await services.tenancy.list_keys(principal, tenant_id)}


@router.get("/v1/keys/{key_id}")
async def get_key(
    key_id: str,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    await services.auth.flush_last_used()
    return await services.tenancy.get_key(principal, key_id)


@router.patch("/v1/keys/{key_id}")
async def update_key(
    key_id: str,
    body: KeyUpdate,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.tenancy.update_key(principal, key_id, body)


@router.post("/v1/keys/{key_id}/rotate")
async def rotate_key(
    key_id: str,
    body: KeyRotate | None = None,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """A new secret (shown in this answer only); the old one works for the grace period."""
    return await services.tenancy.rotate_key(principal, key_id, body or KeyRotate())


@router.delete("/v1/keys/{key_id}")
async def revoke_key(
    key_id: str,
    principal: Principal = Depends(get_key_owner),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.tenancy.revoke_key(principal, key_id)


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
    group_by: str = Query("model", description="model, key, team, day or version"),
    tenant_id: str | None = Query(None, description="Platform admin only."),
    principal: Principal = Depends(get_tenant_reader),
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
    report: dict[str, Any] = {
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
                "cost_micro_usd",
            )
        },
    }
    report["totals"]["cost_usd"] = report["totals"]["cost_micro_usd"] / 1e6
    return report


@router.get(
    "/v1/usage/export",
    responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}}}},
)
async def usage_export(
    start: str | None = None,
    end: str | None = None,
    tenant_id: str | None = None,
    principal: Principal = Depends(get_tenant_reader),
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
