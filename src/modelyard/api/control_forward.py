"""Control requests reach the leading controller (cluster mode): an ASGI middleware that sends
the routes which change or read the control plane's state (deploy, endpoints and their versions,
the registry and its blobs, files and batches, devices) on to the leader, unless this process
leads. Everything else (inference, keys, tenants, usage, audit) is served where it arrives.

Forwarding, not a database write the leader picks up later: the leader checks the request and
answers it as `serve` would (a 400 names the field, a 202 carries the endpoint id), and what it
did is in its routing table, which it publishes at once. The request goes on as it came (method,
path, query, headers, body streamed both ways), marked `x-modelyard-forwarded` so it is never
forwarded twice (a request reaching a process that no longer leads, during a takeover, is a 503
with Retry-After, as is one arriving while no controller leads).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from modelyard.protocol.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

CONTROL_PREFIXES = (
    "/v1/models/deploy",
    "/v1/endpoints",
    "/v1/registry",
    "/v1/blobs",
    "/v1/files",
    "/v1/batches",
    "/v1/devices",
)
FORWARDED = b"x-modelyard-forwarded"
_HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te"}
_RETRY_AFTER_S = 3


class ControlForward:
    def __init__(
        self,
        app: Any,
        leads: Callable[[], bool],
        leader_url: Callable[[], Awaitable[str | None]],
        forget_leader: Callable[[], None] = lambda: None,
        timeout_s: float = 600.0,
    ) -> None:
        self.app = app
        self.leads = leads
        self.leader_url = leader_url
        self.forget_leader = forget_leader
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=3.0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(CONTROL_PREFIXES) or self.leads():
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        url = None if any(k == FORWARDED for k, _ in headers) else await self.leader_url()
        if url is None:
            await _unavailable(send, "no controller leads right now (a takeover is under way)")
            return
        query = scope.get("query_string", b"").decode()
        request = self._http.build_request(
            scope["method"],
            url.rstrip("/") + path + (f"?{query}" if query else ""),
            headers=[*headers, (FORWARDED, b"1")],
            content=_body(receive),
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError:
            self.forget_leader()
            await _unavailable(send, "the leading controller did not answer")
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _unavailable(send: Send, why: str) -> None:
    body = json.dumps(
        error_body(f"{why}; please retry shortly.", "service_unavailable", None, "no_leader")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"retry-after", str(_RETRY_AFTER_S).encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
