"""Admission of one inference request: parse and validate its body, resolve the model for the
tenant, reserve its tokens against TPM and quota and take a concurrency slot (all or nothing),
then shape the payload the worker receives (public name → upstream name, the endpoint's
sampling defaults, the tier's priority, the tenant's prefix-cache scope)."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from modelyard.config import BATCH_PRIORITY, PlatformSettings, PrefixCacheScope
from modelyard.core.adapter_routes import AdapterTarget, is_internal, target_for
from modelyard.core.errors import DomainError, Invalid, model_not_found
from modelyard.core.identity import Principal
from modelyard.core.logs import current_request_id
from modelyard.core.model_allow import model_not_allowed
from modelyard.core.model_kinds import refuse_wrong_kind
from modelyard.core.routing import EndpointRoute, RoutingTable
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.cache_scope import scope_prefix_cache
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.reservation import reservation_bound
from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.errors import validation_failure
from modelyard.protocol.json_depth import too_deep
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest
from modelyard.protocol.responses_api import ResponsesRequest

# Batch items run at the engine's batch priority plus their tenant tier's rank (after every
# interactive request; `config.BATCH_PRIORITY`). Whatever a client sends is overridden, so nobody
# jumps the queue.
BATCH_PRIORITY_BASE = BATCH_PRIORITY
_SCHEMAS: dict[str, type[BaseModel]] = {
    "chat.completions": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
    "responses": ResponsesRequest,
}


def parse(kind: str, body: bytes) -> tuple[dict[str, Any], Any]:
    """The request body as a dict and as its validated schema."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Invalid(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from exc
    if not isinstance(payload, dict):
        raise Invalid("The request body must be a JSON object.", code="invalid_json")
    deep = too_deep(body)  # before anything walks it (schemas, tools, the worker's copy)
    if deep is not None:
        raise Invalid(deep, code="json_too_deep")
    return payload, validate(kind, payload)


def validate(kind: str, payload: dict[str, Any]) -> Any:
    """A payload already parsed (a batch item's) checked against its schema."""
    try:
        return _SCHEMAS[kind].model_validate(payload)
    except ValidationError as exc:
        message, param, code = validation_failure(exc.errors())
        raise Invalid(message, param=param, code=code) from exc


def folder_adapter(route: EndpointRoute, model: str, adapter: AdapterTarget | None) -> str | None:
    """`model` when it names an adapter of the endpoint's engine's own `lora_dir`
    (`<model>:<name>`: neither the base nor the tenant's registry `adapter`), else None. Only
    the worker knows that folder: its 404 for such a name is the client's (`upstream.py`)."""
    if adapter is not None or model in (route.model_name, route.endpoint_id):
        return None
    return model


def shape_for_worker(
    payload: dict[str, Any],
    route: EndpointRoute,
    kind: str,
    principal: Principal,
    cache_scope: PrefixCacheScope,
    priority: int,
) -> AdapterTarget | None:
    """What the worker receives, in place: its own model name (with the adapter's internal
    name: `core/adapter_routes.py`), the endpoint's sampling defaults for the fields left out
    (or sent as null), the priority, the cache scope. Returns the tenant's registry adapter
    the request names (None: the base model)."""
    model = str(payload.get("model", ""))
    upstream = route.upstream_model or route.model_name
    adapter = target_for(route, principal.tenant_id, model)
    if adapter is not None:
        payload["model"] = f"{upstream}:{adapter.internal}"
    elif folder_adapter(route, model, adapter) is not None:
        payload["model"] = f"{upstream}:{model.rpartition(':')[2]}"
    elif route.upstream_model:
        payload["model"] = route.upstream_model
    if kind == "embeddings":
        return adapter
    for key, value in route.sampling_defaults.items():
        if payload.get(key) is None:
            payload[key] = value
    payload["priority"] = priority
    # Last, so no default and no client value outlives it.
    scope_prefix_cache(payload, cache_scope, principal.tenant_id)
    return adapter


class Admission:
    """Resolve, reserve and hold for one request (see the module's docstring)."""

    def __init__(
        self, settings: PlatformSettings, routing: RoutingTable, accounting: Accounting
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.accounting = accounting

    async def admit(
        self, principal: Principal, payload: dict[str, Any], req: Any, kind: str
    ) -> Call:
        """Rate limits, then the quota reservation and a concurrency slot; all or nothing."""
        route = self.resolve(principal, req.model, kind)
        reserved = self.reserve(route, payload, req)
        return await self.admit_reserved(principal, route, req.model, kind, reserved)

    async def admit_reserved(
        self, principal: Principal, route: EndpointRoute, model: str, kind: str, reserved: int
    ) -> Call:
        """`admit` for a request whose route and reservation are known (the OIP's). The
        tenant's registry adapter `model` names is known from here on: its budgets are held at
        its price (`shape_for_worker` resolves the same one)."""
        adapter = target_for(route, principal.tenant_id, model)
        if self.accounting.at_once is not None:  # limits, quota and slot in one round trip
            call = Call(
                principal=principal,
                route=route,
                kind=kind,
                request_id=current_request_id() or uuid.uuid4().hex,
                reserved=reserved,
                decision=NO_LIMITS,
                adapter=adapter,
            )
            await self.accounting.admit_at_once(call, model)
            await self.accounting.hold_budget(call)
            return call
        decision = await self.accounting.acquire(principal, model, reserved)
        call = Call(
            principal=principal,
            route=route,
            kind=kind,
            # The id the request context made (its logs' and response's), else a new one.
            request_id=current_request_id() or uuid.uuid4().hex,
            reserved=reserved,
            decision=decision,
            adapter=adapter,
        )
        try:
            await self.accounting.hold(call)
        except BaseException as exc:
            await self.accounting.close(call, served=False)
            if isinstance(exc, DomainError):
                exc.headers.update(decision.headers())
            raise
        await self.accounting.hold_budget(call)
        return call

    def reserve(self, route: EndpointRoute, payload: dict[str, Any], req: Any) -> int:
        """Tokens to hold against TPM and the quota until the real count is known: the most
        the request can use (`reservation.py`), never less."""
        if isinstance(req, EmbeddingRequest):
            return reservation_bound("embeddings", payload, 0)
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if max_tokens is not None and max_tokens > route.max_tokens_cap:
            # The name the client used for its bound.
            if isinstance(req, ResponsesRequest):
                param = "max_output_tokens"
            elif getattr(req, "max_completion_tokens", None):
                param = "max_completion_tokens"
            else:
                param = "max_tokens"
            raise Invalid(
                f"{param} is {max_tokens}, above this model's cap of {route.max_tokens_cap}",
                param=param,
                code="invalid_value",
            )
        # The endpoint's sampling defaults fill what the request leaves out (`shape_for_worker`).
        filled = {k: v for k, v in route.sampling_defaults.items() if payload.get(k) is None}
        kind = "completions" if isinstance(req, CompletionRequest) else "chat"
        return reservation_bound(kind, {**payload, **filled}, route.max_tokens_cap)

    def resolve(self, principal: Principal, model: str, kind: str | None = None) -> EndpointRoute:
        """The route of `model` for the caller: 403 `model_not_allowed` outside its key's
        allowed models (by the name sent, or by the model's name when sent its endpoint id),
        404 when the tenant cannot see it; with the request's `kind`, refused with
        `wrong_model_kind` when that endpoint's model does not answer that route."""
        tenant_id = principal.tenant_id
        route = self.routing.resolve(tenant_id, model)
        if not principal.allows_model(model):
            if route is None or model != route.endpoint_id:
                raise model_not_allowed(model)
            principal.require_model(route.model_name)
        if route is None:  # the tenant's registry adapter (`name`, `name:N`): its base's endpoint
            route = self.routing.adapter_index.lookup(tenant_id, model)
        if route is None and ":" in model:  # `<model>:<adapter>`: its base endpoint serves it
            route = self._base_of(tenant_id, model)
        if route is None:
            raise model_not_found(model)
        if kind is not None:
            refuse_wrong_kind(model, route.model_kind, kind)
        return route

    def _base_of(self, tenant_id: str, model: str) -> EndpointRoute | None:
        """The base endpoint of `<model>:<adapter>` when `<adapter>` is the tenant's registry
        adapter on it, or may be one of its engine's own `lora_dir` (never an internal name);
        None otherwise: another tenant's adapter, or none at all, is an unknown model (404),
        answered here before any replica is asked."""
        base, _, adapter = model.rpartition(":")
        route = self.routing.resolve(tenant_id, base)
        if route is None or not adapter or is_internal(adapter):
            return None
        if target_for(route, tenant_id, model) is not None or route.lora_dir:
            return route
        return None
