"""The encoder worker: embedding and classifier models of one `ModelHost` served over HTTP.

Routes: OpenAI's `POST /v1/embeddings` and `GET /v1/models`; the Open Inference Protocol v2
(`/v2/health/*`, `/v2/models/{name}[/versions/1]`, `.../ready`, `.../infer`); `GET /health`
and `GET /metrics`. Errors are OpenAI-shaped everywhere except under `/v2/`, where they take the
protocol's own `{"error": "message"}` shape.

Every input of a request goes through the model's batcher as its own item, so the inputs of
concurrent requests share batches and a 2048-input request is cut into `max_batch_size` batches
that other requests interleave with.

Run it: `modelyard encoders --model NAME=PATH [--model NAME=PATH ...]`; the platform starts one
with no model and adds models through `PUT /admin/models/{name}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from modelyard import __version__
from modelyard.encoders.batcher import DynamicBatcher
from modelyard.encoders.embedding import EmbeddingModel
from modelyard.encoders.errors import (
    DimensionsNotSupported,
    EncoderInputError,
    HostBusy,
    ModelTooLarge,
    UnsupportedModel,
)
from modelyard.encoders.host import ModelHost, ModelSpec
from modelyard.encoders.loading import ModelKind, embedding_dimension, platform
from modelyard.encoders.metrics import EncoderMetrics
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.embeddings import (
    MAX_INPUTS,
    EmbeddingRequest,
    embedding_response,
    model_not_found,
)
from modelyard.protocol.errors import APIError, bad_request, install_error_handlers
from modelyard.protocol.middleware import BodySizeLimit
from modelyard.protocol.oip import (
    VERSION,
    OIPError,
    classifier_outputs,
    embedding_outputs,
    infer_response,
    install_oip_error_handlers,
    model_metadata,
    parse_infer_request,
    read_texts,
    select_outputs,
    top_k,
)
from modelyard.protocol.responses import json_response

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
_RETRY_AFTER_S = "1"
T = TypeVar("T")


class RegisterModel(BaseModel):
    path: str
    kind: ModelKind | None = None


async def _submit_all(batcher: DynamicBatcher[Any, T], inputs: Sequence[Any]) -> list[T]:
    """Each input as its own batcher item. On the first failure the inputs not yet run are
    withdrawn (the batcher skips cancelled items) and the failure is raised at its index in
    `inputs` (the batcher re-runs a failed batch item by item, so it reports index 0)."""
    tasks = [asyncio.ensure_future(batcher.submit(x)) for x in inputs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [(i, t.exception()) for i, t in enumerate(tasks) if t.done() and not t.cancelled()]
        for i, error in errors:  # every one read, the lowest index raised
            if isinstance(error, EncoderInputError):
                raise error.reindexed(i)
            if error is not None:
                raise error
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


def _host_failure(exc: HostBusy | ModelTooLarge) -> tuple[int, str, dict[str, str]]:
    if isinstance(exc, HostBusy):
        return 503, str(exc), {"retry-after": _RETRY_AFTER_S}
    return 500, str(exc), {}


class _Serving:
    """The routes' work, kept apart from FastAPI's wiring."""

    def __init__(self, host: ModelHost, metrics: EncoderMetrics) -> None:
        self.host = host
        self.metrics = metrics
        self.created = int(time.time())

    @asynccontextmanager
    async def observed(self, model: str, api: str) -> AsyncIterator[None]:
        """Count the request and its latency under `model` (known models only: a label per
        made-up name would grow the metrics without bound)."""
        start = time.perf_counter()
        status = 500
        try:
            yield
            status = 200
        except (APIError, OIPError) as exc:
            status = exc.status
            raise
        finally:
            if model in self.host.names:
                self.metrics.observe_request(model, api, status, time.perf_counter() - start)

    # ----- OpenAI ------------------------------------------------------------------------------

    def _embedding_spec(self, name: str) -> ModelSpec:
        if name not in self.host.names:
            raise model_not_found(name)
        spec = self.host.spec(name)
        if spec.kind != "embedding":
            raise bad_request(
                f"The model '{name}' is a {spec.kind}, not an embedding model.",
                "model",
                "model_not_supported",
            )
        return spec

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        spec = self._embedding_spec(body.model)
        inputs = body.inputs()
        try:
            async with self.host.use(spec.name) as loaded:
                model = loaded.model
                assert isinstance(model, EmbeddingModel)
                if body.dimensions is not None:
                    model.check_dimensions(body.dimensions)
                results = await run_until_disconnect(request, _submit_all(loaded.batcher, inputs))
        except DimensionsNotSupported as exc:
            raise bad_request(str(exc), "dimensions", "invalid_value") from None
        except EncoderInputError as exc:
            raise bad_request(str(exc), "input", "invalid_value") from None
        except (HostBusy, ModelTooLarge) as exc:
            status, message, headers = _host_failure(exc)
            raise APIError(status, message, code="model_unavailable", headers=headers) from None
        vectors = np.stack([vector for vector, _ in results])
        if body.dimensions is not None:
            vectors = model.truncate(torch.from_numpy(vectors), body.dimensions).numpy()
        counts = [n for _, n in results]
        return embedding_response(spec.name, vectors, counts, body.encoding_format)

    def models(self) -> dict[str, Any]:
        data = [
            {
                "id": s.name,
                "object": "model",
                "created": self.created,
                "owned_by": "modelyard",
                "kind": s.kind,
            }
            for s in (self.host.spec(n) for n in self.host.names)
        ]
        return {"object": "list", "data": data}

    # ----- Open Inference Protocol -------------------------------------------------------------

    def oip_spec(self, name: str, version: str | None = None) -> ModelSpec:
        if name not in self.host.names:
            raise OIPError(404, f"model '{name}' not found")
        if version is not None and version != VERSION:
            raise OIPError(404, f"model '{name}' has no version '{version}' (only '{VERSION}')")
        return self.host.spec(name)

    def metadata(self, spec: ModelSpec) -> dict[str, Any]:
        loaded = self.host.loaded(spec.name)
        dimension = None
        if spec.kind == "embedding":
            if loaded is not None and isinstance(loaded.model, EmbeddingModel):
                dimension = loaded.model.dimension
            else:
                dimension = embedding_dimension(spec.path)
        return model_metadata(spec.name, platform(spec.kind), spec.kind != "embedding", dimension)

    async def infer(self, spec: ModelSpec, request: Request) -> dict[str, Any]:
        body = parse_infer_request(await request.body())
        texts = read_texts(body, MAX_INPUTS)
        classifier = spec.kind != "embedding"
        names = select_outputs(body, ["label", "score"] if classifier else ["embedding"])
        try:
            async with self.host.use(spec.name) as loaded:
                labels = getattr(loaded.model, "labels", [])
                k = top_k(body, len(labels)) if classifier else None
                results = await run_until_disconnect(request, _submit_all(loaded.batcher, texts))
        except EncoderInputError as exc:
            raise OIPError(400, str(exc)) from None
        except (HostBusy, ModelTooLarge) as exc:
            status, message, _ = _host_failure(exc)
            raise OIPError(status, message) from None
        if classifier:
            outputs = classifier_outputs(results, k)
        else:
            outputs = embedding_outputs(np.stack([vector for vector, _ in results]))
        return infer_response(spec.name, body, outputs, names)

    # ----- health ------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        status = self.host.status()
        return {
            "status": "ok",
            "memory_budget_bytes": self.host.memory_budget,
            "memory_used_bytes": sum(s.memory_bytes for s in status),
            "models": {
                s.name: {"kind": s.kind, "loaded": s.loaded, "memory_bytes": s.memory_bytes}
                for s in status
            },
        }


def create_encoder_app(host: ModelHost, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        host.close()

    app = FastAPI(
        title="modelyard encoder worker", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    install_error_handlers(app)
    install_oip_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    metrics = EncoderMetrics(host)
    serving = _Serving(host, metrics)
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
            spec = await asyncio.to_thread(host.register, name, body.path, body.kind)
        except (ModelTooLarge, UnsupportedModel) as exc:
            raise bad_request(str(exc), "path", "model_rejected") from exc
        return json_response({"name": name, "kind": spec.kind, "path": str(spec.path)})

    @app.delete("/admin/models/{name}")
    async def unregister_model(name: str) -> Response:
        if not host.unregister(name):
            if name in host.names:
                raise APIError(409, f"model {name!r} is busy; retry", code="model_busy")
            raise model_not_found(name)
        return json_response({"name": name, "deleted": True})

    @app.get("/v2")
    async def server_metadata() -> Response:
        return json_response({"name": "modelyard", "version": __version__, "extensions": []})

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
            return json_response(await serving.infer(spec, request))

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

    from modelyard.worker.server import die_with_parent

    die_with_parent()
    model_host = ModelHost(memory_budget, max_batch_size, max_wait_ms, device)
    for name, path in models.items():
        spec = model_host.register(name, path)
        log.info("model %r: %s at %s", name, spec.kind, path)
    app = create_encoder_app(model_host, max_body_bytes)
    log.info("serving %d encoder models on http://%s:%d", len(models), host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
