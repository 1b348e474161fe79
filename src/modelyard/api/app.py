"""The platform's FastAPI app (`modelyard serve`): gateway, control plane and admin APIs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from modelyard import __version__
from modelyard.api import (
    routes_admin,
    routes_batch,
    routes_endpoints,
    routes_inference,
    routes_registry,
)
from modelyard.api.errors import install_error_handlers
from modelyard.api.middleware import BodySizeLimit
from modelyard.api.oip import install_oip_error_handlers
from modelyard.platform import Platform


def create_platform_app(platform: Platform) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await platform.start()
        try:
            yield
        finally:
            await platform.stop()

    app = FastAPI(title="modelyard", version=__version__, lifespan=lifespan, redoc_url=None)
    app.state.platform = platform
    install_error_handlers(app)
    install_oip_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=platform.settings.max_body_bytes,
        path_limits={
            "/v1/blobs/": platform.settings.max_artifact_bytes,
            # Multipart framing adds a little on top of the file itself.
            "/v1/files": platform.settings.max_file_bytes + 2**20,
        },
    )
    for module in (routes_inference, routes_endpoints, routes_registry, routes_admin, routes_batch):
        app.include_router(module.router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        endpoints = platform.endpoints.endpoints.values()
        return {
            "status": "ok",
            "version": __version__,
            "endpoints": {s.row.id: s.status for s in endpoints},
            "routing_generation": platform.routing.generation,
            "warm_pool_idle": platform.endpoints.warm_pool.idle(),
            "node_cache": {
                "hits": platform.endpoints.node_cache.hits,
                "misses": platform.endpoints.node_cache.misses,
            },
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        m = platform.metrics
        m.replicas.clear()
        for state in platform.endpoints.endpoints.values():
            counts: dict[str, int] = {}
            for r in state.replicas:
                counts[r.state] = counts.get(r.state, 0) + 1
            for replica_state, n in counts.items():
                m.replicas.labels(state.row.id, state.row.model_name, replica_state).set(n)
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    return app
