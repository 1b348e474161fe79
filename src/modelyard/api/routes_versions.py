"""Versions behind one endpoint: `POST /v1/endpoints/{id}/versions` (a canary with its share of
the requests), `PATCH …/traffic` (the weights), `POST …/promote` and `POST …/rollback`.

Every change is recorded in the audit log with the endpoint before and after. Included by
`routes_endpoints.py`'s router.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from modelyard.api.deps import get_deployer, get_services
from modelyard.api.services import Services
from modelyard.control.audit import AuditAction, endpoint_snapshot
from modelyard.core.identity import Principal
from modelyard.protocol.management import ARTIFACT_MAX, ENGINE_OPTIONS_MAX, ID_MAX
from modelyard.protocol.responses import JSONResponse

router = APIRouter()


class SloThresholds(BaseModel):
    """When the canary is rolled back on its own; unset fields take the platform's defaults
    (`MODELYARD_CANARY_*`)."""

    model_config = ConfigDict(extra="forbid")

    max_error_rate_delta: float | None = Field(
        None, ge=0, le=1, description="Canary error rate minus the stable's above this: rollback."
    )
    max_p95_ratio: float | None = Field(
        None,
        gt=0,
        le=1_000,
        description="Canary p95 latency (TTFT for streams) over the stable's above this: rollback.",
    )
    min_samples: int | None = Field(
        None, ge=1, le=1_000_000, description="Requests in the window before judging."
    )
    window_s: float | None = Field(None, gt=0, le=86_400, description="The sliding window.")


class VersionAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_artifact: str = Field(
        min_length=1, max_length=ARTIFACT_MAX, description="Registry reference NAME:VERSION."
    )
    weight: int = Field(ge=0, le=100, description="Percent of the endpoint's requests.")
    replicas: int = Field(1, ge=1, le=64, description="Replicas the canary runs.")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        max_length=ENGINE_OPTIONS_MAX,
        description="Engine settings over the endpoint's, for the canary.",
    )
    slo: SloThresholds = Field(default_factory=SloThresholds)
    steps: list[Annotated[int, Field(ge=0, le=100)]] | None = Field(
        None,
        max_length=20,
        description="Progressive weights, e.g. [5, 25, 50, 100]: after each clean window the "
        "canary moves to the next; 100 promotes it.",
    )


class TrafficUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: dict[
        Annotated[str, StringConstraints(max_length=ID_MAX)], Annotated[int, Field(ge=0, le=100)]
    ] = Field(
        min_length=1,
        max_length=8,
        description="Version id → percent; the stable version and the canary, summing to 100.",
    )


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(None, max_length=500)


@router.post("/v1/endpoints/{endpoint_id}/versions", status_code=201)
async def add_version(
    endpoint_id: str,
    body: VersionAdd,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    async def change() -> dict[str, Any]:
        return await services.versions.add_version(
            principal, endpoint_id, body.model_artifact, body.weight, body.replicas, body.engine,
            body.slo.model_dump(exclude_none=True), body.steps,
        )  # fmt: skip

    return await _audited(services, principal, endpoint_id, AuditAction.ENDPOINT_VERSION_ADD,
                          change, 201)  # fmt: skip


@router.patch("/v1/endpoints/{endpoint_id}/traffic")
async def set_traffic(
    endpoint_id: str,
    body: TrafficUpdate,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    async def change() -> dict[str, Any]:
        return await services.versions.set_traffic(principal, endpoint_id, body.weights)

    return await _audited(services, principal, endpoint_id, AuditAction.ENDPOINT_TRAFFIC, change)


@router.post("/v1/endpoints/{endpoint_id}/promote")
async def promote(
    endpoint_id: str,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    async def change() -> dict[str, Any]:
        return await services.versions.promote(principal, endpoint_id)

    return await _audited(services, principal, endpoint_id, AuditAction.ENDPOINT_PROMOTE, change)


@router.post("/v1/endpoints/{endpoint_id}/rollback")
async def rollback(
    endpoint_id: str,
    body: RollbackRequest | None = None,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    async def change() -> dict[str, Any]:
        reason = body.reason if body is not None else None
        return await services.versions.rollback(principal, endpoint_id, reason)

    return await _audited(services, principal, endpoint_id, AuditAction.ENDPOINT_ROLLBACK, change)


async def _audited(
    services: Services,
    principal: Principal,
    endpoint_id: str,
    action: str,
    change: Any,
    status_code: int = 200,
) -> JSONResponse:
    """Run `change` and record it in the audit log with the endpoint before and after."""
    before = endpoint_snapshot(services.endpoints, endpoint_id)
    result = await change()
    after = endpoint_snapshot(services.endpoints, endpoint_id)
    await services.audit.record_endpoint(principal, action, endpoint_id, before, after)
    return JSONResponse(result, status_code=status_code)
