"""The Open Inference Protocol (KServe v2 / Triton / MLServer) at the HTTP edge: the infer
request schema, reading its text tensor, and the response and metadata bodies (the binary
tensor extension is `modelyard.protocol.oip_binary`'s).

Text goes in as one `BYTES` tensor named `text`, of shape [N] or [N, 1] (any other input name is
refused, naming it); its `data` may be nested as the shape says (KServe style) or flat with
`shape` saying how to read it (Triton style). Output
tensors are written flat, row-major: every v2 client reads that. Errors have the protocol's own
shape, `{"error": "message"}`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from modelyard.protocol.errors import INTERNAL_ERROR, APIError
from modelyard.protocol.json_depth import too_deep
from modelyard.protocol.responses import json_response

VERSION = "1"  # every hosted model has one version

# A classifier's answer for one text: (label, score) pairs, best first (as the classifier
# writes them; a plain type here so the wire format needs no model code).
Scores = list[tuple[str, float]]


log = logging.getLogger(__name__)

OIP_PREFIX = "/v2"
INPUT = "text"  # the one input every hosted model takes
# A tensor's dimensions: a shape of thousands of them made its element count (their product,
# one C call holding the GIL) a bignum multiplication of seconds to minutes.
MAX_DIMS = 16


class OIPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    def response(self) -> Response:
        return json_response({"error": self.message}, self.status, self.headers)


class InferTensor(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    shape: list[int] = Field(max_length=MAX_DIMS)
    datatype: str
    data: Any = None  # absent when the binary extension carries it
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    inputs: list[InferTensor]
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None


def parse_infer_request(raw: bytes) -> InferRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OIPError(400, f"invalid JSON body: {exc}") from None
    deep = too_deep(raw)
    if deep is not None:
        raise OIPError(400, deep)
    try:
        return InferRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise OIPError(400, f"invalid inference request at '{where}': {first['msg']}") from None


def _flatten(data: Any, shape: list[int], name: str) -> list[Any]:
    size = math.prod(shape)
    if not isinstance(data, list):
        raise OIPError(400, f"input '{name}': 'data' must be a list")
    if not any(isinstance(x, list) for x in data):
        if len(data) != size:
            raise OIPError(
                400,
                f"input '{name}': 'data' holds {len(data)} elements, shape {shape} needs {size}",
            )
        return data

    def walk(node: Any, dims: list[int]) -> list[Any]:
        if not dims:
            if isinstance(node, list):
                raise OIPError(400, f"input '{name}': 'data' is nested deeper than shape {shape}")
            return [node]
        if not isinstance(node, list) or len(node) != dims[0]:
            raise OIPError(400, f"input '{name}': nested 'data' does not match shape {shape}")
        return [x for child in node for x in walk(child, dims[1:])]

    return walk(data, shape)


def read_texts(request: InferRequest, max_inputs: int) -> list[str]:
    """The texts of the request's single BYTES input tensor, shape [N] or [N, 1]."""
    unknown = [t.name for t in request.inputs if t.name != INPUT]
    if unknown:
        raise OIPError(
            400, f"unknown input {unknown[0]!r}; this model takes one input, {INPUT!r} (BYTES)"
        )
    if len(request.inputs) != 1:
        raise OIPError(
            400, f"expected exactly one input tensor (BYTES texts), got {len(request.inputs)}"
        )
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise OIPError(
            400, f"input '{tensor.name}' has datatype {tensor.datatype}; expected BYTES (texts)"
        )
    shape = tensor.shape
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 0:
        raise OIPError(400, f"input '{tensor.name}' has shape {shape}; expected [N] or [N, 1]")
    texts = _flatten(tensor.data, shape, tensor.name)
    if not texts:
        raise OIPError(400, f"input '{tensor.name}' holds no texts")
    if len(texts) > max_inputs:
        raise OIPError(
            400,
            f"input '{tensor.name}' holds {len(texts)} texts, more than the limit of {max_inputs}",
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise OIPError(400, f"input '{tensor.name}': element {i} is not a string")
    return texts


def top_k(request: InferRequest, n_labels: int) -> int | None:
    k = (request.parameters or {}).get("top_k")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_labels:
        raise OIPError(400, f"parameter 'top_k' must be an integer from 1 to {n_labels}")
    return k


def select_outputs(request: InferRequest, available: Sequence[str]) -> list[str]:
    if not request.outputs:
        return list(available)
    names = [o.name for o in request.outputs]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise OIPError(400, f"unknown output {unknown[0]!r}; this model has {', '.join(available)}")
    return names


def tensor(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def classifier_outputs(scores: list[Scores], k: int | None) -> dict[str, dict[str, Any]]:
    n = len(scores)
    if k is None:
        labels = [s[0][0] for s in scores]
        values = np.array([s[0][1] for s in scores], dtype=np.float32)
        shape = [n]
    else:
        labels = [label for s in scores for label, _ in s[:k]]
        values = np.array([p for s in scores for _, p in s[:k]], dtype=np.float32)
        shape = [n, k]
    return {
        "label": tensor("label", "BYTES", shape, labels),
        "score": tensor("score", "FP32", list(shape), values),
    }


def embedding_outputs(vectors: np.ndarray) -> dict[str, dict[str, Any]]:
    return {
        "embedding": tensor("embedding", "FP32", list(vectors.shape), vectors.reshape(-1)),
    }


def infer_response(
    model: str,
    request: InferRequest,
    outputs: dict[str, dict[str, Any]],
    names: list[str],
    prompt_tokens: int,
) -> dict[str, Any]:
    """The answer; its `parameters.usage` says the tokens the inputs took (what is billed, as
    an OpenAI embeddings answer's `usage` does)."""
    body: dict[str, Any] = {"model_name": model, "model_version": VERSION}
    if request.id is not None:
        body["id"] = request.id
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    body["parameters"] = {"usage": usage}
    body["outputs"] = [outputs[n] for n in names]
    return body


def infer_usage(body: Any) -> dict[str, Any]:
    """The usage an infer answer reports (empty if none)."""
    params = body.get("parameters") if isinstance(body, dict) else None
    usage = params.get("usage") if isinstance(params, dict) else None
    return usage if isinstance(usage, dict) else {}


def model_metadata(
    name: str, platform: str, classifier: bool, dimension: int | None
) -> dict[str, Any]:
    """Inputs and outputs as the infer route takes and gives them (-1: any size)."""
    inputs = [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}]
    if classifier:
        outputs = [
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ]
    else:
        outputs = [{"name": "embedding", "datatype": "FP32", "shape": [-1, dimension or -1]}]
    return {
        "name": name,
        "versions": [VERSION],
        "platform": platform,
        "inputs": inputs,
        "outputs": outputs,
    }


def protocol_shaped(response: Response) -> Response:
    """An error relayed from a replica in OpenAI's shape (`{"error": {"message": …}}`, e.g. an
    LLM worker that has no /v2 routes) rewritten into the protocol's `{"error": "message"}`."""
    if response.status_code < 400:
        return response
    try:
        body = orjson.loads(bytes(response.body))
    except orjson.JSONDecodeError:
        return json_response({"error": "error"}, response.status_code)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return response
    message = error.get("message") if isinstance(error, dict) else None
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _FRAMING}
    return json_response({"error": str(message or "error")}, response.status_code, headers)


_FRAMING = ("content-length", "content-type")


def is_oip_path(path: str) -> bool:
    """Whether a request path is the Open Inference Protocol's (its errors take its shape)."""
    return path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/")


def install_oip_error_handlers(app: FastAPI) -> None:
    """Under `/v2/` every error, the framework's own included, takes the protocol's shape;
    elsewhere the OpenAI handlers `install_error_handlers` put in place still answer."""
    openai_handlers = dict(app.exception_handlers)

    def is_oip(request: Request) -> bool:
        return is_oip_path(request.url.path)

    @app.exception_handler(OIPError)
    async def _oip(_: Request, exc: OIPError) -> Response:
        return exc.response()

    def wrap(
        kind: type[Exception], to_oip: Callable[[Any], OIPError]
    ) -> Callable[[Request, Any], Awaitable[Response]]:
        fallback = openai_handlers[kind]

        async def handler(request: Request, exc: Any) -> Response:
            if is_oip(request):
                if kind is Exception:
                    log.exception("unhandled error")
                return to_oip(exc).response()
            return await fallback(request, exc)  # type: ignore[no-any-return]

        return handler

    app.add_exception_handler(
        APIError, wrap(APIError, lambda e: OIPError(e.status, e.message, e.headers))
    )
    app.add_exception_handler(
        StarletteHTTPException,
        wrap(StarletteHTTPException, lambda e: OIPError(e.status_code, str(e.detail))),
    )
    app.add_exception_handler(Exception, wrap(Exception, lambda e: OIPError(500, INTERNAL_ERROR)))
