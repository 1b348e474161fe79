"""Backfill: whether a warm replica may take one more batch item. One rule, applied twice: the
batch budget holds an item back while no ready replica of its endpoint may take it
(`batch/budget.py`), and the gateway's replica choice sends a batch item only to a replica that
may (`RoutingTable.pick`, waiting as the budget does while none may: `gateway/upstream.py`).

A replica may take a batch item while it is below its admission limit counting every request,
batch items too (`ReplicaRoute.has_room(batch=True)`), and, where its engine reports its free
capacity (its health report: free sequence slots and KV tokens), has more than
`reserved_slots` free slots and at least `kv_per_item` free KV tokens, each less what this
process sent there since the report (`ReplicaRoute.free_capacity`). The platform's values are
`backfill_reserved_slots` and `admission_tokens_per_request` (`Backfill.of`).

A held-back item waits on its endpoint's change signal (a request leaves it, its replicas change,
one reports its capacity: `EndpointRoute.wait_change`), and looks again at the latest after
`HOLD_FIRST_S`, doubling up to `HOLD_MAX_S` (`HoldBack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from modelyard.core.replica_route import ReplicaRoute

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings

HOLD_FIRST_S = 0.05
HOLD_MAX_S = 1.0


@dataclass(frozen=True)
class Backfill:
    """The KV tokens one batch item takes, and the slots of each replica left to interactive
    bursts."""

    kv_per_item: int = 1
    reserved_slots: int = 0

    @classmethod
    def of(cls, settings: PlatformSettings) -> Backfill:
        """The platform's rule (`admission_tokens_per_request`, `backfill_reserved_slots`)."""
        return cls(settings.admission_tokens_per_request, settings.backfill_reserved_slots)

    def room(self, replica: ReplicaRoute) -> bool:
        """The replica may take one more batch item (see the module docstring)."""
        if not replica.has_room(batch=True):
            return False
        report, free = replica.report, replica.free_capacity(self.kv_per_item)
        if report is None or free is None:  # an engine that does not report it: the limit alone
            return True
        slots, kv = free
        return slots > self.reserved_slots and kv >= min(
            self.kv_per_item, report.kv_capacity_tokens
        )


class Changes(Protocol):
    """What a held-back item waits on (an `EndpointRoute`)."""

    async def wait_change(self, at_most_s: float) -> None: ...


class HoldBack:
    """The waits of one held-back batch item (see the module docstring)."""

    def __init__(self) -> None:
        self.wait_s = HOLD_FIRST_S

    async def wait(self, route: Changes) -> None:
        await route.wait_change(self.wait_s)
        self.wait_s = min(self.wait_s * 2, HOLD_MAX_S)
