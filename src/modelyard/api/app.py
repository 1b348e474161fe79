"""The platform's FastAPI app (`modelyard serve`): gateway, control plane and admin APIs."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from modelyard import __version__
from modelyard.api import (
    routes_admin,
    routes_batch,
    routes_console,
    routes_endpoints,
    routes_inference,
    routes_registry,
    routes_webhooks,
)
from modelyard.api.docs_page import install_docs
from modelyard.api.errors import install_error_handlers
from modelyard.api.openapi_edge import BEARER_ONLY, BEARER_OPTIONAL, install_openapi
from modelyard.api.openapi_responses import Health, ok
from modelyard.api.preauth import PreAuthenticate
from modelyard.api.services import Lifecycle, Services
from modelyard.api.text_guard import StorableText
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError
from modelyard.protocol.middleware import BodySizeLimit
from modelyard.protocol.oip import install_oip_error_handlers


def create_platform_app(services: Services, lifecycle: Lifecycle) -> FastAPI:
    """The app over `services`; `lifecycle` starts before the first request and stops after
    the last."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await lifecycle.start()
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
    for module in (routes_inference, routes_endpoints, routes_registry, routes_admin, routes_batch):
        app.include_router(module.router)
    app.include_router(routes_webhooks.router)
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
        except APIError:
            return None
        return principal if principal.platform_admin else None

    @app.get("/health", openapi_extra=BEARER_OPTIONAL, response_model=None, responses=ok(Health))
    async def health(request: Request) -> dict[str, Any]:
        """Liveness for load balancers (no key needed); details only for the platform admin,
        since endpoint ids and counts are other tenants' business."""
        if await platform_admin(request) is None:
            return {"status": "ok"}
        endpoints = services.endpoints.endpoints.values()
        return {
            "status": "ok",
            "version": __version__,
            "endpoints": {s.row.id: s.status for s in endpoints},
            "routing_generation": services.routing.generation,
            "warm_pool_idle": services.endpoints.warm_pool.idle(),
            "node_cache": {
                "hits": services.endpoints.node_cache.hits,
                "misses": services.endpoints.node_cache.misses,
            },
        }

    @app.get(
        "/metrics",
        openapi_extra=BEARER_ONLY,
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        """Prometheus metrics: for the platform admin key or the configured scrape token."""
        await _require_scraper(request, services)
        m = services.metrics
        m.replicas.clear()
        for state in services.endpoints.endpoints.values():
            counts: dict[str, int] = {}
            for r in state.replicas:
                counts[r.state] = counts.get(r.state, 0) + 1
            for replica_state, n in counts.items():
                m.replicas.labels(state.row.id, state.row.model_name, replica_state).set(n)
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _require_scraper(request: Request, services: Services) -> None:
    authorization = request.headers.get("authorization") or ""
    token = services.settings.metrics_token
    scheme, _, given = authorization.partition(" ")
    if (
        token
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.encode())
    ):
        return
    principal = await services.auth.authenticate(authorization or None)
    principal.require_platform_admin()
