"""A gateway's per-version outcomes, added to the cluster's counters in Redis (cluster mode), so
the leading controller's canary SLO gate judges a canary on every gateway's requests.

`record` is the gateway's `VersionStats` listener: an outcome of an endpoint that is running a
canary (its route weighs more than one version) is counted in memory under its version and
time bucket (`core/outcome_counts.py`); every `every_s` the counts go to Redis in one pipeline
(HINCRBY per field, the key's expiry renewed) and are cleared. Endpoints with one version cost
nothing. A failed flush is logged and dropped: the gate then judges on fewer requests, never
on invented ones.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from modelyard.core.outcome_counts import OUTCOME_TTL_S, OutcomeCounts, bucket_of, outcome_key
from modelyard.core.periodic import Periodic
from modelyard.core.routing import RoutingTable

log = logging.getLogger(__name__)


class OutcomeReporter:
    def __init__(self, redis: Any, routing: RoutingTable, every_s: float = 0.5) -> None:
        self.redis = redis
        self.routing = routing
        self.every_s = every_s
        self._pending: dict[str, OutcomeCounts] = {}  # Redis key -> counts not yet added
        self._rounds = Periodic(
            self.flush,
            every_s,
            "gateway-outcome-report",
            "adding request outcomes to Redis failed",
            log,
            wait_first=True,
        )

    def record(self, endpoint_id: str, version_id: str, ok: bool, latency_s: float | None) -> None:
        route = self.routing.get(endpoint_id)
        if route is None or len(route.weights) < 2:
            return  # no canary: nothing to compare
        key = outcome_key(endpoint_id, version_id, bucket_of(time.time()))
        counts = self._pending.get(key)
        if counts is None:
            counts = self._pending[key] = OutcomeCounts()
        counts.add(ok, latency_s)

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, counts in pending.items():
                for name, n in counts.fields().items():
                    pipe.hincrby(key, name, n)
                pipe.expire(key, OUTCOME_TTL_S)
            await pipe.execute()

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        with contextlib.suppress(Exception):
            await self.flush()
