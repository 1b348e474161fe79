"""The platform's errors at its HTTP edge: the ONE place domain errors become HTTP statuses.

`install_error_handlers` adds to the wire handlers (`modelyard.protocol.errors`) a handler that
turns any `DomainError` raised inside (control, batch, gateway, store) into the OpenAI-shaped
error with its status and headers, and one that answers a database outage with a 503.
`to_api_error` is the same mapping for code paths that build a response themselves (the
gateway's handler path).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.responses import Response

from modelyard.core.errors import (
    Conflict,
    DomainError,
    Forbidden,
    Invalid,
    NotFound,
    Overloaded,
    QuotaExceeded,
    RateLimited,
    TimedOut,
    TooLarge,
    Unauthorized,
    Unavailable,
    UpstreamFailed,
)
from modelyard.protocol.errors import APIError
from modelyard.protocol.errors import install_error_handlers as install_wire_error_handlers
from modelyard.protocol.oip import OIPError, is_oip_path
from modelyard.protocol.responses import JSONResponse

log = logging.getLogger(__name__)

__all__ = ["install_error_handlers", "to_api_error"]


# The one mapping from the platform's domain errors to HTTP statuses.
STATUS_BY_ERROR: dict[type[DomainError], int] = {
    Invalid: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    RateLimited: 429,
    QuotaExceeded: 429,
    Overloaded: 503,
    Unavailable: 503,
    UpstreamFailed: 502,
    TimedOut: 504,
}


def status_of(exc: DomainError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]  # type: ignore[index]
    return 500


def to_api_error(exc: DomainError) -> APIError:
    """The OpenAI-shaped wire error for a domain error (same message, code, param, headers)."""
    return APIError(
        status_of(exc), exc.message, param=exc.param, code=exc.code, headers=dict(exc.headers)
    )


def install_error_handlers(app: FastAPI) -> None:
    install_wire_error_handlers(app)

    @app.exception_handler(DomainError)
    async def _domain_error(request: Request, exc: DomainError) -> Response:
        error = to_api_error(exc)
        if is_oip_path(request.url.path):  # the Open Inference Protocol's own error shape
            return OIPError(error.status, error.message, error.headers).response()
        return error.response()

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def _database_down(_: Request, exc: Exception) -> JSONResponse:
        # The database is unreachable (not a bug): the client may retry, no traceback per request.
        log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else repr(exc))
        return APIError(
            503,
            "The platform's database is unavailable right now; please retry shortly.",
            code="database_unavailable",
            headers={"retry-after": "5"},
        ).response()
