"""The leader's heartbeat to the replicas it owns (cluster mode), so that none outlives its
cluster: every third of a lease, `PUT /admin/owner` (with the worker token) to every replica the
backend started or adopted and has not stopped: serving, starting, draining, the warm pool's,
the encoder host. A replica that hears none for `replica_owner_leases` leases exits on its own
(`core/owner_watch.py`). A standby that takes over adopts the replicas and resumes the
heartbeats; one that does not adopt a replica stops it.

Until a new leader has adopted them, the replicas its predecessor recorded are heartbeated too
(`pending`: the takeover's records not yet taken), so a takeover of many endpoints that takes
longer than the timeout loses none of them.

Runs while the endpoint manager runs (the leader's), only with a backend whose replicas have
a watchdog (`Backend.owner_timeout_s`: the controller role's detached backends). A replica that
does not answer is no concern of this loop: health and takeover deal with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import Backend
from modelyard.core.cluster_auth import replica_headers
from modelyard.core.owner_watch import HEARTBEAT_PATH, heartbeat_interval_s

log = logging.getLogger(__name__)

_CONCURRENCY = 64  # heartbeats in flight at once


class OwnerHeartbeat:
    def __init__(
        self,
        settings: PlatformSettings,
        backend: Backend,
        pending: Callable[[], list[str]] = list,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.pending = pending  # URLs of replicas recorded by the previous leader, not adopted yet
        self.interval_s = heartbeat_interval_s(settings)
        self.sent = 0  # heartbeats answered (tests, logs)
        self._http: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.backend.owner_timeout_s is None:
            return  # its replicas die with this process: nothing to keep alive
        self._http = httpx.AsyncClient(
            timeout=max(1.0, self.interval_s), headers=replica_headers(self.settings)
        )
        self._task = asyncio.create_task(self._run(), name="owner-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _run(self) -> None:
        gate = asyncio.Semaphore(_CONCURRENCY)
        while True:
            urls = {h.url for h in self.backend.owned()} | set(self.pending())
            await asyncio.gather(*(self._beat(gate, url) for url in urls))
            await asyncio.sleep(self.interval_s)

    async def _beat(self, gate: asyncio.Semaphore, url: str) -> None:
        assert self._http is not None
        async with gate:
            try:
                r = await self._http.put(url + HEARTBEAT_PATH)
            except httpx.HTTPError:
                return  # starting, or gone: the health check's concern
            if r.status_code == 200:
                self.sent += 1
