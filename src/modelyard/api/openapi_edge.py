"""The served OpenAPI schema, complete enough to fuzz and to try out in `/docs`.

The gateway's inference routes take the raw `Request` (it parses the bytes itself, for speed),
so their request bodies are declared here from the same pydantic models the gateway validates
with; the management routes, which answer with plain dicts, get their answers' schemas here too
(`openapi_management.RESPONSES`). Every route that needs a key carries the `HTTPBearer`
security requirement; error responses are declared in the shape the API really answers with
(OpenAI's under /v1, the Open Inference Protocol's under /v2), in place of FastAPI's 422 that this
API never sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from modelyard.api.openapi_management import LINKS, RESPONSES
from modelyard.api.openapi_people import PEOPLE_RESPONSES
from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.oip import InferRequest
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest
from modelyard.protocol.responses_api import ResponsesRequest

MANAGEMENT_RESPONSES = {**RESPONSES, **PEOPLE_RESPONSES}

BEARER = "HTTPBearer"  # FastAPI names the scheme after the HTTPBearer class
_REF = "#/components/schemas/{model}"
RAW_BODY_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InferRequest,
    ResponsesRequest,
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
        answers = sorted(set(MANAGEMENT_RESPONSES.values()), key=lambda m: m.__name__)
        _, defs = models_json_schema([(m, "serialization") for m in answers], ref_template=_REF)
        clash = set(defs.get("$defs", {})) & set(schemas)
        assert not clash, f"response schemas named like request schemas: {clash}"
        schemas.update(defs.get("$defs", {}))
        schemas["Error"] = _OPENAI_ERROR
        schemas["OIPError"] = _OIP_ERROR
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        components.setdefault("securitySchemes", {}).setdefault(
            BEARER, {"type": "http", "scheme": "bearer"}
        )
        for path, item in schema.get("paths", {}).items():
            error = "OIPError" if path == "/v2" or path.startswith("/v2/") else "Error"
            content = {"application/json": {"schema": {"$ref": _REF.format(model=error)}}}
            for method, operation in item.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses["4XX"] = {"description": "The request was refused.", "content": content}
                answer = MANAGEMENT_RESPONSES.get((method, path))
                for code, response in responses.items():
                    if not code.startswith("2"):
                        continue
                    if answer is not None:
                        ref = {"$ref": _REF.format(model=answer.__name__)}
                        response["content"] = {"application/json": {"schema": ref}}
                    else:
                        _declare_success(path, method, response)
        _add_links(schema.get("paths", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_links(paths: dict[str, Any]) -> None:
    """OpenAPI `links` from each create's success answer to the operations on what it made."""
    for (method, path), (field, parameter, targets) in LINKS.items():
        responses = paths.get(path, {}).get(method, {}).get("responses", {})
        for code, response in responses.items():
            if not code.startswith("2"):
                continue
            links = response.setdefault("links", {})
            for target_method, target in targets:
                if target_method not in paths.get(target, {}):
                    continue
                pointer = target.replace("~", "~0").replace("/", "~1")
                name = f"{target_method}_{target.strip('/').replace('/', '_')}"
                links[name.replace("{", "").replace("}", "")] = {
                    "operationRef": f"#/paths/{pointer}/{target_method}",
                    "parameters": {parameter: f"$response.body#/{field}"},
                }


_ANY_JSON = {"type": "object", "description": "A JSON object (see the route's description)."}


def _declare_success(path: str, method: str, response: dict[str, Any]) -> None:
    """Replace FastAPI's empty `{}` schema of a route that declared none with what it sends:
    nothing (HEAD), its declared non-JSON type alone (CSV), bytes (file contents), or a JSON
    object."""
    content = response.get("content") or {}
    if content.get("application/json", {}).get("schema") != {}:
        return
    if method == "head":
        response.pop("content", None)
    elif len(content) > 1:
        del content["application/json"]
    elif path.endswith("/content"):
        response["content"] = {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
        }
    else:
        content["application/json"]["schema"] = _ANY_JSON
