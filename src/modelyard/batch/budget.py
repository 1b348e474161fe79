"""How many batch items may be in flight: one budget per tenant, one for the whole gateway, and
batch work steps aside for interactive traffic.

Every running batch of a tenant draws from the tenant's budget (its `max_concurrent_batch_items`,
set by the platform admin, else `batch_concurrency`), so starting more batches does not put more
requests in flight; all tenants together are capped by `batch_max_concurrency`. Before an item is
sent it also waits while its endpoint has requests queued for admission or no ready replica may
take it (backfill, `core/backfill.py`: below its admission limit, and, where its engine reports
free capacity, more than `backfill_reserved_slots` free slots and `admission_tokens_per_request`
free KV tokens). The gateway then sends it only to such a replica (`RoutingTable.pick` with the
same `Backfill`), waiting the same way if another request took the room meanwhile. A batch item
never takes the slot an interactive request is waiting for; it is sent at the engine's batch
priority, below every interactive tier, so the engine preempts it for an interactive request,
never the other way round; and it does not count against an interactive request's admission
(`ReplicaRoute.has_room`). An endpoint with no ready replica is not held back: the gateway's own
path scales it up, as for an interactive request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from modelyard.core.backfill import Backfill, HoldBack
from modelyard.core.routing import EndpointRoute


def endpoint_busy(route: EndpointRoute, backfill: Backfill) -> bool:
    """Requests wait for admission, or no ready replica may take a batch item."""
    if route.waiting > 0:
        return True
    ready = route.ready_replicas
    # With no ready replica the gateway's own path decides (scale from zero, or a clear 503).
    return bool(ready) and not any(backfill.room(r) for r in ready)


class BatchBudget:
    def __init__(
        self, default_per_tenant: int, total: int, backfill: Backfill | None = None
    ) -> None:
        self.default_per_tenant = default_per_tenant
        self.total = total
        self.backfill = backfill or Backfill()  # the gateway's rule (`Backfill.of(settings)`)
        self.held_back = 0  # times an item found its endpoint without room and waited
        self._in_flight: dict[str, int] = {}
        self._all = 0
        self._changed = asyncio.Event()

    def in_flight(self, tenant_id: str | None = None) -> int:
        return self._all if tenant_id is None else self._in_flight.get(tenant_id, 0)

    def _room(self, tenant_id: str, limit: int) -> bool:
        return self._all < self.total and self._in_flight.get(tenant_id, 0) < limit

    async def acquire(self, tenant_id: str, limit: int | None) -> None:
        """Wait for a slot of the tenant's budget and of the gateway's (`limit` None: the
        platform default)."""
        cap = max(1, limit if limit is not None else self.default_per_tenant)
        while not self._room(tenant_id, cap):
            # A release wakes every waiter; each looks again (there are few of them).
            self._changed.clear()
            await self._changed.wait()
        self._in_flight[tenant_id] = self._in_flight.get(tenant_id, 0) + 1
        self._all += 1

    def release(self, tenant_id: str) -> None:
        left = self._in_flight.get(tenant_id, 0) - 1
        if left > 0:
            self._in_flight[tenant_id] = left
        else:
            self._in_flight.pop(tenant_id, None)
        self._all -= 1
        self._changed.set()

    async def yield_to_interactive(self, route: Callable[[], EndpointRoute | None]) -> None:
        """Return once the item's endpoint (looked up afresh each time) has room for it."""
        hold = HoldBack()
        while True:
            current = route()
            if current is None or not endpoint_busy(current, self.backfill):
                return
            self.held_back += 1
            await hold.wait(current)
