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

A hung leader (paused, its loop stuck) is not waited on for long: when no answer has come after
`timeout_s` (`control_forward_timeout_s`), the leader's `/health` is asked, with as long again.
A leader that answers is busy (an S3 import in a deploy) and is waited for, up to `max_wait_s`;
one that does not is left, and the request goes once to the next leader advertised (never to
the same address again), or is a retryable 503. Only a request whose body was kept (none, or
up to 1 MiB with its length declared) is sent twice; a streamed upload is not. A request the
hung leader reads after it wakes past its lease is refused there (it no longer leads), so the
retry does not run it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from modelyard.protocol.errors import error_body

log = logging.getLogger(__name__)

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
_KEPT_BODY_MAX = 2**20  # a body up to this is read before sending, so it can be sent again


class ControlForward:
    def __init__(
        self,
        app: Any,
        leads: Callable[[], bool],
        leader_url: Callable[[], Awaitable[str | None]],
        forget_leader: Callable[[], None] = lambda: None,
        takeover_wait_s: float = 0.0,
        timeout_s: float = 5.0,
        max_wait_s: float = 600.0,
    ) -> None:
        self.app = app
        self.leads = leads
        self.leader_url = leader_url
        self.forget_leader = forget_leader
        self.takeover_wait_s = takeover_wait_s
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        connect = min(3.0, timeout_s)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(max_wait_s, connect=connect))
        self._probe = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect))

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
        body = await _Body.read(receive, scope["headers"])
        response = await self._forward(scope["method"], target, headers, body)
        if response is None:
            await _unavailable(send, "no controller leads right now (a takeover is under way)")
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

    async def _forward(
        self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: _Body
    ) -> httpx.Response | None:
        """The leader's answer (headers read), or None: no leader answered (see the module's
        docstring for who is waited for and who is tried again)."""
        deadline = time.monotonic() + self.takeover_wait_s
        hung: set[str] = set()  # leaders that did not answer: never tried again
        while True:
            url = await self.leader_url()
            if url is not None and url not in hung:
                request = self._http.build_request(
                    method,
                    url.rstrip("/") + target,
                    headers=[*headers, (FORWARDED, b"1")],
                    content=body.content(),
                )
                try:
                    response = await self._answer(url, request)
                except httpx.ConnectError:
                    self.forget_leader()  # it died; nothing of the request reached it
                except (TimeoutError, httpx.TransportError) as exc:
                    self.forget_leader()
                    log.warning("the leader at %s did not answer a control request: %r", url, exc)
                    if not body.kept or hung:
                        return None  # a streamed body cannot be sent again; one retry only
                    hung.add(url)
                    deadline = time.monotonic() + self.takeover_wait_s
                else:
                    return response
            if (body.started and not body.kept) or time.monotonic() >= deadline:
                return None
            await asyncio.sleep(_LEADER_POLL_S)

    async def _answer(self, url: str, request: httpx.Request) -> httpx.Response:
        """Send and wait for the answer's headers while the leader lives: after each
        `timeout_s` without them its /health must answer (within `timeout_s`), else it is hung
        (TimeoutError)."""
        sending = asyncio.ensure_future(self._http.send(request, stream=True))
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=self.timeout_s)
                if done:
                    return sending.result()
                if time.monotonic() - started >= self.max_wait_s or not await self._alive(url):
                    raise TimeoutError(f"no answer in {time.monotonic() - started:.1f}s")
        except BaseException:
            sending.cancel()
            with contextlib.suppress(BaseException):
                response = await sending
                await response.aclose()
            raise

    async def _alive(self, url: str) -> bool:
        try:
            return (await self._probe.get(url.rstrip("/") + "/health")).status_code == 200
        except httpx.HTTPError:
            return False


class _Body:
    """The request body: kept in memory when small and declared (so a try that found a hung
    leader can be repeated), streamed once otherwise; `started` says whether a try has read any
    of a streamed one (then it is never tried again)."""

    def __init__(self, receive: Receive, kept: bytes | None) -> None:
        self.receive = receive
        self.kept = kept is not None
        self._bytes = kept or b""
        self.started = False

    @classmethod
    async def read(cls, receive: Receive, headers: list[tuple[bytes, bytes]]) -> _Body:
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        chunked = any(k.lower() == b"transfer-encoding" for k, _ in headers)
        if length is None and chunked:
            return cls(receive, None)
        if length is not None and (not length.isdigit() or int(length) > _KEPT_BODY_MAX):
            return cls(receive, None)
        parts: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            parts.append(message.get("body", b""))
            if not message.get("more_body", False) or sum(map(len, parts)) > _KEPT_BODY_MAX:
                break
        return cls(receive, b"".join(parts))

    def content(self) -> bytes | AsyncIterator[bytes]:
        return self._bytes if self.kept else self.stream()

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
