"""Deployments: `POST /v1/models/deploy` and the `/v1/endpoints` resource."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from modelyard.api.deps import base_url, get_admin, get_deployer, get_reader, get_services
from modelyard.api.routes_versions import router as versions_router
from modelyard.api.services import Services
from modelyard.control.audit import endpoint_snapshot
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError
from modelyard.protocol.management import (
    ARTIFACT_MAX,
    DeployRequest,
    SamplingDefaults,
    Scaling,
)
from modelyard.protocol.responses import JSONResponse
from modelyard.store import repository as repo

router = APIRouter()

# One deploy at a time per tenant in this process, so that two concurrent deploys cannot both
# pass the ceiling check.
_deploying: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)


def _check_ceilings(services: Services, tenant_id: str, replicas: int) -> None:
    """Refuse a deploy that would take the tenant past its max_endpoints or max_replicas."""
    with services.db.session() as s:
        tenant = repo.get_tenant(s, tenant_id)
        if tenant is None or (tenant.max_endpoints is None and tenant.max_replicas is None):
            return
        endpoints, held = repo.deployed_capacity(s, tenant_id)
        if tenant.max_endpoints is not None and endpoints + 1 > tenant.max_endpoints:
            raise APIError(
                403,
                f"This organization has {endpoints} live endpoints, at its ceiling "
                f"max_endpoints={tenant.max_endpoints}; delete one or ask the platform "
                "administrator to raise the ceiling.",
                code="tenant_ceiling_reached",
            )
        if tenant.max_replicas is not None and held + replicas > tenant.max_replicas:
            raise APIError(
                403,
                f"hardware.max_replicas {replicas} with the {held} replicas this organization's "
                f"endpoints may already scale to exceeds its ceiling "
                f"max_replicas={tenant.max_replicas}.",
                param="hardware.max_replicas",
                code="tenant_ceiling_reached",
            )


@router.post("/v1/models/deploy", status_code=202)
async def deploy(
    body: DeployRequest,
    request: Request,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    async with _deploying[principal.tenant_id]:
        await asyncio.to_thread(
            _check_ceilings, services, principal.tenant_id, body.hardware.max_replicas
        )
        result = await services.endpoints.deploy(principal, body)
    after = endpoint_snapshot(services.endpoints, result["endpoint_id"])
    await services.audit.record_endpoint(
        principal, "endpoint.deploy", result["endpoint_id"], None, after
    )
    result["endpoint_url"] = f"{base_url(request)}/v1/models/{result['endpoint_id']}"
    return JSONResponse(result, status_code=202)


@router.get("/v1/endpoints")
async def list_endpoints(
    request: Request,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return {"object": "list", "data": services.endpoints.list(principal, base_url(request))}


@router.get("/v1/endpoints/{endpoint_id}")
async def get_endpoint(
    endpoint_id: str,
    request: Request,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return services.endpoints.get(principal, endpoint_id, base_url(request))


class EndpointUpdate(BaseModel):
    """A rollout to another version, and/or new sampling defaults or scaling (no rollout)."""

    model_config = ConfigDict(extra="forbid")

    model_artifact: str | None = Field(
        None,
        min_length=1,
        max_length=ARTIFACT_MAX,
        description="Registry reference NAME[:VERSION]: a rollout.",
    )
    sampling_defaults: SamplingDefaults | None = None
    scaling: Scaling | None = None

    @model_validator(mode="after")
    def _something(self) -> EndpointUpdate:
        if self.model_artifact is None and self.sampling_defaults is None and self.scaling is None:
            raise ValueError("give model_artifact, sampling_defaults or scaling")
        return self


@router.patch("/v1/endpoints/{endpoint_id}", status_code=202)
async def update_endpoint(
    endpoint_id: str,
    body: EndpointUpdate,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    before = endpoint_snapshot(services.endpoints, endpoint_id)
    if body.sampling_defaults is not None or body.scaling is not None:
        await services.versions.reconfigure(
            principal, endpoint_id, body.sampling_defaults, body.scaling
        )
        result: dict[str, Any] = {"endpoint_id": endpoint_id}
    if body.model_artifact is not None:
        result = await services.versions.update(principal, endpoint_id, body.model_artifact)
    else:
        state = services.endpoints.endpoints[endpoint_id]
        result["status"] = state.status
    after = endpoint_snapshot(services.endpoints, endpoint_id)
    action = "endpoint.rollout" if body.model_artifact is not None else "endpoint.update"
    await services.audit.record_endpoint(principal, action, endpoint_id, before, after)
    return JSONResponse(result, status_code=202)


@router.delete("/v1/endpoints/{endpoint_id}", status_code=202)
async def delete_endpoint(
    endpoint_id: str,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    before = endpoint_snapshot(services.endpoints, endpoint_id)
    result = await services.endpoints.delete(principal, endpoint_id)
    await services.audit.record_endpoint(principal, "endpoint.delete", endpoint_id, before, None)
    return JSONResponse(result, status_code=202)


@router.get("/v1/devices")
async def devices(
    principal: Principal = Depends(get_admin), services: Services = Depends(get_services)
) -> dict[str, Any]:
    """This node's devices and what the placed replicas use of them (platform admin)."""
    principal.require_platform_admin()
    placement = services.endpoints.replicas.placement
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


# Canaries, traffic, promote and rollback (`routes_versions.py`) under the same resource.
router.include_router(versions_router)
