"""`GET /metrics`: the platform's series and every ready replica's, for Prometheus.

Who may read it: the configured scrape token (`metrics_token`) or the platform admin key see
everything; a key with the `metrics` scope sees its own tenant's series only (see
`gateway.metrics.view`). The platform's state (replicas, queues, autoscaling) is read from the
control plane here, the replicas' series through `gateway.federation`; 503/504 refusals of
inference requests are counted where the platform answers them (its domain-error handler).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from modelyard.api.deps import get_services
from modelyard.api.errors import status_of
from modelyard.api.openapi_edge import BEARER_ONLY
from modelyard.api.services import Services
from modelyard.control.model_kind import LLM
from modelyard.core.cluster_auth import replica_headers
from modelyard.core.errors import DomainError
from modelyard.core.loop_monitor import loop_stall_families
from modelyard.core.status import ReplicaState
from modelyard.gateway.federation import Federation, ScrapeTarget, SeriesOwner
from modelyard.gateway.metrics import Audience, EndpointSnapshot, PlatformState, view

router = APIRouter()

ENCODER_HOST = "encoder-host"  # the replica label of the shared embedding/classifier process
_INFERENCE_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v2/models/",
)


@router.get(
    "/metrics",
    openapi_extra=BEARER_ONLY,
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request, services: Services = Depends(get_services)) -> Response:
    """Prometheus metrics: everything for the platform admin key or the scrape token; a key
    with the `metrics` scope gets its own tenant's series."""
    audience = await _audience(request, services)
    families = services.metrics.families(platform_state(services)) + loop_stall_families()
    families += await _federation(request, services).collect(scrape_targets(services))
    # Rendering (and a tenant's filtering) is CPU work: off the event loop.
    text = await asyncio.to_thread(view, families, audience, services.settings.metrics_names)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI, services: Services) -> None:
    """The /metrics route, and the count of 503/504 refusals of inference requests."""
    app.include_router(router)
    answer = app.exception_handlers[DomainError]

    async def counted(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, DomainError)
        status = status_of(exc)
        if status in (503, 504) and request.url.path.startswith(_INFERENCE_PATHS):
            services.metrics.refused(status, exc.code or exc.kind)
        answered = answer(request, exc)  # Starlette types a handler as maybe-sync; ours is async
        assert inspect.isawaitable(answered)
        response: Response = await answered
        return response

    app.add_exception_handler(DomainError, counted)


async def _audience(request: Request, services: Services) -> Audience:
    authorization = request.headers.get("authorization") or ""
    token = services.settings.metrics_token
    scheme, _, given = authorization.partition(" ")
    if (
        token
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.encode())
    ):
        return Audience()
    principal = await services.auth.authenticate(authorization or None)
    if principal.platform_admin:
        return Audience()
    principal.require("metrics")
    own = frozenset(
        s.row.id
        for s in services.endpoints.endpoints.values()
        if s.row.tenant_id == principal.tenant_id
    )
    return Audience(principal.tenant_id, own)


def _federation(request: Request, services: Services) -> Federation:
    federation: Federation | None = getattr(request.app.state, "federation", None)
    if federation is None:
        federation = Federation(
            timeout_s=services.settings.metrics_scrape_timeout_s,
            headers=replica_headers(services.settings),
        )
        request.app.state.federation = federation
    return federation


def platform_state(services: Services) -> PlatformState:
    """Every endpoint's replicas, queue and autoscaling decisions, as the control plane and the
    routing table hold them now."""
    snapshots = []
    for state in services.endpoints.endpoints.values():
        counts: dict[str, int] = {}
        for r in state.replicas:
            if r.state is not ReplicaState.STOPPED:
                counts[str(r.state)] = counts.get(str(r.state), 0) + 1
        snapshots.append(
            EndpointSnapshot(
                endpoint=state.row.id,
                tenant=state.row.tenant_id,
                model_name=state.row.model_name,
                queued=state.route.waiting,
                in_flight=state.route.outstanding,
                desired_replicas=state.desired,
                replicas=counts,
            )
        )
    decided = services.endpoints.reconciler.scaler.decided
    return PlatformState(snapshots, dict(decided))


def scrape_targets(services: Services) -> list[ScrapeTarget]:
    """The ready replicas to read, and which endpoint each one's series belong to."""
    targets = []
    for state in services.endpoints.endpoints.values():
        for r in state.replicas:
            if r.state is not ReplicaState.READY or r.route is None:
                continue
            owner = SeriesOwner(
                endpoint=state.row.id,
                tenant=state.row.tenant_id,
                model_name=state.row.model_name,
                version=r.version_id or state.row.version_id or "",
            )
            if state.kind in (None, LLM):
                targets.append(ScrapeTarget(r.route.url, r.replica_id, {None: owner}))
            else:  # the shared host knows the model by the endpoint's upstream name
                name = state.route.upstream_model or state.row.id
                targets.append(ScrapeTarget(r.route.url, ENCODER_HOST, {name: owner}))
    return targets
