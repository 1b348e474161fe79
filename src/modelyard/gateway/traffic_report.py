"""What a gateway tells the controller through Redis (cluster mode): its counters per endpoint,
which the autoscaler reads (requests in flight per replica, queued, requests so far), and the
endpoints it was asked for while none of their replicas serves (scale from zero).

Every `every_s` one `SET` of a JSON document under `modelyard:load:<gateway id>` that expires
after a few periods, so a dead gateway's counts leave the sum on their own. An activation is
one `SADD` to `modelyard:activate`, which the leading controller drains every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from typing import Any

from modelyard.core.cluster_keys import ACTIVATE_KEY, LOAD_PREFIX
from modelyard.core.periodic import Periodic
from modelyard.core.routing import RoutingTable

log = logging.getLogger(__name__)


def gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class TrafficReporter:
    def __init__(self, redis: Any, routing: RoutingTable, every_s: float = 0.5) -> None:
        self.redis = redis
        self.routing = routing
        self.every_s = every_s
        self.key = LOAD_PREFIX + gateway_id()
        self._rounds = Periodic(
            self.report, every_s, "gateway-load-report", "reporting load to Redis failed", log
        )
        self._pending: set[asyncio.Task[None]] = set()

    def snapshot(self) -> dict[str, Any]:
        """Per endpoint with any traffic: in flight per replica, queued, requests so far."""
        out: dict[str, Any] = {}
        for route in self.routing.all_routes():
            if not (route.requests_total or route.outstanding or len(route.queue)):
                continue
            out[route.endpoint_id] = {
                "replicas": {r.replica_id: r.outstanding for r in route.replicas if r.outstanding},
                "queued": len(route.queue),
                "requests": route.requests_total,
            }
        return out

    async def report(self) -> None:
        ttl_ms = int(self.every_s * 6000)
        await self.redis.set(self.key, json.dumps(self.snapshot()), px=ttl_ms)

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        with contextlib.suppress(Exception):
            await self.redis.delete(self.key)

    def activate(self, endpoint_id: str) -> None:
        """The gateway's `Activate` verb in cluster mode: ask the leader for a replica."""
        task = asyncio.get_running_loop().create_task(self._activate(endpoint_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _activate(self, endpoint_id: str) -> None:
        try:
            await self.redis.sadd(ACTIVATE_KEY, endpoint_id)
        except Exception as exc:
            log.warning("asking the controller for a replica of %s failed: %s", endpoint_id, exc)
