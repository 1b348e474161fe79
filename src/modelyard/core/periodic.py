"""`Periodic`: one piece of background work run every few seconds as one task until stopped
(the cluster's load and outcome reports and their readers); a failed round is logged and the
next one goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class Periodic:
    """Runs `work` every `every_s` seconds (after its first wait when `wait_first`); a round
    that raises is logged on `log` as "`failed`: the error"."""

    def __init__(
        self,
        work: Callable[[], Awaitable[object]],
        every_s: float,
        name: str,
        failed: str,
        log: logging.Logger,
        *,
        wait_first: bool = False,
    ) -> None:
        self.work = work
        self.every_s = every_s
        self.name = name
        self.failed = failed
        self.log = log
        self.wait_first = wait_first
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        if self.wait_first:
            await asyncio.sleep(self.every_s)
        while True:
            try:
                await self.work()
            except Exception as exc:
                self.log.warning("%s: %s", self.failed, exc)
            await asyncio.sleep(self.every_s)
