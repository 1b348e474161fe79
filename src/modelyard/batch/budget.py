"""How many batch items may be in flight: one budget per tenant, one for the whole gateway, and
batch work steps aside for interactive traffic.

Every running batch of a tenant draws from the tenant's budget (its `max_concurrent_batch_items`,
set by the platform admin, else `batch_concurrency`), so starting more batches does not put more
requests in flight; all tenants together are capped by `batch_max_concurrency`. Before an item is
sent it also waits while its endpoint has requests queued for admission or no ready replica has
room for it (backfill): below its admission limit, and, where its engine reports free capacity
(its health report: free sequence slots and KV tokens), more than `backfill_reserved_slots` free
slots and `admission_tokens_per_request` free KV tokens, less what was sent there since the
report. A batch item never takes the slot an interactive request is waiting for; it is sent at
the engine's batch priority, below every interactive tier, so the engine preempts it for an
interactive request, never the other way round; and it does not count against an interactive
request's admission (`ReplicaRoute.has_room`). An endpoint with no ready replica is not held
back: the gateway's own path scales it up, as for an interactive request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from modelyard.core.routing import EndpointRoute, ReplicaRoute

# A held-back item looks again when a request leaves the endpoint, its replicas change or one
# reports its capacity, and at the latest after this long (doubling from the first).
_YIELD_FIRST_S = 0.05
_YIELD_MAX_S = 1.0


def backfill_room(replica: ReplicaRoute, kv_per_item: int, reserved_slots: int = 0) -> bool:
    """The replica may take one more batch item (see the module docstring)."""
    if not replica.has_room(batch=True):
        return False
    report, free = replica.report, replica.free_capacity(kv_per_item)
    if report is None or free is None:  # an engine that does not report it: the limit alone
        return True
    slots, kv = free
    return slots > reserved_slots and kv >= min(kv_per_item, report.kv_capacity_tokens)


def endpoint_busy(route: EndpointRoute, kv_per_item: int = 1, reserved_slots: int = 0) -> bool:
    """Requests wait for admission, or no ready replica has room for a batch item."""
    if route.waiting > 0:
        return True
    ready = route.ready_replicas
    # With no ready replica the gateway's own path decides (scale from zero, or a clear 503).
    return bool(ready) and not any(backfill_room(r, kv_per_item, reserved_slots) for r in ready)


class BatchBudget:
    def __init__(
        self, default_per_tenant: int, total: int, kv_per_item: int = 1, reserved_slots: int = 0
    ) -> None:
        self.default_per_tenant = default_per_tenant
        self.total = total
        self.kv_per_item = kv_per_item
        self.reserved_slots = reserved_slots
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
        wait_s = _YIELD_FIRST_S
        while True:
            current = route()
            if current is None or not endpoint_busy(current, self.kv_per_item, self.reserved_slots):
                return
            self.held_back += 1
            await current.wait_change(wait_s)
            wait_s = min(wait_s * 2, _YIELD_MAX_S)
