"""The endpoint manager of a leading controller (cluster mode): as `serve`'s, except that a new
leader adopts the replicas its predecessor left running instead of starting new ones.

Which replicas ran, where (url) and as which process (pid) is in the shared routing table the
previous leader published (`control/route_publisher.py`). Before `start`, the role hands the
manager those entries (`recorded`); provisioning an endpoint then first takes over each recorded
replica that was in routing: the backend adopts it (`Backend.adopt`), its `/health` must answer
(a few tries: a busy replica answers slowly), and it joins the routing table as a started replica
would. A recorded replica that does not answer, or was not in routing (starting, draining), is
stopped. Only the replicas still missing are started. The shared encoder host is not adopted:
the new leader starts its own and stops the old one.

While an endpoint is being adopted it is `adopting`, and the route publisher leaves its entry as
the previous leader wrote it: gateways keep routing to the running replicas meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from modelyard.control.backends.base import ReplicaSpec
from modelyard.control.endpoints import EndpointManager
from modelyard.control.state import EndpointState, Replica

log = logging.getLogger(__name__)

_HEALTH_TRIES = 3
_HEALTH_TIMEOUT_S = 5.0


class ClusterEndpointManager(EndpointManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: dict[str, list[dict[str, Any]]] = {}  # endpoint id -> its replicas
        self.adopting: set[str] = set()
        self.adopted = 0  # replicas taken over (tests, logs)

    async def start(self) -> None:
        # Held back from publishing before any entry could be written.
        self.adopting.update(self.recorded)
        await super().start()
        # Recorded endpoints the database no longer has live, or whose stored configuration no
        # longer parses: nothing adopts their replicas.
        for endpoint_id in [
            e for e in self.recorded if e not in self.endpoints or e in self.refused
        ]:
            await self._stop_recorded(endpoint_id, self.recorded.pop(endpoint_id))
            self.adopting.discard(endpoint_id)

    async def _provision(self, state: EndpointState) -> None:  # type: ignore[override]
        endpoint_id = state.row.id
        records = self.recorded.pop(endpoint_id, [])
        if records and not hasattr(self.backend, "adopt"):
            log.warning("backend %s cannot adopt replicas: starting new ones", self.backend)
            records = []
        if not records:
            self.adopting.discard(endpoint_id)
            await super()._provision(state)
            return
        self.adopting.add(endpoint_id)
        try:
            adopted = await self._adopt_replicas(state, records)
        finally:
            self.adopting.discard(endpoint_id)
        want = state.desired
        current = sum(r.version_id == state.row.version_id for r in adopted)
        # The base provisioning prepares the model files and starts what is still missing.
        state.desired = max(0, want - current)
        try:
            await super()._provision(state)
        finally:
            state.desired = max(want, current)

    async def _adopt_replicas(
        self, state: EndpointState, records: list[dict[str, Any]]
    ) -> list[Replica]:
        adopted: list[Replica] = []
        async with httpx.AsyncClient(timeout=_HEALTH_TIMEOUT_S) as http:
            for record in records:
                handle = self.backend.adopt(self._spec(state, record), record["url"], record["pid"])
                shared_host = record["id"].startswith("encoder-host")
                if shared_host or not record.get("ready") or not await _healthy(http, handle.url):
                    if not shared_host or self.backend.alive(handle):
                        log.info("recorded replica %s is not adopted; stopping it", record["id"])
                    await self.backend.stop(handle, 5.0)
                    continue
                replica = Replica(record["id"], version_id=record.get("version_id"), handle=handle)
                state.replicas.append(replica)
                await self.replicas.serve(state, replica)
                self.versions.started(state, replica)
                adopted.append(replica)
        self.adopted += len(adopted)
        if adopted:
            log.info("endpoint %s: adopted %d running replica(s)", state.row.id, len(adopted))
            await self.statuses.refresh(state)
        return adopted

    async def _stop_recorded(self, endpoint_id: str, records: list[dict[str, Any]]) -> None:
        for record in records:
            spec = ReplicaSpec(record["id"], endpoint_id, None, "")
            await self.backend.stop(self.backend.adopt(spec, record["url"], record["pid"]), 5.0)

    @staticmethod
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
