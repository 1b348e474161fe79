"""The worker's FastAPI app: OpenAI routes, /health and /metrics around one `EngineClient`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from modelyard.core.gc_pauses import heap_started
from modelyard.core.loop_monitor import LoopStallCollector, watching_loop
from modelyard.engine.client import EngineClient
from modelyard.protocol.errors import install_error_handlers
from modelyard.protocol.middleware import BodySizeLimit
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest
from modelyard.protocol.responses import JSONResponse
from modelyard.protocol.responses_api import ResponsesRequest
from modelyard.protocol.route_warmup import warm_routes
from modelyard.worker import prefix_notes
from modelyard.worker.auth import install_token_check
from modelyard.worker.metrics import WorkerMetrics
from modelyard.worker.openai_serving import OpenAIServing
from modelyard.worker.owner import install_owner_watch
from modelyard.worker.request_context import WorkerRequestContext, traced
from modelyard.worker.responses import ResponsesServing

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class ServedModel(BaseModel):
    name: str = Field(min_length=1)


def create_app(
    engine: EngineClient,
    model_name: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    token: str | None = None,
    owner_timeout_s: float | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with watching_loop():  # the loop-stall guard, when `loop_stall_ms` is set
            engine.start()
            await asyncio.to_thread(warm_routes, app)  # not on the first request's loop turn
            heap_started()  # a worker process's model and startup objects leave the GC's walks
            if owner_watch is not None:  # its clock starts when the replica serves
                owner_watch.start()
            yield
            if owner_watch is not None:
                owner_watch.stop()
            engine.shutdown()

    app = FastAPI(title="modelyard worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(WorkerRequestContext)  # the gateway's request id and trace
    install_token_check(app, token)  # outermost: nothing runs for a caller without it
    # Cluster mode: exits when no controller heartbeats it (`core/owner_watch.py`).
    owner_watch = install_owner_watch(app, owner_timeout_s)
    metrics = WorkerMetrics(engine, model_name)
    metrics.registry.register(LoopStallCollector())  # this process's loop stalls, if watched
    serving = OpenAIServing(traced(engine), model_name, metrics)
    app.state.serving = serving

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await serving.completion(body, request)

    responses = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await responses.create(body, request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    # A warm-pool replica is taken over by an endpoint: from now on it answers to that name.
    # Workers listen on loopback, or demand the platform's token (`worker.auth`).
    @app.put("/admin/served-model")
    async def rename(body: ServedModel) -> JSONResponse:
        serving.model_name = body.name
        return JSONResponse({"model": body.name})

    @app.get("/health")
    async def health() -> JSONResponse:
        s = engine.snapshot()
        body: dict[str, Any] = {
            "status": "ok" if engine.healthy else "error",
            "model": serving.model_name,
            "running": s.running,
            "waiting": s.waiting,
            "kv_cache_usage": round(s.kv_cache_usage, 4),
            "kv_cache_capacity_tokens": s.kv_cache_capacity_tokens,
            # Free capacity, for backfill: slots no sequence holds or waits for, and KV tokens
            # no sequence holds (the batch runner sends its items only while both are left).
            "free_slots": max(0, s.max_num_seqs - s.running - s.waiting),
            "kv_free_tokens": int(s.kv_cache_capacity_tokens * (1.0 - s.kv_cache_usage)),
            "max_model_len": engine.max_model_len,
            "busy_seconds": round(s.busy_seconds, 3),
            "failed_steps": s.failed_steps,
            # Which gateway prefix keys its prefix cache holds (cache-aware routing).
            "prefix_digest": prefix_notes.digest(engine),
        }
        if engine.numerics is not None:  # quantization and dtypes, and why (chosen at load)
            body["numerics"] = dataclasses.asdict(engine.numerics)
        if s.lora_loaded:  # the platform's adapter listing counts the replicas holding each
            body["lora_loaded"] = list(s.lora_loaded)
        if engine.error is not None:
            body["error"] = engine.error
        return JSONResponse(body, status_code=200 if engine.healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
