"""ASGI middleware shared by the HTTP apps: request body size limit (413 in OpenAI's shape)."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.protocol.errors import error_body


class BodySizeLimit:
    """Reject bodies larger than `max_bytes`, by Content-Length or while they stream in.

    `path_limits` gives other limits to path prefixes (artifact uploads take gigabytes).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    def _limit(self, path: str) -> int:
        for prefix, limit in self.path_limits.items():
            if path.startswith(prefix):
                return limit
        return self.max_bytes

    async def _reject(self, send: Send, limit: int) -> None:
        body = orjson.dumps(
            error_body(
                f"Request body is larger than the limit of {limit} bytes.",
                "invalid_request_error",
                None,
                "request_too_large",
            )
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope.get("path", ""))
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._reject(send, limit)
                return
        received = 0
        too_large = False
        started = False  # the app's own response has begun
        rejected = False  # our 413 has been sent

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise _TooLarge
            return message

        async def reject() -> None:
            nonlocal rejected
            if not rejected:
                rejected = True
                await self._reject(send, limit)

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if too_large and not started:
                # The app caught the overflow while parsing (FastAPI turns any failure to read
                # a typed body into a 400): answer 413 instead of whatever it says.
                await reject()
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await reject()
        except Exception:
            if too_large and not started:
                await reject()
            else:
                raise


class _TooLarge(Exception):
    pass
