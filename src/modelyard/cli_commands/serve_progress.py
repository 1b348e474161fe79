"""`serve`'s load progress: a line per default model each time its status or replicas change.

The platform deploys its default models inside `Platform.start`, which runs in the server's
lifespan, so nothing answers HTTP until they have loaded; the progress is therefore read in the
serve process itself, from the control plane's endpoint views (the same views
`GET /v1/endpoints` returns), by a task on the platform's own event loop while `start` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from modelyard.cli_commands.endpoints import _replicas, _states, progress_line
from modelyard.cli_commands.output import console

Views = Callable[[], list[dict[str, Any]]]


class LoadReporter:
    def __init__(self, views: Views) -> None:
        self.views = views
        self.seen: dict[str, tuple[Any, ...]] = {}
        self.began = time.monotonic()

    def report(self) -> None:
        """Print the endpoints whose status, ready count or replica states changed."""
        for view in self.views():
            mark = (view.get("status"), _replicas(view), _states(view))
            if self.seen.get(view["endpoint_id"]) != mark:
                self.seen[view["endpoint_id"]] = mark
                console.print(progress_line(view, time.monotonic() - self.began), highlight=False)

    async def watch(self, interval: float = 0.5) -> None:
        while True:
            self.report()
            await asyncio.sleep(interval)


def report_loading(platform: Any) -> None:
    """Make `platform.start` print load progress while it runs (default models load in it),
    the last change printed before its `on_ready` banner."""
    original, announce = platform.start, platform.on_ready

    def views() -> list[dict[str, Any]]:
        service = platform.endpoints
        return [service.view(state, "") for state in list(service.endpoints.values())]

    reporter = LoadReporter(views)

    async def start() -> None:
        reporter.began = time.monotonic()
        task = asyncio.create_task(reporter.watch())
        try:
            await original()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def ready() -> None:
        reporter.report()  # the last change (ready, or failed) before the banner
        if announce is not None:
            announce()

    platform.start = start
    platform.on_ready = ready
