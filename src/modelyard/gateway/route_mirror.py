"""A gateway's copy of the shared routing table (cluster mode): the entries the leading
controller publishes in PostgreSQL (`store/routing_entries.py`), applied to this gateway's own
`RoutingTable`.

Woken by PostgreSQL LISTEN/NOTIFY (one dedicated connection; the notification is sent in the
transaction that writes the entries, so they are readable when it arrives) and, as the fallback
for a lost notification or a broken listening connection, a re-read every `refresh_s`. Each read
asks only for entries newer than the highest generation seen. An entry is applied only if its
generation is newer than the one this gateway holds for its endpoint.

Applying updates the endpoint's route in place, keeping each replica's `ReplicaRoute` (this
gateway's requests in flight on it, its circuit breaker): requests waiting on the route see the
new replicas at once. A replica this gateway benched (it refused a connection) gets its
published readiness back at the next re-read, as `serve`'s health check would readmit it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.store import routing_entries as entries
from modelyard.store.db import Database

log = logging.getLogger(__name__)


def _libpq_url(url: str) -> str:
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


class RouteMirror:
    def __init__(self, db: Database, routing: RoutingTable, refresh_s: float = 2.0) -> None:
        self.db = db
        self.routing = routing
        self.refresh_s = refresh_s
        self.cursor = 0  # highest generation read
        self.applied = 0  # entries applied so far
        self._generations: dict[str, int] = {}
        self._published_ready: dict[str, dict[str, bool]] = {}  # endpoint -> replica -> ready
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [
            asyncio.create_task(self._listen(), name="route-mirror-listen"),
            asyncio.create_task(self._poll(), name="route-mirror-poll"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def refresh(self) -> int:
        """Read and apply the entries newer than the cursor; returns how many were applied."""
        async with self._lock:

            def read() -> list[tuple[str, int, bool, dict[str, Any]]]:
                with self.db.session() as s:
                    return [
                        (r.endpoint_id, r.generation, r.removed, dict(r.entry))
                        for r in entries.newer_than(s, self.cursor)
                    ]

            rows = await asyncio.to_thread(read)
            count = 0
            for endpoint_id, generation, removed, entry in rows:
                self.cursor = max(self.cursor, generation)
                if generation <= self._generations.get(endpoint_id, 0):
                    continue
                self._generations[endpoint_id] = generation
                self.apply(entry, removed)
                count += 1
            self.applied += count
            return count

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            woken = self._wake.is_set()
            self._wake.clear()
            try:
                await self.refresh()
                if not woken:
                    self.readmit_benched()
            except Exception as exc:
                log.warning("reading the shared routing table failed: %s", exc)

    async def _listen(self) -> None:
        """Wake the reader on every notification; reconnect after a broken connection."""
        import psycopg

        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    _libpq_url(self.db.url), autocommit=True, connect_timeout=3
                )
                async with conn:
                    await conn.execute(f"LISTEN {entries.CHANNEL}")
                    self._wake.set()  # anything written while not listening
                    async for _ in conn.notifies():
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("routing notifications: %s; re-reading every %gs", exc, self.refresh_s)
                await asyncio.sleep(self.refresh_s)

    # ----- applying an entry -------------------------------------------------------------------

    def apply(self, entry: dict[str, Any], removed: bool = False) -> None:
        endpoint_id = entry["endpoint_id"]
        if removed:
            self.routing.remove(endpoint_id)
            self._published_ready.pop(endpoint_id, None)
            return
        route = self.routing.get(endpoint_id)
        if route is None or (route.tenant_id, route.model_name, route.public) != (
            entry["tenant_id"],
            entry["model_name"],
            entry["public"],
        ):
            route = EndpointRoute(
                endpoint_id=endpoint_id,
                tenant_id=entry["tenant_id"],
                model_name=entry["model_name"],
                public=entry["public"],
                version_id=entry["version_id"],
                max_tokens_cap=entry["max_tokens_cap"],
            )
            self.routing.publish(route)
        route.max_tokens_cap = entry["max_tokens_cap"]
        route.sampling_defaults = dict(entry.get("sampling_defaults") or {})
        route.lora_dir = bool(entry.get("lora_dir"))
        route.model_kind = entry.get("model_kind")
        route.capabilities = dict(entry.get("capabilities") or {})
        if route.version_id != entry["version_id"]:
            self.routing.set_version(route, entry["version_id"])
        if route.upstream_model != entry.get("upstream_model"):
            self.routing.set_upstream_model(route, entry.get("upstream_model"))
        if route.weights != entry.get("weights", {}):
            self.routing.set_weights(route, entry.get("weights", {}))
        self.routing.set_unavailable(route, entry.get("unavailable"), entry["retry_after_s"])
        adapters = {
            (tenant, name): {int(v): internal for v, internal in versions.items()}
            for tenant, name, versions in entry.get("adapters", ())
        }
        self.routing.set_adapters(route, adapters)
        held = {r.replica_id: r for r in route.replicas}
        replicas: list[ReplicaRoute] = []
        for item in entry["replicas"]:
            replica = held.get(item["id"])
            if replica is None or replica.url != item["url"]:
                replica = ReplicaRoute(item["id"], item["url"], version_id=item["version_id"])
            replica.ready = bool(item["ready"])
            replica.max_concurrency = item["max_concurrency"]
            replica.version_id = item["version_id"]
            replicas.append(replica)
        self.routing.set_replicas(route, replicas)
        self._published_ready[endpoint_id] = {r["id"]: bool(r["ready"]) for r in entry["replicas"]}

    def readmit_benched(self) -> None:
        """Replicas this gateway benched take requests again if their entry says ready (their
        breaker still guards them): the controller's health check is the judge."""
        for endpoint_id, ready in self._published_ready.items():
            route = self.routing.get(endpoint_id)
            if route is None:
                continue
            for replica in route.replicas:
                if not replica.ready and ready.get(replica.replica_id):
                    self.routing.readmit(replica, route)
