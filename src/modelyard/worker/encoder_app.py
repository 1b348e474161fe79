"""The encoder worker: embedding and classifier models of one `ModelHost` served over HTTP.

Routes: OpenAI's `POST /v1/embeddings` and `GET /v1/models`; the Open Inference Protocol v2
(`/v2/health/*`, `/v2/models/{name}[/versions/1]`, `.../ready`, `.../infer`); `GET /health`
and `GET /metrics`. Errors are OpenAI-shaped everywhere except under `/v2/`, where they take the
protocol's own `{"error": "message"}` shape.

The routes' work (batching each input, answering in either protocol) is
`modelyard.worker.encoder_serving`'s.

Run it: `modelyard encoders --model NAME=PATH [--model NAME=PATH ...]`; the platform starts one
with no model and adds models through `PUT /admin/models/{name}`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from modelyard import __version__
from modelyard.core.errors import DomainError, model_not_found
from modelyard.core.gc_pauses import freeze_heap_when_started, heap_started
from modelyard.core.loop_monitor import LoopStallCollector, watching_loop
from modelyard.encoders.errors import ModelTooLarge, UnsupportedModel
from modelyard.encoders.host import ModelHost
from modelyard.encoders.loading import ModelKind
from modelyard.encoders.metrics import EncoderMetrics
from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.errors import APIError, bad_request, install_error_handlers
from modelyard.protocol.middleware import BodySizeLimit
from modelyard.protocol.oip import install_oip_error_handlers
from modelyard.protocol.oip_binary import EXTENSIONS
from modelyard.protocol.responses import json_response
from modelyard.protocol.route_warmup import warm_routes
from modelyard.worker.auth import configured_token, install_token_check
from modelyard.worker.encoder_serving import EncoderServing
from modelyard.worker.owner import install_owner_watch
from modelyard.worker.request_context import WorkerRequestContext

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class RegisterModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(max_length=4096)
    kind: ModelKind | None = None
    # Recorded when the platform checked the files; without it (an operator's own host), the
    # folder is read once here, in a thread, with the same bounded parser.
    param_count: int | None = Field(None, ge=0, le=1 << 50)


def _param_count(path: Path) -> int:
    from modelyard.core.model_files import inspect_local

    return inspect_local(path).param_count


def create_encoder_app(
    host: ModelHost,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    token: str | None = None,
    owner_timeout_s: float | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with watching_loop():  # the loop-stall guard, when `loop_stall_ms` is set
            await asyncio.to_thread(warm_routes, app)  # not on the first request's loop turn
            heap_started()  # an encoder worker's startup objects leave the collector's walks
            if owner_watch is not None:  # its clock starts when the host serves
                owner_watch.start()
            yield
            if owner_watch is not None:
                owner_watch.stop()
        host.close()

    app = FastAPI(
        title="modelyard encoder worker", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    install_oip_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(WorkerRequestContext)  # the gateway's request id and trace
    install_token_check(app, token)  # outermost: nothing runs for a caller without it
    # Cluster mode: exits when no controller heartbeats it (`core/owner_watch.py`).
    owner_watch = install_owner_watch(app, owner_timeout_s)
    metrics = EncoderMetrics(host)
    metrics.registry.register(LoopStallCollector())  # this process's loop stalls, if watched
    serving = EncoderServing(host, metrics)
    app.state.serving = serving

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        async with serving.observed(body.model, "embeddings"):
            return json_response(await serving.embeddings(body, request))

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())

    # The platform's control plane adds and removes the models this host serves at runtime.
    # Workers listen on loopback only; the gateway is the public door.
    @app.put("/admin/models/{name}")
    async def register_model(name: str, body: RegisterModel) -> Response:
        try:
            params = body.param_count
            if params is None:
                params = await asyncio.to_thread(_param_count, Path(body.path))
            spec = await asyncio.to_thread(
                host.register, name, body.path, body.kind, param_count=params
            )
        except (ModelTooLarge, UnsupportedModel, DomainError) as exc:
            raise bad_request(str(exc), "path", "model_rejected") from exc
        return json_response({"name": name, "kind": spec.kind, "path": str(spec.path)})

    @app.delete("/admin/models/{name}")
    async def unregister_model(name: str) -> Response:
        if not host.unregister(name):
            if name in host.names:
                raise APIError(409, f"model {name!r} is busy; retry", code="model_busy")
            raise APIError.from_domain(model_not_found(name))
        return json_response({"name": name, "deleted": True})

    @app.get("/v2")
    async def server_metadata() -> Response:
        return json_response(
            {"name": "modelyard", "version": __version__, "extensions": EXTENSIONS}
        )

    @app.get("/v2/health/live")
    async def live() -> Response:
        return json_response({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        # Models load on first use, so the server is ready as soon as it answers.
        return json_response({"ready": True})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def metadata(name: str, version: str | None = None) -> Response:
        return json_response(serving.metadata(serving.oip_spec(name, version)))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        spec = serving.oip_spec(name, version)
        return json_response({"name": spec.name, "ready": True})

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        spec = serving.oip_spec(name, version)
        async with serving.observed(spec.name, "infer"):
            return await serving.infer(spec, request)

    @app.get("/health")
    async def health() -> Response:
        return json_response(serving.health())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_encoders(
    models: dict[str, Path],
    host: str,
    port: int,
    memory_budget: int,
    max_batch_size: int,
    max_wait_ms: float,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    device: str = "cpu",
    log_level: str = "info",
) -> None:
    import uvicorn

    from modelyard.config import TelemetrySettings
    from modelyard.core.owner_watch import exit_if_orphaned
    from modelyard.core.uvicorn_options import uvicorn_options
    from modelyard.worker.server import die_with_parent

    die_with_parent()
    model_host = ModelHost(memory_budget, max_batch_size, max_wait_ms, device)
    for name, path in models.items():
        spec = model_host.register(name, path, param_count=_param_count(Path(path)))
        log.info("model %r: %s at %s", name, spec.kind, path)
    app = create_encoder_app(model_host, max_body_bytes, token=configured_token())
    log.info("serving %d encoder models on http://%s:%d", len(models), host, port)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
        **uvicorn_options(TelemetrySettings()),
    )  # fmt: skip
    server = uvicorn.Server(config)
    freeze_heap_when_started()
    if app.state.owner_watch is not None:
        app.state.owner_watch.server = server
    server.run()
    exit_if_orphaned(app.state.owner_watch)  # no controller heartbeated it: code 4
