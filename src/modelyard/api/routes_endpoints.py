"""Deployments: `POST /v1/models/deploy` and the `/v1/endpoints` resource."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from modelyard.api.deps import base_url, get_admin, get_platform, get_principal
from modelyard.api.responses import JSONResponse
from modelyard.api.schemas import DeployRequest
from modelyard.gateway.auth import Principal
from modelyard.platform import Platform

router = APIRouter()


@router.post("/v1/models/deploy", status_code=202)
async def deploy(
    body: DeployRequest,
    request: Request,
    principal: Principal = Depends(get_admin),
    platform: Platform = Depends(get_platform),
) -> JSONResponse:
    result = await platform.endpoints.deploy(principal, body)
    result["endpoint_url"] = f"{base_url(request)}/v1/models/{result['endpoint_id']}"
    return JSONResponse(result, status_code=202)


@router.get("/v1/endpoints")
async def list_endpoints(
    request: Request,
    principal: Principal = Depends(get_principal),
    platform: Platform = Depends(get_platform),
) -> dict[str, Any]:
    return {"object": "list", "data": platform.endpoints.list(principal, base_url(request))}


@router.get("/v1/endpoints/{endpoint_id}")
async def get_endpoint(
    endpoint_id: str,
    request: Request,
    principal: Principal = Depends(get_principal),
    platform: Platform = Depends(get_platform),
) -> dict[str, Any]:
    return platform.endpoints.get(principal, endpoint_id, base_url(request))


class EndpointUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_artifact: str = Field(min_length=1, description="Registry reference NAME[:VERSION].")


@router.patch("/v1/endpoints/{endpoint_id}", status_code=202)
async def update_endpoint(
    endpoint_id: str,
    body: EndpointUpdate,
    principal: Principal = Depends(get_admin),
    platform: Platform = Depends(get_platform),
) -> JSONResponse:
    result = await platform.endpoints.update(principal, endpoint_id, body.model_artifact)
    return JSONResponse(result, status_code=202)


@router.delete("/v1/endpoints/{endpoint_id}", status_code=202)
async def delete_endpoint(
    endpoint_id: str,
    principal: Principal = Depends(get_admin),
    platform: Platform = Depends(get_platform),
) -> JSONResponse:
    return JSONResponse(await platform.endpoints.delete(principal, endpoint_id), status_code=202)


@router.get("/v1/devices")
async def devices(
    principal: Principal = Depends(get_admin), platform: Platform = Depends(get_platform)
) -> dict[str, Any]:
    """This node's devices and what the placed replicas use of them (platform admin)."""
    principal.require_platform_admin()
    placement = platform.endpoints.replicas.placement
    return {
        "object": "list",
        "data": [
            {
                "name": d.qualified_name,
                "kind": d.kind,
                "memory_bytes": d.memory_bytes,
                "used_bytes": d.memory_bytes - placement.free_bytes(d),
                "replicas": placement.replicas_on(d),
            }
            for d in placement.devices
        ],
    }
