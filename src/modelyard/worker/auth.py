"""The worker's door: with a token set (`MODELYARD_WORKER_TOKEN`, given by the platform that
started it, see `core.cluster_auth`), every request but `/health` must carry it as a bearer,
or is refused 401 before anything else runs. A worker on a node's network address (the ray
backend) then answers the platform alone, not whoever else can reach that address."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from modelyard.config import WorkerAuthSettings
from modelyard.core.cluster_auth import bearer_matches
from modelyard.protocol.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

# The platform's probes read only liveness and load from it: nothing of any tenant.
OPEN_PATHS = frozenset({"/health"})


def configured_token() -> str | None:
    """The token this worker demands, from its settings (None: none demanded)."""
    return WorkerAuthSettings().worker_token


class RequireToken:
    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        if bearer_matches(authorization, self.token):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            error_body(
                "This worker answers only the platform that started it.",
                "authentication_error",
                None,
                "worker_token_required",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_token_check(app: Any, token: str | None) -> None:
    """Make `app` demand `token` (outermost: no work before the check); nothing if None."""
    if token:
        app.add_middleware(RequireToken, token=token)
