"""A new cluster leader's takeover of the replicas its predecessor left running, instead of
starting new ones (`ReplicaTakeover`, handed to `EndpointManager` by the controller role).

Which replicas ran, where (url) and as which process (pid) is in the shared routing table the
previous leader published (`control/route_publisher.py`). Before the manager starts, the role
hands the takeover those entries (`recorded`); provisioning an endpoint then first takes over
each recorded replica that was in routing (`adopt`): the backend adopts it (`Backend.adopt`), its
`/health` must answer (a few tries: a busy replica answers slowly), and the provisioner has it
join the routing table as a started replica would. A recorded replica that does not answer, or
was not in routing (starting, draining), is stopped. Only the replicas still missing are started.
The shared encoder host is adopted by the new leader's encoder pool (`adopt_encoder_host`): its
endpoints stay held back (their previous entries keep routing to the running host) until each
has registered its model again (`release`); a host the pool does not take is stopped.

While an endpoint is being adopted it is in `adopting`, and the route publisher leaves its entry
as the previous leader wrote it: gateways keep routing to the running replicas meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
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
        # The encoder pool's `adopt` (url, pid, backend replica id) -> whether it serves from
        # that host; set by the endpoint manager. None: the host is stopped.
        self.adopt_encoder_host: Callable[[str, int | None, str | None], Awaitable[bool]] | None
        self.adopt_encoder_host = None
        self.hosted: set[str] = set()  # endpoints on the adopted encoder host, still held back

    def pending_urls(self) -> list[str]:
        """Where the recorded replicas not taken over yet run (they are heartbeated meanwhile,
        `control/owner_heartbeat.py`)."""
        return [r["url"] for records in list(self.recorded.values()) for r in records]

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
            if endpoint_id not in self.hosted:
                self.adopting.discard(endpoint_id)

    def release(self, endpoint_id: str) -> None:
        """An endpoint on the adopted encoder host has registered its model again (or failed
        to): its entry may be published."""
        if endpoint_id in self.hosted:
            self.hosted.discard(endpoint_id)
            self.adopting.discard(endpoint_id)

    async def stop_orphans(self, live: Collection[str]) -> None:
        """After the manager started: recorded endpoints not in `live` (the database no longer
        has them, or their stored configuration no longer parses): nothing adopts their
        replicas, they are stopped."""
        for endpoint_id in [e for e in self.recorded if e not in live]:
            for record in self.recorded.pop(endpoint_id):
                if _shared_host(record):
                    continue  # the encoder pool's, if adopted; else its watchdog ends it
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
                if _shared_host(record):
                    await self._take_encoder_host(state, record)
                    continue
                handle = await self.backend.adopt(
                    _spec(state, record), record["url"], record["pid"]
                )
                if not record.get("ready") or not await _healthy(http, handle.url):
                    log.info("recorded replica %s is not adopted; stopping it", record["id"])
                    await self.backend.stop(handle, 5.0)
                    continue
                adopted.append(
                    Replica(record["id"], version_id=record.get("version_id"), handle=handle)
                )
        return adopted

    async def _take_encoder_host(self, state: EndpointState, record: dict[str, Any]) -> None:
        """The shared encoder host the record names: the encoder pool's from now on (the
        endpoint held back until it registered its model there again), else stopped."""
        adopt = self.adopt_encoder_host
        host_id = record.get("host_id")
        ready = adopt is not None and bool(record.get("ready"))
        if ready and await adopt(record["url"], record.get("pid"), host_id):  # type: ignore[misc]
            self.hosted.add(state.row.id)
            return
        spec = ReplicaSpec(host_id or record["id"], "encoder-host", None, "", command="encoders")
        handle = await self.backend.adopt(spec, record["url"], record["pid"])
        if self.backend.alive(handle):
            log.info("recorded encoder host %s is not adopted; stopping it", record["url"])
        await self.backend.stop(handle, 5.0)


def _shared_host(record: dict[str, Any]) -> bool:
    return str(record["id"]).startswith("encoder-host")


def _spec(state: EndpointState, record: dict[str, Any]) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=record["id"],
        endpoint_id=state.row.id,
        model_path=state.model_path,
        served_model_name=state.row.model_name,
        workload=str(state.row.hardware.get("workload", "real-time")),
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
