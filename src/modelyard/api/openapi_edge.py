"""The served OpenAPI schema, complete enough to fuzz and to try out in `/docs`.

The gateway's inference routes take the raw `Request` (it parses the bytes itself, for speed),
so their request bodies are declared here from the same pydantic models the gateway validates
with. Every route that needs a key carries the `HTTPBearer` security requirement; error
responses are declared in the shape the API really answers with (OpenAI's under /v1, the Open
Inference Protocol's under /v2), in place of FastAPI's 422 that this API never sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.oip import InferRequest
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest

BEARER = "HTTPBearer"  # FastAPI names the scheme after the HTTPBearer class
_REF = "#/components/schemas/{model}"
RAW_BODY_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InferRequest,
)

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_OIP_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` from a raw JSON body, with bearer auth."""
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "security": [{BEARER: []}],
    }


# `openapi_extra` for raw-Request routes that need a key but take no JSON body.
BEARER_ONLY: dict[str, Any] = {"security": [{BEARER: []}]}
# Bearer auth is optional (details for the platform admin).
BEARER_OPTIONAL: dict[str, Any] = {"security": [{}, {BEARER: []}]}


def install_openapi(app: FastAPI) -> None:
    """Wrap `app.openapi` to add the raw bodies' schemas and the real error responses."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        _, defs = models_json_schema(
            [(m, "validation") for m in RAW_BODY_MODELS], ref_template=_REF
        )
        schemas.update(defs.get("$defs", {}))
        schemas["Error"] = _OPENAI_ERROR
        schemas["OIPError"] = _OIP_ERROR
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        components.setdefault("securitySchemes", {}).setdefault(
            BEARER, {"type": "http", "scheme": "bearer"}
        )
        for path, item in schema.get("paths", {}).items():
            error = "OIPError" if path.startswith("/v2/") else "Error"
            content = {"application/json": {"schema": {"$ref": _REF.format(model=error)}}}
            for operation in item.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses["4XX"] = {"description": "The request was refused.", "content": content}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
