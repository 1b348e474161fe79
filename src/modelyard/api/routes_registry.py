"""The model registry's HTTP API: content-addressed blob uploads and model versions.

Upload flow (what `modelyard models push` does): `HEAD /v1/blobs/{sha256}` for each file, `PUT`
the ones the tenant has not uploaded yet (the body must hash to the name), then
`POST /v1/registry/models/{name}/versions` with the manifest of paths → sha256.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from modelyard.api.deps import get_deployer, get_services, get_tenant_reader
from modelyard.api.services import Services
from modelyard.control import adapters
from modelyard.control.registry import check_model_name
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError
from modelyard.protocol.management import VersionCreate
from modelyard.protocol.responses import JSONResponse
from modelyard.store.artifacts import ArtifactError, IntegrityError, check_sha256

router = APIRouter()

# The blob is streamed from the raw request, so its body is declared by hand.
_BLOB_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def _sha(value: str) -> str:
    try:
        return check_sha256(value)
    except ArtifactError as exc:
        raise APIError(400, str(exc), param="sha256", code="invalid_digest") from exc


def _over_quota(size: int | None, room: int) -> APIError:
    what = "This upload" if size is None else f"This upload of {size} bytes"
    return APIError(
        413,
        f"{what} does not fit your organization's storage quota: {room} bytes are left. "
        "Delete models or files you no longer need (their space is freed), or ask the platform "
        "administrator to raise the quota.",
        code="storage_quota_exceeded",
    )


@router.head("/v1/blobs/{sha256}")
async def blob_exists(
    sha256: str,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> Response:
    owned = await asyncio.to_thread(services.registry.has_blob, principal.tenant_id, _sha(sha256))
    return Response(status_code=200 if owned else 404)


@router.put("/v1/blobs/{sha256}", status_code=201, openapi_extra=_BLOB_BODY)
async def upload_blob(
    sha256: str,
    request: Request,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    expected = _sha(sha256)
    registry = services.registry
    limit = services.settings.max_artifact_bytes
    # Within the tenant's storage quota: refused before a byte is read when its length says so,
    # cut off while streaming otherwise (a blob it holds already costs nothing more).
    owned = await asyncio.to_thread(registry.has_blob, principal.tenant_id, expected)
    room = None if owned else await asyncio.to_thread(registry.room, principal.tenant_id)
    if room is not None:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > room:
            raise _over_quota(int(declared), room)
    try:
        bound = limit if room is None else min(limit, room)
        blob = await registry.store.put_stream(request.stream(), expected, bound)
    except IntegrityError as exc:
        raise APIError(400, f"upload rejected: {exc}", code="digest_mismatch") from exc
    except ArtifactError as exc:
        if room is not None and room < limit:
            raise _over_quota(None, room) from exc
        raise APIError(413, str(exc), code="artifact_too_large") from exc
    await asyncio.to_thread(registry.add_blob, principal.tenant_id, blob.sha256, blob.size)
    return {"sha256": blob.sha256, "size": blob.size}


@router.post("/v1/registry/models/{name}/versions", status_code=201)
async def create_version(
    name: str,
    body: VersionCreate,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> JSONResponse:
    files = {path: entry.model_dump(exclude_none=True) for path, entry in body.files.items()}
    version = await asyncio.to_thread(
        services.registry.create_version,
        principal.tenant_id,
        check_model_name(name),
        files,
        body.format,
        body.base_model,
    )
    view = {
        "id": version.version_id,
        "model": version.model_name,
        "version": version.version,
        "ref": f"{version.model_name}:{version.version}",
        "format": version.format,
        "base_model": version.base_model,
        "total_size": version.total_size,
        "param_count": version.param_count,
    }
    if version.format == "lora":  # endpoints serving its base can serve it now
        await services.endpoints.adapters_changed(principal.tenant_id)
    await services.audit.record(
        principal, "model_version.push", "model_version", str(view["id"]), None, view
    )
    return JSONResponse(view, status_code=201)


@router.get("/v1/registry/adapters")
async def list_registry_adapters(
    principal: Principal = Depends(get_tenant_reader), services: Services = Depends(get_services)
) -> dict[str, Any]:
    """The tenant's LoRA adapters served on shared bases, with their state."""
    data = adapters.listing(services.routing, services.endpoints.endpoints, principal.tenant_id)
    return {"object": "list", "data": data}


@router.get("/v1/registry/models")
async def list_registry_models(
    principal: Principal = Depends(get_tenant_reader), services: Services = Depends(get_services)
) -> dict[str, Any]:
    models = await asyncio.to_thread(services.registry.list_models, principal.tenant_id)
    return {"object": "list", "data": models}


@router.get("/v1/registry/models/{name}")
async def get_registry_model(
    name: str,
    principal: Principal = Depends(get_tenant_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    check_model_name(name)
    models = await asyncio.to_thread(services.registry.list_models, principal.tenant_id)
    for m in models:
        if m["name"] == name:
            return m
    raise APIError(404, f"model {name!r} is not in the registry", code="not_found")


@router.delete("/v1/registry/models/{name}")
async def delete_registry_model(
    name: str,
    principal: Principal = Depends(get_deployer),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    models = await asyncio.to_thread(services.registry.list_models, principal.tenant_id)
    await asyncio.to_thread(services.registry.delete_model, principal.tenant_id, name)
    if services.reclaimer is not None:
        services.reclaimer.soon()  # its blobs go once no tenant holds them
    before = next((m for m in models if m["name"] == name), None)
    await services.audit.record(principal, "model.delete", "model", name, before, None)
    return {"name": name, "deleted": True}
