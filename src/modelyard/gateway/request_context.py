"""The gateway's request context (outermost ASGI middleware of the platform's app).

Every HTTP request gets the platform's own id, made here: the id of its log lines, of the usage
row of a proxied request (`Admission` takes it), of the upstream call (`x-request-id` to the
worker), and sent back in `x-request-id` on every response, errors included. A client's own
`x-request-id` is not trusted as that id (usage rows need unique ids, and a client could reuse
one to collide with another's): if it is 1-128 printable characters it is logged as
`client_request_id`, otherwise dropped. With tracing on, each API request is a trace's root
span; a client's `traceparent` is not continued, for the same reason.
"""

from __future__ import annotations

import uuid
from contextlib import nullcontext

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.core import tracing
from modelyard.core.logs import CLIENT_REQUEST_ID, REQUEST_ID, valid_request_id

REQUEST_ID_HEADER = b"x-request-id"
# Span names stay few: the inference routes by path, the rest by their first segments.
_TRACED_PREFIXES = ("/v1/", "/v2/")
_NAMED_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/batches", "/v1/files"}
)


def span_name(method: str, path: str) -> str:
    if path in _NAMED_PATHS:
        return f"{method} {path}"
    return f"{method} {'/'.join(path.split('/')[:3])}"


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return None


class GatewayRequestContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        id_token = REQUEST_ID.set(request_id)
        client_token = CLIENT_REQUEST_ID.set(valid_request_id(header(scope, REQUEST_ID_HEADER)))
        path, method = scope.get("path", ""), scope.get("method", "")
        traced = tracing.enabled() and path.startswith(_TRACED_PREFIXES)
        attributes = {"http.request.method": method, "url.path": path, "request_id": request_id}
        try:
            with (
                tracing.span(span_name(method, path), "server", attributes)
                if traced
                else nullcontext()
            ) as current:

                async def send_with_id(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        headers = list(message.get("headers", []))
                        if not any(k.lower() == REQUEST_ID_HEADER for k, _ in headers):
                            headers.append((REQUEST_ID_HEADER, request_id.encode()))
                            message = {**message, "headers": headers}
                        status = message.get("status")
                        tracing.set_attributes(current, {"http.response.status_code": status})
                    await send(message)

                await self.app(scope, receive, send_with_id)
        finally:
            CLIENT_REQUEST_ID.reset(client_token)
            REQUEST_ID.reset(id_token)
