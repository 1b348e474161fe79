"""A new cluster leader's takeover of the replicas its predecessor left running, instead of
starting new ones (`ReplicaTakeover`, handed to `EndpointManager` by the controller role).

Which replicas ran, where (url) and as which process (pid) is in the shared routing table the
previous leader published (`control/route_publisher.py`). Before the manager starts, the role
hands the takeover those entries (`recorded`); provisioning an endpoint then first takes over
each recorded replica that was in routing (`adopt`): the backend adopts it (`Backend.adopt`), its
`/health` must answer (a few tries: a busy replica answers slowly), and the provisioner has it
join the routing table as a started replica would. A recorded replica that does not answer, or
was not in routing (starting, draining), is stopped. Only the replicas still missing are started.
The shared encoder host is not adopted: the new leader starts its own and stops the old one.

While an endpoint is being adopted it is in `adopting`, and the route publisher leaves its entry
as the previous leader wrote it: gateways keep routing to the running replicas meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

import httpx

from modelyard.control.backends.base import Backend, ReplicaSpec
from modelyard.control.state import EndpointState, Replica

log = logging.getLogger(__name__)

_HEALTH_TRIES = 3
_HEALTH_TIMEOUT_S = 5.0


class ReplicaTakeover:
    def __init__(self, backend: Backend, test_delay_s: float = 0.0) -> None:
        self.backend = backend
        self.test_delay_s = test_delay_s  # `test_adopt_delay_s`: a slow backend, in tests
        self.recorded: dict[str, list[dict[str, Any]]] = {}  # endpoint id -> its replicas
        self.adopting: set[str] = set()
        self.adopted = 0  # replicas taken over (tests, logs)

    def hold_back(self) -> None:
        """Before the manager starts: no recorded endpoint is published before it is adopted."""
        self.adopting.update(self.recorded)

    @asynccontextmanager
    async def adopt(self, state: EndpointState) -> AsyncIterator[list[Replica]]:
        """The endpoint's recorded replicas that answer, adopted by the backend (the caller has
        them serve); the endpoint stays held back from publishing until the block ends."""
        endpoint_id = state.row.id
        records = self.recorded.pop(endpoint_id, [])
        if records and not hasattr(self.backend, "adopt"):
            log.warning("backend %s cannot adopt replicas: starting new ones", self.backend)
            records = []
        if not records:
            self.adopting.discard(endpoint_id)
            yield []
            return
        self.adopting.add(endpoint_id)
        try:
            adopted = await self._healthy_replicas(state, records)
            yield adopted
            self.adopted += len(adopted)
            if adopted:
                log.info("endpoint %s: adopted %d running replica(s)", endpoint_id, len(adopted))
        finally:
            self.adopting.discard(endpoint_id)

    async def stop_orphans(self, live: Collection[str]) -> None:
        """After the manager started: recorded endpoints not in `live` (the database no longer
        has them, or their stored configuration no longer parses): nothing adopts their
        replicas, they are stopped."""
        for endpoint_id in [e for e in self.recorded if e not in live]:
            for record in self.recorded.pop(endpoint_id):
                spec = ReplicaSpec(record["id"], endpoint_id, None, "")
                handle = await self.backend.adopt(spec, record["url"], record["pid"])
                await self.backend.stop(handle, 5.0)
            self.adopting.discard(endpoint_id)

    async def _healthy_replicas(
        self, state: EndpointState, records: list[dict[str, Any]]
    ) -> list[Replica]:
        adopted: list[Replica] = []
        if self.test_delay_s:
            await asyncio.to_thread(time.sleep, self.test_delay_s)
        async with httpx.AsyncClient(timeout=_HEALTH_TIMEOUT_S) as http:
            for record in records:
                spec = _spec(state, record)
                handle = await self.backend.adopt(spec, record["url"], record["pid"])
                shared_host = record["id"].startswith("encoder-host")
                if shared_host or not record.get("ready") or not await _healthy(http, handle.url):
                    if not shared_host or self.backend.alive(handle):
                        log.info("recorded replica %s is not adopted; stopping it", record["id"])
                    await self.backend.stop(handle, 5.0)
                    continue
                adopted.append(
                    Replica(record["id"], version_id=record.get("version_id"), handle=handle)
                )
        return adopted


def _spec(state: EndpointState, record: dict[str, Any]) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=record["id"],
        endpoint_id=state.row.id,
        model_path=state.model_path,
        served_model_name=state.row.model_name,
    )


async def _healthy(http: httpx.AsyncClient, url: str) -> bool:
    for attempt in range(_HEALTH_TRIES):
        try:
            if (await http.get(url + "/health")).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if attempt + 1 < _HEALTH_TRIES:
            await asyncio.sleep(0.5)
    return False
