"""How many batch items may be in flight: one budget per tenant, one for the whole gateway, and
batch work steps aside for interactive traffic.

Every running batch of a tenant draws from the tenant's budget (its `max_concurrent_batch_items`,
set by the platform admin, else `batch_concurrency`), so starting more batches does not put more
requests in flight; all tenants together are capped by `batch_max_concurrency`. Before an item is
sent it also waits while its endpoint has interactive requests queued for admission or no ready
replica has room: a batch item never takes the slot an interactive request is waiting for (the
gateway also sends it at the engine's batch priority).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from modelyard.core.routing import EndpointRoute

# How often a held-back item looks again at its endpoint: interactive load changes fast, and
# the look is a few attribute reads.
_YIELD_POLL_S = 0.05


def endpoint_busy(route: EndpointRoute) -> bool:
    """Interactive requests wait for admission, or every ready replica is full."""
    if route.waiting > 0:
        return True
    ready = route.ready_replicas
    # With no ready replica the gateway's own path decides (scale from zero, or a clear 503).
    return bool(ready) and not any(r.has_room() for r in ready)


class BatchBudget:
    def __init__(self, default_per_tenant: int, total: int) -> None:
        self.default_per_tenant = default_per_tenant
        self.total = total
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

    @staticmethod
    async def yield_to_interactive(route: Callable[[], EndpointRoute | None]) -> None:
        """Return once the item's endpoint (looked up afresh each time) is not busy."""
        while True:
            current = route()
            if current is None or not endpoint_busy(current):
                return
            # Polled: the endpoint's change signal belongs to its admission queue's waiters.
            await asyncio.sleep(_YIELD_POLL_S)
