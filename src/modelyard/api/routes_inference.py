"""OpenAI inference routes of the gateway: chat, completions and the models a tenant sees."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from modelyard import __version__
from modelyard.api.deps import get_reader, get_services
from modelyard.api.openapi_edge import BEARER_ONLY, json_body
from modelyard.api.openapi_responses import (
    ChatCompletion,
    Completion,
    EmbeddingList,
    ModelList,
    ModelObject,
    ResponseObject,
    ok,
)
from modelyard.api.services import Services
from modelyard.core.errors import model_not_found
from modelyard.core.identity import Principal
from modelyard.core.routing import EndpointRoute
from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.oip import InferRequest, protocol_shaped
from modelyard.protocol.oip_binary import EXTENSIONS
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest
from modelyard.protocol.responses_api import ResponsesRequest

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    response_model=None,
    responses=ok(ChatCompletion, stream=True),
)
async def chat_completions(request: Request) -> Response:
    return await get_services(request).gateway.handle(request, "chat.completions")


@router.post(
    "/v1/completions",
    openapi_extra=json_body(CompletionRequest),
    response_model=None,
    responses=ok(Completion, stream=True),
)
async def completions(request: Request) -> Response:
    return await get_services(request).gateway.handle(request, "completions")


@router.post(
    "/v1/responses",
    openapi_extra=json_body(ResponsesRequest),
    response_model=None,
    responses=ok(ResponseObject, stream=True),
)
async def responses(request: Request) -> Response:
    """The Responses API, stateless: routed, limited and metered like chat."""
    return await get_services(request).gateway.handle(request, "responses")


@router.get("/v1/async/{request_id}")
async def async_result(
    request_id: str,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> Response:
    """The answer to a request sent with `Prefer: respond-async` (202 while it runs)."""
    return services.gateway.async_results.get(principal.tenant_id, request_id)


@router.post(
    "/v1/embeddings",
    openapi_extra=json_body(EmbeddingRequest),
    response_model=None,
    responses=ok(EmbeddingList),
)
async def embeddings(request: Request) -> Response:
    return await get_services(request).gateway.handle(request, "embeddings")


# Open Inference Protocol v2 (KServe, Triton, MLServer clients) for classifier and embedding
# endpoints. Errors under /v2 take the protocol's {"error": "..."} shape.


@router.get("/v2")
async def oip_server_metadata() -> dict[str, Any]:
    """The protocol's server metadata: name, version and the extensions it speaks."""
    return {"name": "modelyard", "version": __version__, "extensions": EXTENSIONS}


@router.get("/v2/health/live")
@router.get("/v2/health/ready")
async def oip_health() -> dict[str, Any]:
    return {}


@router.get("/v2/models/{model}", openapi_extra=BEARER_ONLY)
@router.get("/v2/models/{model}/versions/{version}", openapi_extra=BEARER_ONLY)
async def oip_metadata(model: str, request: Request, version: str | None = None) -> Response:
    return protocol_shaped(await get_services(request).gateway.handle_oip(request, model, ""))


@router.get("/v2/models/{model}/ready", openapi_extra=BEARER_ONLY)
@router.get("/v2/models/{model}/versions/{version}/ready", openapi_extra=BEARER_ONLY)
async def oip_ready(model: str, request: Request, version: str | None = None) -> Response:
    return protocol_shaped(await get_services(request).gateway.handle_oip(request, model, "ready"))


@router.post("/v2/models/{model}/infer", openapi_extra=json_body(InferRequest))
@router.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=json_body(InferRequest))
async def oip_infer(model: str, request: Request, version: str | None = None) -> Response:
    return protocol_shaped(await get_services(request).gateway.handle_oip(request, model, "infer"))


def _model_object(route: EndpointRoute, services: Services) -> dict[str, Any]:
    state = services.endpoints.endpoints.get(route.endpoint_id)
    created = int(state.row.created_at.timestamp()) if state else 0
    return {
        "id": route.model_name,
        "object": "model",
        "created": created,
        "owned_by": "modelyard" if route.public else route.tenant_id,
        "endpoint_id": route.endpoint_id,
        # chat, completion, embedding or classifier (null while the endpoint is provisioning):
        # which routes it answers (`core/model_kinds.py`), and what it can do.
        "kind": route.model_kind,
        "capabilities": dict(route.capabilities),
        "sampling_defaults": dict(route.sampling_defaults),
    }


@router.get("/v1/models", response_model=None, responses=ok(ModelList))
async def list_models(
    principal: Principal = Depends(get_reader), services: Services = Depends(get_services)
) -> dict[str, Any]:
    routes = services.routing.visible(principal.tenant_id)
    allowed = [r for r in routes if principal.allows_model(r.model_name)]  # the key's, if any
    data = [_model_object(r, services) for r in allowed]
    for name, serving in services.routing.adapter_index.names(principal.tenant_id):
        if principal.allows_model(name):
            data.append(_adapter_object(name, serving[0], principal.tenant_id))
    return {"object": "list", "data": data}


def _adapter_object(name: str, route: EndpointRoute, tenant_id: str) -> dict[str, Any]:
    """The tenant's registry LoRA adapter, served on its base's endpoint (`parent`): the base's
    kind, capabilities and sampling defaults."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": tenant_id,
        "endpoint_id": route.endpoint_id,
        "parent": route.model_name,
        "kind": route.model_kind,
        "capabilities": dict(route.capabilities),
        "sampling_defaults": dict(route.sampling_defaults),
    }


@router.get("/v1/models/{model}", response_model=None, responses=ok(ModelObject))
async def retrieve_model(
    model: str,
    principal: Principal = Depends(get_reader),
    services: Services = Depends(get_services),
) -> dict[str, Any]:
    route = services.routing.resolve(principal.tenant_id, model)
    if route is None:
        adapter = services.routing.adapter_index.lookup(principal.tenant_id, model)
        if adapter is None:
            raise model_not_found(model)
        principal.require_model(model)
        return _adapter_object(model, adapter, principal.tenant_id)
    principal.require_model(route.model_name)
    return _model_object(route, services)
