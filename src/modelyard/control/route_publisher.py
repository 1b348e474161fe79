"""The leading controller's routing table, published to PostgreSQL for the gateways (cluster
mode): each endpoint's entry, written with a new generation whenever it changes, and a
notification (PostgreSQL NOTIFY, same transaction) that wakes the gateways' mirrors.

The controller's own `RoutingTable` stays the source: the control plane writes it through its
verbs as in `serve`, and this publisher diffs it. Every `interval_s` it looks whether the table's
generation moved (or a full `full_every_s` passed) and, if so, builds every endpoint's entry and
writes those that differ from what it last wrote, one transaction for all. An endpoint that left
the table (deleted) gets a tombstone (`removed`), so gateways stop routing to it. Endpoints the
new leader is still adopting are left out until their replicas are known again, so a takeover
never publishes an entry with no replicas for an endpoint that is serving.

Generations continue from the table's highest one, so a new leader's writes are newer than its
predecessor's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from modelyard.control.state import EndpointState
from modelyard.core.routing import RoutingTable
from modelyard.store import routing_entries as entries
from modelyard.store.db import Database

log = logging.getLogger(__name__)


def entry_of(state: EndpointState) -> dict[str, Any]:
    """What a gateway needs to route to the endpoint, and what a new leader needs to adopt its
    replicas (their pids)."""
    route = state.route
    # By address: the shared encoder host's route is named apart from the endpoint's replica.
    pids = {r.handle.url: r.handle.pid for r in state.replicas if r.handle is not None}
    # The backend's own name of the process (the encoder host's replica id; on Ray its actor).
    hosts = {r.handle.url: r.handle.spec.replica_id for r in state.replicas if r.handle}
    return {
        "endpoint_id": route.endpoint_id,
        "tenant_id": route.tenant_id,
        "model_name": route.model_name,
        "public": route.public,
        "version_id": route.version_id,
        "max_tokens_cap": route.max_tokens_cap,
        "upstream_model": route.upstream_model,
        "sampling_defaults": dict(route.sampling_defaults),
        "lora_dir": route.lora_dir,
        "model_kind": route.model_kind,
        "capabilities": dict(route.capabilities),
        "weights": dict(route.weights),
        "unavailable": route.unavailable,
        "retry_after_s": route.retry_after_s,
        "status": str(state.status),
        # Tenants' registry adapters it serves: [tenant, name, {version: internal name}].
        "adapters": [
            [tenant, name, {str(v): internal for v, internal in versions.items()}]
            for (tenant, name), versions in sorted(route.adapters.items())
        ],
        "replicas": [
            {
                "id": r.replica_id,
                "url": r.url,
                "ready": r.ready,
                "max_concurrency": r.max_concurrency,
                "version_id": r.version_id,
                "pid": pids.get(r.url),
                "host_id": hosts.get(r.url),
            }
            for r in route.replicas
        ],
    }


class RoutePublisher:
    def __init__(
        self,
        db: Database,
        routing: RoutingTable,
        endpoints: dict[str, EndpointState],
        held_back: Callable[[str], bool] = lambda _: False,
        interval_s: float = 0.05,
        full_every_s: float = 1.0,
    ) -> None:
        self.db = db
        self.routing = routing
        self.endpoints = endpoints
        self.held_back = held_back  # endpoints not to publish yet (being adopted)
        self.interval_s = interval_s
        self.full_every_s = full_every_s
        self.generation = 0
        self.writes = 0  # entries written so far (tests, metrics)
        self._last: dict[str, dict[str, Any] | None] = {}  # endpoint id -> entry (None: removed)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Continue from what the table holds (a previous leader's entries)."""

        def load() -> tuple[int, dict[str, dict[str, Any] | None]]:
            with self.db.session() as s:
                rows = entries.newer_than(s, 0)
                return entries.max_generation(s), {
                    r.endpoint_id: None if r.removed else dict(r.entry) for r in rows
                }

        self.generation, self._last = await asyncio.to_thread(load)
        await self.publish()
        self._task = asyncio.create_task(self._run(), name="route-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        seen, full_at = self.routing.generation, time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            due = time.monotonic() - full_at >= self.full_every_s
            if self.routing.generation == seen and not due:
                continue
            seen = self.routing.generation
            if due:
                full_at = time.monotonic()
            try:
                await self.publish()
            except Exception:
                log.exception("publishing the routing table failed; retrying")

    def changes(self) -> dict[str, dict[str, Any] | None]:
        """Entries that differ from what was last written (None: a tombstone)."""
        current: dict[str, dict[str, Any]] = {}
        for endpoint_id, state in list(self.endpoints.items()):
            if self.routing.get(endpoint_id) is state.route and not self.held_back(endpoint_id):
                current[endpoint_id] = entry_of(state)
        changed: dict[str, dict[str, Any] | None] = {
            k: v for k, v in current.items() if self._last.get(k) != v
        }
        for endpoint_id, last in self._last.items():
            gone = last is not None and endpoint_id not in current
            if gone and not self.held_back(endpoint_id) and self.routing.get(endpoint_id) is None:
                changed[endpoint_id] = None
        return changed

    async def publish(self) -> int:
        """Write what changed (one transaction, one notification); returns how many entries."""
        changed = self.changes()
        if not changed:
            return 0
        first = self.generation

        def write() -> None:
            with self.db.session() as s:
                generation = first
                for endpoint_id, entry in changed.items():
                    generation += 1
                    body = entry if entry is not None else {"endpoint_id": endpoint_id}
                    entries.write(s, endpoint_id, generation, body, removed=entry is None)
                entries.notify(s, generation)

        await asyncio.to_thread(write)
        self.generation = first + len(changed)
        self._last.update(changed)
        self.writes += len(changed)
        return len(changed)
