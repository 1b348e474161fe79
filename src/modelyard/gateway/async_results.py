"""Answers for clients that asked not to wait (`Prefer: respond-async`) while a model loads.

The request gets 202 and a polling URL at once; it runs in the background and its answer is
kept (per tenant) for `ttl_s` seconds for `GET /v1/async/{id}`: its response, or the domain
error it failed with, raised again to the poll so the platform's edge answers it as it would
have answered the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from modelyard.core.errors import DomainError, NotFound
from modelyard.protocol.responses import JSONResponse


@dataclass
class _Entry:
    tenant_id: str
    created: float = field(default_factory=time.monotonic)
    response: Response | None = None
    error: DomainError | None = None
    task: asyncio.Task[None] | None = None


class AsyncResults:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}

    def _sweep(self) -> None:
        horizon = time.monotonic() - self.ttl_s
        for key in [k for k, e in self._entries.items() if e.created < horizon]:
            entry = self._entries.pop(key)
            if entry.task is not None and not entry.task.done():
                entry.task.cancel()

    def submit(
        self, tenant_id: str, request_id: str, work: Callable[[], Awaitable[Response]]
    ) -> Response:
        self._sweep()
        entry = _Entry(tenant_id)

        async def run() -> None:
            try:
                entry.response = await work()
            except DomainError as exc:  # kept as the answer the client polls for
                entry.error = exc

        entry.task = asyncio.create_task(run())
        self._entries[request_id] = entry
        return JSONResponse(
            self._status(request_id, "in_progress"),
            status_code=202,
            headers={"x-request-id": request_id, "location": f"/v1/async/{request_id}"},
        )

    @staticmethod
    def _status(request_id: str, status: str) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "async_response",
            "status": status,
            "poll_url": f"/v1/async/{request_id}",
        }

    def get(self, tenant_id: str, request_id: str) -> Response:
        entry = self._entries.get(request_id)
        if entry is None or entry.tenant_id != tenant_id:
            raise NotFound(f"no pending result {request_id!r}", code="not_found")
        if entry.error is not None:
            raise entry.error.with_traceback(None)  # a fresh traceback per poll, not a growing one
        if entry.response is None:
            return JSONResponse(
                self._status(request_id, "in_progress"), status_code=202,
                headers={"retry-after": "1"},
            )  # fmt: skip
        return entry.response
