"""The OpenAI Files and Batches APIs (tenant-scoped; keys with the `inference` scope)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from modelyard.api.deps import get_inference, get_services
from modelyard.api.openapi_responses import (
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
    ok,
)
from modelyard.api.services import Services
from modelyard.api.text_guard import storable
from modelyard.core.identity import Principal
from modelyard.protocol.errors import bad_request
from modelyard.protocol.responses import JSONResponse

router = APIRouter()


# OpenAI's bounds on batch metadata: 16 pairs, keys of 64 characters, values of 512.
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field("24h", max_length=16)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)


@router.post("/v1/files", response_model=None, responses=ok(FileObject))
async def upload_file(
    request: Request,
    file: UploadFile = File(...),
    purpose: str = Form(...),
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    _refuse_unknown_form_fields(await request.form())
    filename = file.filename or "upload.jsonl"
    if not storable(filename):
        raise bad_request(
            "Invalid value for 'file': its filename must be valid Unicode without NUL characters.",
            "file",
            "invalid_text",
        )
    # The upload is spooled to a local temp file (a batch input file checked line by line on
    # the way), then copied (and hashed) into the store.
    with tempfile.NamedTemporaryFile(dir=services.store.tmp, prefix="file-") as tmp:
        await asyncio.to_thread(services.files.spool, purpose, file.file, tmp)
        tmp.flush()
        return await asyncio.to_thread(
            services.files.create_from_path,
            principal.tenant_id,
            Path(tmp.name),
            filename,
            purpose,
        )


@router.get("/v1/files", response_model=None, responses=ok(FileList))
async def list_files(
    purpose: str | None = None,
    limit: int = Query(100, ge=1, le=10_000),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await asyncio.to_thread(
        services.files.list, principal.tenant_id, purpose, limit, after, order
    )


def _refuse_unknown_form_fields(form: Any) -> None:
    """No upload field is dropped silently: files never expire here (`expires_after` is
    refused by name), and OpenAI's answer for anything else."""
    for key in form:
        if key.startswith("expires_after"):
            raise bad_request(
                f"Unsupported parameter: '{key}': files are kept until they are deleted.",
                "expires_after",
                "unsupported",
            )
        if key not in ("file", "purpose"):
            raise bad_request(f"Unrecognized request argument supplied: {key[:256]}")


@router.get("/v1/files/{file_id}", response_model=None, responses=ok(FileObject))
async def get_file(
    file_id: str,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await asyncio.to_thread(services.files.get, principal.tenant_id, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(
    file_id: str,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> FileResponse:
    path = await asyncio.to_thread(services.files.content_path, principal.tenant_id, file_id)
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=None, responses=ok(FileDeleted))
async def delete_file(
    file_id: str,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    deleted = await asyncio.to_thread(services.files.delete, principal.tenant_id, file_id)
    if services.reclaimer is not None:
        services.reclaimer.soon()  # its bytes go once no tenant holds them
    return deleted


@router.post("/v1/batches", response_model=None, responses=ok(BatchObject))
async def create_batch(
    body: BatchCreate,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> JSONResponse:
    batch = await asyncio.to_thread(
        services.batches.create,
        principal,
        body.input_file_id,
        body.endpoint,
        body.completion_window,
        body.metadata,
    )
    return JSONResponse(batch)


@router.get("/v1/batches", response_model=None, responses=ok(BatchList))
async def list_batches(
    limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await asyncio.to_thread(services.batches.list, principal.tenant_id, limit, after)


@router.get("/v1/batches/{batch_id}", response_model=None, responses=ok(BatchObject))
async def get_batch(
    batch_id: str,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await asyncio.to_thread(services.batches.get, principal.tenant_id, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", response_model=None, responses=ok(BatchObject))
async def cancel_batch(
    batch_id: str,
    principal: Principal = Depends(get_inference),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    return await asyncio.to_thread(services.batches.cancel, principal.tenant_id, batch_id)
