"""OpenAI inference routes of the gateway: chat, completions and the models a tenant sees."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from modelyard.api.deps import get_platform, get_principal
from modelyard.api.errors import APIError
from modelyard.gateway.auth import Principal
from modelyard.gateway.router import EndpointRoute
from modelyard.platform import Platform

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await get_platform(request).gateway.handle(request, "chat.completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await get_platform(request).gateway.handle(request, "completions")


def _model_object(route: EndpointRoute, platform: Platform) -> dict[str, Any]:
    state = platform.endpoints.endpoints.get(route.endpoint_id)
    created = int(state.row.created_at.timestamp()) if state else 0
    return {
        "id": route.model_name,
        "object": "model",
        "created": created,
        "owned_by": "modelyard" if route.public else route.tenant_id,
        "endpoint_id": route.endpoint_id,
    }


@router.get("/v1/models")
async def list_models(
    principal: Principal = Depends(get_principal), platform: Platform = Depends(get_platform)
) -> dict[str, Any]:
    routes = platform.routing.visible(principal.tenant_id)
    return {"object": "list", "data": [_model_object(r, platform) for r in routes]}


@router.get("/v1/models/{model}")
async def retrieve_model(
    model: str,
    principal: Principal = Depends(get_principal),
    platform: Platform = Depends(get_platform),
) -> dict[str, Any]:
    route = platform.routing.resolve(principal.tenant_id, model)
    if route is None:
        raise APIError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return _model_object(route, platform)
