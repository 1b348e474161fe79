"""Users, teams and team membership of a tenant, and `GET /v1/me`: the routes.

Each route parses its request and answers with what the users and teams service
(`control/people.py`) returns. Changes need the tenant's `admin`; reads need `read` (any user
of the tenant) or `admin`. `GET /v1/me` answers any valid key or console session.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from modelyard.api.deps import get_admin, get_principal, get_services, get_tenant_reader
from modelyard.api.services import Services
from modelyard.core.identity import Principal
from modelyard.protocol.people import MemberAdd, TeamCreate, UserCreate, UserUpdate
from modelyard.protocol.responses import JSONResponse

router = APIRouter()
_TENANT = Query(None, max_length=64, description="Platform admin only: whose.")


@router.get("/v1/me")
async def me(
    principal: Principal = Depends(get_principal), services: Services = Depends(get_services)
) -> dict[str, Any]:
    """The caller: its key or session, tenant, scopes, and its user and role if any."""
    return await services.people.me(principal)


@router.post("/v1/users", status_code=201)
async def create_user(
    body: UserCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    return JSONResponse(await services.people.create_user(principal, body), status_code=201)


@router.get("/v1/users")
async def list_users(
    tenant_id: str | None = _TENANT,
    after: str | None = Query(None, max_length=64, description="The last id of the page before."),
    principal: Principal = Depends(get_tenant_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    """Users by id, 1,000 a page (`has_more`: ask again with `after`, the page's last id)."""
    data, more = await services.people.list_users(principal, tenant_id, after)
    return {"object": "list", "data": data, "has_more": more}


@router.get("/v1/users/{user_id}")
async def get_user(
    user_id: str,
    principal: Principal = Depends(get_tenant_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.get_user(principal, user_id)


@router.patch("/v1/users/{user_id}")
async def update_user(
    user_id: str,
    body: UserUpdate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.update_user(principal, user_id, body)


@router.delete("/v1/users/{user_id}")
async def delete_user(
    user_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.delete_user(principal, user_id)


@router.post("/v1/teams", status_code=201)
async def create_team(
    body: TeamCreate,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> JSONResponse:
    return JSONResponse(await services.people.create_team(principal, body), status_code=201)


@router.get("/v1/teams")
async def list_teams(
    tenant_id: str | None = _TENANT,
    principal: Principal = Depends(get_tenant_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return {"object": "list", "data": await services.people.list_teams(principal, tenant_id)}


@router.get("/v1/teams/{team_id}")
async def get_team(
    team_id: str,
    principal: Principal = Depends(get_tenant_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.get_team(principal, team_id)


@router.delete("/v1/teams/{team_id}")
async def delete_team(
    team_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.delete_team(principal, team_id)


@router.post("/v1/teams/{team_id}/members")
async def add_member(
    team_id: str,
    body: MemberAdd,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.set_member(principal, team_id, body.user_id, member=True)


@router.delete("/v1/teams/{team_id}/members/{user_id}")
async def remove_member(
    team_id: str,
    user_id: str,
    principal: Principal = Depends(get_admin),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await services.people.set_member(principal, team_id, user_id, member=False)
