"""The encoder worker's work per route, apart from FastAPI's wiring: embeddings, OIP inference,
model listing and health over one `ModelHost`, with each request observed in the metrics.

Every input of a request goes through the model's batcher as its own item, so the inputs of
concurrent requests share batches and a 2048-input request is cut into `max_batch_size` batches
that other requests interleave with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import torch
from fastapi import Request
from fastapi.responses import Response

from modelyard.core.errors import model_not_found
from modelyard.encoders.batcher import DynamicBatcher
from modelyard.encoders.embedding import EmbeddingModel
from modelyard.encoders.errors import (
    DimensionsNotSupported,
    EncoderInputError,
    HostBusy,
    ModelTooLarge,
)
from modelyard.encoders.host import ModelHost, ModelSpec
from modelyard.encoders.loading import embedding_dimension, platform
from modelyard.encoders.metrics import EncoderMetrics
from modelyard.protocol.disconnect import run_until_disconnect
from modelyard.protocol.embeddings import (
    MAX_INPUTS,
    EmbeddingRequest,
    embedding_response,
)
from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.oip import (
    VERSION,
    OIPError,
    classifier_outputs,
    embedding_outputs,
    infer_response,
    model_metadata,
    read_texts,
    select_outputs,
    top_k,
)
from modelyard.protocol.oip_binary import (
    HEADER,
    answer_response,
    binary_outputs,
    decode_infer,
    encode_answer,
)
from modelyard.protocol.responses import json_response

_RETRY_AFTER_S = "1"
T = TypeVar("T")


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


class EncoderServing:
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
            raise APIError.from_domain(model_not_found(name))
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

    async def infer(self, spec: ModelSpec, request: Request) -> Response:
        """The answer, JSON or in the binary extension's form as the request asks."""
        raw = await request.body()
        # Parsed off the loop: the body may be megabytes of texts.
        body = (await asyncio.to_thread(decode_infer, raw, request.headers.get(HEADER))).request
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
            outputs = classifier_outputs([scores for scores, _ in results], k)
        else:
            outputs = embedding_outputs(np.stack([vector for vector, _ in results]))
        tokens = sum(n for _, n in results)
        answer = infer_response(spec.name, body, outputs, names, tokens)
        binary = binary_outputs(body, names)
        if not binary:
            return json_response(answer)
        content, length = await asyncio.to_thread(encode_answer, answer, binary)
        return answer_response(content, length, {})

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
