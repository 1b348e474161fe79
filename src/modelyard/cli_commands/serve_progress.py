"""`serve`'s load progress: a line per default model each time its status or replicas change.

The platform answers HTTP while its default models deploy in the background, so the progress
is read as any client reads it: `GET /v1/endpoints` with the admin key, polled until the
platform says the models have loaded; then the banner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from modelyard.cli_commands.endpoint_tables import progress_line
from modelyard.cli_commands.endpoints import _replicas, _states
from modelyard.cli_commands.output import console


class LoadReporter:
    def __init__(self) -> None:
        self.seen: dict[str, tuple[Any, ...]] = {}
        self.began = time.monotonic()

    def report(self, views: list[dict[str, Any]]) -> None:
        """Print the endpoints whose status, ready count or replica states changed."""
        for view in views:
            mark = (view.get("status"), _replicas(view), _states(view))
            if self.seen.get(view["endpoint_id"]) != mark:
                self.seen[view["endpoint_id"]] = mark
                console.print(progress_line(view, time.monotonic() - self.began), highlight=False)

    async def poll(self, client: httpx.AsyncClient) -> bool:
        """Report the endpoints' current views; False while the server does not answer yet
        (this starts before uvicorn listens)."""
        try:
            answer = await client.get("/v1/endpoints")
            answer.raise_for_status()
        except httpx.HTTPError:
            return False
        self.report(answer.json()["data"])
        return True


async def report_loading(
    url: str, admin_key: str, loaded: Awaitable[None], then: Callable[[], None]
) -> None:
    """Print load progress until `loaded` completes, then the last change, then `then()` (the
    banner). Nothing more if the platform stops first."""
    reporter = LoadReporter()
    waiting = asyncio.ensure_future(loaded)
    headers = {"authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10.0) as client:
        while True:
            answered = await reporter.poll(client)
            if waiting.done() and answered:
                break
            if waiting.cancelled():
                return
            await asyncio.wait({waiting}, timeout=0.5)
    then()
