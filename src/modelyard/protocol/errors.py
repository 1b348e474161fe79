"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

An `APIError` is a wire error: an HTTP status and the OpenAI error body, raised only at HTTP
edges (the platform's routes, the worker apps); gateway, control and batch raise domain errors
(`modelyard.core.errors`) instead, which carry their OpenAI type, and an edge shapes them here:
`STATUS_BY_KIND` and `APIError.from_domain` (the batch runner's per-item status and body too,
`status_of` and `body_of`). `install_error_handlers` maps the framework's own failures
(validation, malformed JSON, unknown routes) onto the same shape; the platform's app adds its
own handlers (domain errors, database outages) in `modelyard.api.errors`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from modelyard.protocol.responses import JSONResponse

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# The one table from a domain error's kind (`modelyard.core.errors`) to its HTTP status.
STATUS_BY_KIND = {
    "invalid": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "too_large": 413,
    "rate_limited": 429,
    "quota_exceeded": 429,
    "upstream_failed": 502,
    "overloaded": 503,
    "unavailable": 503,
    "timed_out": 504,
}


class DomainLike(Protocol):
    """What an edge reads from a domain error (`modelyard.core.errors.DomainError`)."""

    kind: str
    type: str
    message: str
    code: str | None
    param: str | None
    headers: dict[str, str]


INTERNAL_ERROR = "The server had an error while processing your request. Sorry about that!"


# The code of a request whose own structured-output grammar failed inside an engine step: the
# client's fault (a 400, or a stream's error event), never counted against the replica.
GRAMMAR_FAILED = "structured_output_failed"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_domain(cls, exc: DomainLike) -> APIError:
        """The wire error for a domain error: its kind's status, same OpenAI type, message,
        code, param and headers."""
        return cls(
            status_of(exc),
            exc.message,
            type=exc.type,
            param=exc.param,
            code=exc.code,
            headers=dict(exc.headers),
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def status_of(exc: DomainLike) -> int:
    """The HTTP status of a domain error's kind."""
    return STATUS_BY_KIND.get(exc.kind, 500)


def body_of(exc: DomainLike) -> dict[str, Any]:
    """The OpenAI error body of a domain error (a stream's error event, a batch item's)."""
    return error_body(exc.message, exc.type, exc.param, exc.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def field_path(loc: Sequence[Any]) -> str | None:
    """A pydantic error location as OpenAI writes a `param`: `messages[0].content`."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def validation_failure(errors: Sequence[Any]) -> tuple[str, str | None, str]:
    """(message, param, code) of the 400 for pydantic's (or FastAPI's) list of validation
    errors: the first one, by name. The gateway raises them as a domain `Invalid`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        msg = first.get("msg", "invalid JSON")
        return f"We could not parse the JSON body of your request: {msg}", None, "invalid_json"
    param = field_path(first.get("loc", ()))
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    message = first.get("msg", "invalid request")
    if param:
        message = f"Invalid value for '{param}': {message}"
    return message, param, "invalid_value"


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for pydantic's (or FastAPI's) list of validation errors (`validation_failure`)."""
    message, param, code = validation_failure(errors)
    return bad_request(message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = "Unknown request URL. Please check the URL and method."
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # The exception's text stays in the log: it can name tables, paths or other tenants' data.
        return APIError(500, INTERNAL_ERROR).response()
