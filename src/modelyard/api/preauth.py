"""Authenticate the caller, and check the route's scope, before any request body is read.

FastAPI reads and parses a route's body (JSON, multipart uploads) before it solves the route's
dependencies, so a stranger's 40 MB upload would be read whole before the 401. This ASGI
middleware holds the body back: the first time the app asks for it, the router has chosen the
route (`scope["route"]`), and for every route that depends on `deps.get_principal` the
Authorization header is authenticated and the scope the route demands (`get_admin`,
`get_inference`) checked first. A refusal is answered in place of whatever the app says after
its body read fails, without one byte of the body read. The principal is left in the request
state for `get_principal`. Routes without that dependency (the gateway's inference routes,
which authenticate before reading, and the public ones) and routes that read no body pass
through as they are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.api.deps import SCOPE_OF_DEPENDENCY, get_principal
from modelyard.api.errors import to_api_error
from modelyard.core.errors import DomainError
from modelyard.core.identity import Principal
from modelyard.protocol.errors import APIError

Authenticate = Callable[[str | None], Awaitable[Principal]]


@dataclass(frozen=True)
class _Need:
    scopes: tuple[str, ...] | None  # any one of them; None: any valid key


def _need_of(dependant: Dependant) -> _Need | None:
    """What a route's dependency tree demands of the caller, or None for a public route."""
    calls: set[Any] = set()
    stack = [dependant]
    while stack:
        d = stack.pop()
        calls.add(d.call)
        stack.extend(d.dependencies)
    if get_principal not in calls:
        return None
    scopes = [scopes for call, scopes in SCOPE_OF_DEPENDENCY.items() if call in calls]
    return _Need(scopes[0] if scopes else None)


class _Refused(Exception):
    pass


class PreAuthenticate:
    def __init__(self, app: ASGIApp, authenticate: Authenticate) -> None:
        self.app = app
        self.authenticate = authenticate
        self._needs: dict[int, _Need | None] = {}  # by id(route); routes live as long as the app

    def _need(self, scope: Scope) -> _Need | None:
        route = scope.get("route")
        if not isinstance(route, APIRoute):
            return None
        key = id(route)
        if key not in self._needs:
            self._needs[key] = _need_of(route.dependant)
        return self._needs[key]

    async def _check(self, scope: Scope) -> None:
        """Authenticate and check the scope for the chosen route; raise a `DomainError`
        if refused."""
        need = self._need(scope)
        if need is None:
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        principal = await self.authenticate(authorization)
        if need.scopes is not None:
            principal.require_any(need.scopes)
        scope.setdefault("state", {})["principal"] = principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        checked = False
        refusal: APIError | None = None
        answered = False

        async def checked_receive() -> Message:
            nonlocal checked, refusal
            if not checked:
                checked = True
                try:
                    await self._check(scope)
                except DomainError as exc:  # no key, a bad one, keys uncheckable, a missing scope
                    refusal = to_api_error(exc)
                    raise _Refused from None
            return await receive()

        async def answer() -> None:
            nonlocal answered
            if not answered and refusal is not None:
                answered = True
                await refusal.response()(scope, receive, send)

        async def guarded_send(message: Message) -> None:
            if refusal is not None:
                # The app caught the refusal as a failed body read (FastAPI makes it a 400):
                # answer the refusal instead.
                await answer()
                return
            await send(message)

        try:
            await self.app(scope, checked_receive, guarded_send)
        except _Refused:
            await answer()
