"""The gateways' counters, summed on the leading controller (cluster mode), so its autoscaler
sees every gateway's traffic as `serve`'s sees its own; and the gateways' requests for a replica
of an endpoint at zero (scale from zero).

Every `every_s`: read each live gateway's report (`gateway/traffic_report.py`), and move the
controller's routing table by the difference from the previous sums: each replica's requests in
flight, each endpoint's queued requests (`remote_waiting`) and requests so far. Differences,
not values, because the controller's own gateway (the batch runner's requests) counts on the
same routes. A gateway's count of requests so far only adds while the gateway lives; one that
died leaves the sum without taking its requests back. Then every endpoint named in
`modelyard:activate` is activated.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from modelyard.core.cluster_keys import ACTIVATE_KEY, LOAD_PREFIX
from modelyard.core.periodic import Periodic
from modelyard.core.routing import Activate, RoutingTable

log = logging.getLogger(__name__)


class LoadAggregator:
    def __init__(
        self,
        redis: Any,
        routing: RoutingTable,
        activate: Activate,
        every_s: float = 0.5,
    ) -> None:
        self.redis = redis
        self.routing = routing
        self.activate = activate
        self.every_s = every_s
        self._in_flight: dict[tuple[str, str], int] = {}  # (endpoint, replica) -> applied
        self._requests: dict[tuple[str, str], int] = {}  # (gateway, endpoint) -> last total
        self._rounds = Periodic(
            self.tick, every_s, "cluster-load", "reading the gateways' load from Redis failed", log
        )

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def tick(self) -> None:
        keys = [k async for k in self.redis.scan_iter(match=LOAD_PREFIX + "*", count=1000)]
        values = await self.redis.mget(keys) if keys else []
        reports = {
            (k.decode() if isinstance(k, bytes) else k)[len(LOAD_PREFIX) :]: json.loads(v)
            for k, v in zip(keys, values, strict=True)
            if v
        }
        self.apply(reports)
        activations = await self.redis.spop(ACTIVATE_KEY, 1000)
        for endpoint_id in activations or []:
            self.activate(endpoint_id.decode() if isinstance(endpoint_id, bytes) else endpoint_id)

    def apply(self, reports: dict[str, dict[str, Any]]) -> None:
        """Move the routing table by the difference from the sums applied last time."""
        in_flight: dict[tuple[str, str], int] = {}
        queued: dict[str, int] = {}
        for gateway, report in reports.items():
            for endpoint_id, load in report.items():
                queued[endpoint_id] = queued.get(endpoint_id, 0) + int(load.get("queued", 0))
                for replica_id, n in load.get("replicas", {}).items():
                    key = (endpoint_id, replica_id)
                    in_flight[key] = in_flight.get(key, 0) + int(n)
                total, key2 = int(load.get("requests", 0)), (gateway, endpoint_id)
                added = total - self._requests.get(key2, 0)
                self._requests[key2] = total
                route = self.routing.get(endpoint_id)
                if route is not None and added > 0:
                    route.requests_total += added
                    route.last_request_at = time.monotonic()
        gone = {k for k in self._requests if k[0] not in reports}
        for key in gone:
            del self._requests[key]
        for route in self.routing.all_routes():
            route.remote_waiting = queued.get(route.endpoint_id, 0)
            for replica in route.replicas:
                key = (route.endpoint_id, replica.replica_id)
                new, old = in_flight.get(key, 0), self._in_flight.get(key, 0)
                if new != old:
                    replica.outstanding += new - old
        self._in_flight = {
            k: v
            for k, v in in_flight.items()
            if (r := self.routing.get(k[0])) and any(x.replica_id == k[1] for x in r.replicas)
        }
