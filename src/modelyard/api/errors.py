"""The platform's errors at its HTTP edge: where domain errors become HTTP answers.

`install_error_handlers` adds to the wire handlers (`modelyard.protocol.errors`) ONE handler
that turns any `DomainError` raised inside (control, batch, gateway, store) into the
OpenAI-shaped error (the Open Inference Protocol's under `/v2`) with its status and headers, and
one that answers a database outage with a 503. The kind -> status table is
`protocol.errors.STATUS_BY_KIND`, so the gateway's stream errors and the batch runner, which may
not import this package, use the same mapping (`status_of`, `body_of`); the OpenAI type comes
with the error itself (`DomainError.type`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.responses import Response

from modelyard.core.errors import DomainError
from modelyard.protocol.errors import APIError, status_of
from modelyard.protocol.errors import install_error_handlers as install_wire_error_handlers
from modelyard.protocol.oip import OIPError, is_oip_path
from modelyard.protocol.responses import JSONResponse

log = logging.getLogger(__name__)

__all__ = ["install_error_handlers", "status_of", "to_api_error"]


def to_api_error(exc: DomainError) -> APIError:
    """The OpenAI-shaped wire error for a domain error (same message, code, param, headers)."""
    return APIError.from_domain(exc)


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
