"""Cancel a request's work when its HTTP client goes away (Starlette does not, for plain bodies)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from modelyard.protocol.errors import APIError

T = TypeVar("T")


async def run_until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise a 499 `APIError`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", code="client_disconnected")
    finally:
        if not task.done():
            task.cancel()
