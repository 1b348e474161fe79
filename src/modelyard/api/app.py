"""The platform's FastAPI app (`modelyard serve`): gateway, control plane and admin APIs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from modelyard import __version__
from modelyard.api import (
    routes_audit,
    routes_batch,
    routes_budgets,
    routes_console,
    routes_endpoints,
    routes_inference,
    routes_people,
    routes_registry,
    routes_sso,
    routes_tenancy,
    routes_webhooks,
)
from modelyard.api.deps import get_services
from modelyard.api.docs_page import install_docs
from modelyard.api.errors import install_error_handlers
from modelyard.api.openapi_edge import BEARER_OPTIONAL, install_openapi
from modelyard.api.openapi_responses import Health, ok
from modelyard.api.preauth import PreAuthenticate
from modelyard.api.routes_metrics import install_metrics
from modelyard.api.services import Lifecycle, Services
from modelyard.api.text_guard import StorableText
from modelyard.core.errors import DomainError
from modelyard.core.gc_pauses import heap_started
from modelyard.core.identity import Principal
from modelyard.core.loop_monitor import watching_loop
from modelyard.core.routing import RoutingTable
from modelyard.gateway.request_context import GatewayRequestContext
from modelyard.protocol.middleware import BodySizeLimit
from modelyard.protocol.oip import install_oip_error_handlers
from modelyard.protocol.route_warmup import warm_routes


def create_platform_app(services: Services, lifecycle: Lifecycle) -> FastAPI:
    """The app over `services`; `lifecycle` starts before the first request and stops after
    the last."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with watching_loop():  # the loop-stall guard, when `loop_stall_ms` is set
            await lifecycle.start()
            await asyncio.to_thread(warm_routes, app)  # not on the first request's loop turn
            heap_started()  # a server process's startup objects leave the collector's walks
            try:
                yield
            finally:
                await lifecycle.stop()

    # /docs is installed by install_docs (assets served here, not from a CDN); no ReDoc.
    app = FastAPI(
        title="modelyard", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.services = services
    install_error_handlers(app)
    install_oip_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=services.settings.max_body_bytes,
        path_limits={
            "/v1/blobs/": services.settings.max_artifact_bytes,
            # Multipart framing adds a little on top of the file itself.
            "/v1/files": services.settings.max_file_bytes + 2**20,
        },
    )
    app.add_middleware(StorableText)
    # Outermost: a caller without a valid key (or the route's scope) is refused before any
    # body is read, so a stranger's upload costs nothing.
    app.add_middleware(PreAuthenticate, authenticate=services.auth.authenticate)
    # Around everything: the request's own id (logs, usage, x-request-id) and its trace.
    app.add_middleware(GatewayRequestContext)
    for module in (
        routes_inference,
        routes_endpoints,
        routes_registry,
        routes_tenancy,
        routes_people,
        routes_sso,
        routes_batch,
    ):
        app.include_router(module.router)
    app.include_router(routes_webhooks.router)
    app.include_router(routes_budgets.router)
    app.include_router(routes_audit.router)
    app.include_router(routes_console.router)
    install_openapi(app)
    install_docs(app)

    async def platform_admin(request: Request) -> Principal | None:
        """The caller if it is the platform admin; None for no key or a bad or lesser one."""
        authorization = request.headers.get("authorization")
        if not authorization:
            return None
        try:
            principal = await services.auth.authenticate(authorization)
        except DomainError:  # no key, a bad one, or keys cannot be checked now
            return None
        return principal if principal.platform_admin else None

    @app.get("/health", openapi_extra=BEARER_OPTIONAL, response_model=None, responses=ok(Health))
    async def health(request: Request) -> dict[str, Any]:
        """Liveness for load balancers (no key needed); details only for the platform admin,
        since endpoint ids and counts are other tenants' business."""
        if await platform_admin(request) is None:
            return {"status": "ok"}
        manager = get_services(request).endpoints  # a controller's current term's
        return {
            "status": "ok",
            "version": __version__,
            "endpoints": {s.row.id: s.status for s in manager.endpoints.values()},
            "routing_generation": services.routing.generation,
            "warm_pool_idle": manager.warm_pool.idle(),
            "node_cache": {"hits": manager.node_cache.hits, "misses": manager.node_cache.misses},
            "prefix_digests": known_digests(services.routing),
        }

    install_metrics(app, services)
    return app


def known_digests(routing: RoutingTable) -> dict[str, dict[str, dict[str, int]]]:
    """The replicas' prefix digests this process routes by (cache-aware routing; in cluster mode
    a gateway's come from the leader through Redis): per endpoint and replica, the digest's
    generation and how many keys it holds."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for route in routing.all_routes():
        held = {
            r.replica_id: {"generation": r.cache.generation, "keys": len(r.cache.held)}
            for r in route.replicas
            if r.cache.generation >= 0
        }
        if held:
            out[route.endpoint_id] = held
    return out
