"""Control requests reach the leading controller (cluster mode): an ASGI middleware that sends
the routes which change or read the control plane's state (deploy, endpoints and their versions,
the registry and its blobs, files and batches, devices) on to the leader, unless this process
leads. Everything else (inference, keys, tenants, usage, audit) is served where it arrives.

Forwarding, not a database write the leader picks up later: the leader checks the request and
answers it as `serve` would (a 400 names the field, a 202 carries the endpoint id), and what it
did is in its routing table, which it publishes at once. The request goes on as it came (method,
path, query, headers, body streamed both ways), marked `x-modelyard-forwarded` so it is never
forwarded twice (a request reaching a process that no longer leads, during a takeover, is a 503
with Retry-After).

A takeover is not the client's problem when it is short: a request that finds no leader, or a
leader that refuses the connection (it died; nothing of the request was sent), waits for the
next leader to be advertised, up to `takeover_wait_s` (the controller lease: a crashed leader's
successor leads within a fraction of it), and goes there; only then is it a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
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
_LEADER_POLL_S = 0.2


class ControlForward:
    def __init__(
        self,
        app: Any,
        leads: Callable[[], bool],
        leader_url: Callable[[], Awaitable[str | None]],
        forget_leader: Callable[[], None] = lambda: None,
        takeover_wait_s: float = 0.0,
        timeout_s: float = 600.0,
    ) -> None:
        self.app = app
        self.leads = leads
        self.leader_url = leader_url
        self.forget_leader = forget_leader
        self.takeover_wait_s = takeover_wait_s
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=3.0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(CONTROL_PREFIXES) or self.leads():
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        if any(k == FORWARDED for k, _ in headers):
            await _unavailable(send, "this controller no longer leads (a takeover is under way)")
            return
        query = scope.get("query_string", b"").decode()
        target = path + (f"?{query}" if query else "")
        body = _Body(receive)
        deadline = time.monotonic() + self.takeover_wait_s
        while True:
            url = await self.leader_url()
            if url is not None:
                request = self._http.build_request(
                    scope["method"],
                    url.rstrip("/") + target,
                    headers=[*headers, (FORWARDED, b"1")],
                    content=body.stream(),
                )
                try:
                    response = await self._http.send(request, stream=True)
                    break
                except httpx.ConnectError:
                    self.forget_leader()  # it died; nothing of the request reached it
                except httpx.TransportError:
                    self.forget_leader()
                    await _unavailable(send, "the leading controller did not answer")
                    return
            if body.started or time.monotonic() >= deadline:
                await _unavailable(send, "no controller leads right now (a takeover is under way)")
                return
            await asyncio.sleep(_LEADER_POLL_S)
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


class _Body:
    """The request body, streamed once; `started` says whether a try has read any of it (a
    request whose body is partly sent is never tried again)."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.started = False

    async def stream(self) -> AsyncIterator[bytes]:
        self.started = True
        while True:
            message = await self.receive()
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
