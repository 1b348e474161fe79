"""The budgets' spend counters rebuilt from the usage rows whenever the Redis that holds them
lost them (a restart, empty or from an older snapshot; a failover to a replica that missed the
last writes), before a budget is checked or read against them again: the quota's mechanism
(`quota_rebuild.py`), with a marker of its own, since the two are rebuilt apart.

A reservation or a read of the counters on a Redis server they were not rebuilt on raises
`SpendCountersLost`; the budget book (`budgets.py`) then rebuilds every budget's counter of its
current period (day or month, UTC) from the usage rows, in one grouped query, marks them built
on that server (one gateway's rebuild wins) and tries again; a second loss, or usage rows that
cannot be read, refuses with a 503 `limits_unavailable`, as while Redis is away.

A settlement (`RedisSpend.settle`) carries the run id of the server its reservation was taken
on: on a server not rebuilt yet it changes nothing (the counter Redis lost cannot go below
zero, and the rebuild counts the request's usage row); on one rebuilt since, it adds the whole
cost (the reservation was never in the rebuilt counter, and the row, written after the
settlement, was not in the rebuild either). So a rebuild undercounts only by:
- the rows other gateways had not yet written when it read them (they write every ~50 ms):
  the cost of requests settled in the moments before it;
- while they run, the reservations of the requests in flight across the loss: spend may pass a
  limit by those requests' costs, as it may pass it by one request's cost at any time;
and may overcount, the safe way, by a batch item's cost: its row is committed before its
settlement, so one whose counters were rebuilt between the two is counted twice.
In process memory (one gateway) the counters are lost only with the process: seeded again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import LimitsUnavailable
from modelyard.gateway.quota_rebuild import CounterRebuild, read_rows
from modelyard.gateway.spend import RedisSpend, SpendCounter, SpendCountersLost

log = logging.getLogger(__name__)


class SpendRebuild(CounterRebuild):
    """Rebuilds `spend` (when in Redis) to `totals()`: every budget's counter of its current
    period and what the usage rows say was spent in it (read in a thread)."""

    what = "spend"
    lost = SpendCountersLost

    def __init__(
        self,
        spend: SpendCounter,
        totals: Callable[[], dict[str, int]],
        flush: Callable[[], Awaitable[None]] | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        marker = spend.marker if isinstance(spend, RedisSpend) else None
        super().__init__(marker, flush, metrics)
        self.spend = spend
        self._totals = totals

    async def at_start(self) -> None:
        """Rebuild the counters in Redis if they were lost (in memory they are seeded as
        budgets are first counted)."""
        try:
            await self.rebuild()
        except LimitsUnavailable as exc:
            # Not a reason to stay down: the first budget check rebuilds them (or refuses).
            log.warning("spend counters not rebuilt at start: %s", exc)

    async def _rebuild(self) -> int | None:
        assert isinstance(self.spend, RedisSpend)
        totals = await read_rows(self._totals)
        return len(totals) if await self.spend.rebuild(totals) else None
