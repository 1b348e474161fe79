"""The audit log's HTTP API: `GET /v1/audit` (JSON pages) and `GET /v1/audit.csv` (a CSV export).

An admin key reads its own tenant's events; the platform admin reads every tenant's, or one
tenant's with `?tenant_id=`. Events come newest first; `after` is the last id of the previous page.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from modelyard.api.deps import get_admin, get_services
from modelyard.api.services import Services
from modelyard.control.audit import MAX_LIMIT, AuditQuery
from modelyard.control.usage import parse_time
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError

router = APIRouter()

# An action (`endpoint.deploy`) or a target type (`api_key`): lower-case words and dots.
_NAME = re.compile(r"^[a-z][a-z_]{0,39}(\.[a-z][a-z_]{0,39})?$")
_CSV_CONTENT = {"text/csv": {"schema": {"type": "string"}}}


class AuditEventObject(BaseModel):
    id: int
    object: Literal["audit_event"]
    at: int
    tenant_id: str | None
    actor_key_id: str  # "system" when the platform itself acted (e.g. an automatic rollback)
    actor_tenant_id: str | None
    action: str
    target_type: str
    target_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class AuditEventList(BaseModel):
    object: Literal["list"]
    data: list[AuditEventObject]
    has_more: bool
    first_id: int | None
    last_id: int | None


def _name(value: str | None, param: str) -> str | None:
    if value is not None and not _NAME.match(value):
        raise APIError(400, f"{param} must look like 'endpoint.deploy' or 'api_key'", param=param)
    return value


def _query(
    principal: Principal,
    tenant_id: str | None,
    since: str | None,
    until: str | None,
    action: str | None,
    target_type: str | None,
    target_id: str | None,
    limit: int,
    after: int | None,
) -> AuditQuery:
    # A NUL in tenant_id or target_id was refused at the edge (`api/text_guard.py`).
    return AuditQuery(
        tenant_id=principal.tenant_filter(tenant_id),
        since=parse_time(since, "since"),
        until=parse_time(until, "until"),
        action=_name(action, "action"),
        target_type=_name(target_type, "target_type"),
        target_id=target_id,
        limit=limit,
        after=after,
    )


def _csv(services: Services, q: AuditQuery, max_rows: int | None) -> Response:
    rows = services.audit.iter_csv(q, max_rows=max_rows or 1_000_000)
    return StreamingResponse(
        rows,
        media_type="text/csv",
        headers={"content-disposition": 'attachment; filename="audit.csv"'},
    )


_SINCE = Query(None, description="Unix seconds or ISO 8601: events at or after it.")
_UNTIL = Query(None, description="Unix seconds or ISO 8601: events before it.")
_TENANT = Query(None, description="Platform admin only: one tenant's events.")
_AFTER = Query(
    None, ge=0, le=2**63 - 1, description="The last event id of the previous page (newest first)."
)


@router.get(
    "/v1/audit",
    response_model=None,
    responses={200: {"model": AuditEventList, "content": _CSV_CONTENT}},
)
async def list_audit(
    since: str | None = _SINCE,
    until: str | None = _UNTIL,
    action: str | None = Query(None, max_length=81, description="e.g. endpoint.rollback"),
    target_type: str | None = Query(None, max_length=81, description="e.g. endpoint, api_key"),
    target_id: str | None = Query(None, max_length=300),
    tenant_id: str | None = _TENANT,
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    after: int | None = _AFTER,
    format: Literal["json", "csv"] = Query("json", description="csv: the same as /v1/audit.csv"),
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> Any:
    """Changes to endpoints, keys, tenants and registry versions: who, what, when, before and
    after (never a secret)."""
    q = _query(principal, tenant_id, since, until, action, target_type, target_id, limit, after)
    if format == "csv":
        return _csv(services, q, limit)
    page = await services.audit.query(q)
    ids = [e["id"] for e in page.events]
    return {
        "object": "list",
        "data": page.events,
        "has_more": page.has_more,
        "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None,
    }


@router.get("/v1/audit.csv", response_model=None, responses={200: {"content": _CSV_CONTENT}})
async def export_audit(
    since: str | None = _SINCE,
    until: str | None = _UNTIL,
    action: str | None = Query(None, max_length=81),
    target_type: str | None = Query(None, max_length=81),
    target_id: str | None = Query(None, max_length=300),
    tenant_id: str | None = _TENANT,
    limit: int | None = Query(None, ge=1, le=1_000_000, description="At most this many rows."),
    after: int | None = _AFTER,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> Response:
    """The audit log as CSV (streamed, newest first; `before`/`after` as JSON text)."""
    q = _query(principal, tenant_id, since, until, action, target_type, target_id, 1, after)
    return _csv(services, q, limit)
