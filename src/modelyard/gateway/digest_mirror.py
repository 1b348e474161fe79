"""This gateway's copy of the replicas' prefix digests (cluster mode), which the leading
controller shares through Redis (`control/digest_publisher.py`): a gateway probes no replica, so
this is how its cache-aware routing (`core/cache_routing.py`) learns what each replica's prefix
cache holds, as the leader's own gateway does from its health checks.

Every `every_s`: read the stamps of the replicas this gateway routes to (one HMGET), fetch the
digests whose stamp moved since they were applied here, at most `MAX_FETCH` a round (one HMGET),
parse them on a thread (`prefix_keys.parse_shared`: bounded to `MAX_DIGEST_KEYS` keys; a
malformed one is refused and counts as none), and hand each to its replica's `ReplicaRoute.cache`
with its generation. A replica whose digest is gone (it left, or no leader renews the digests)
gets an empty one again: its requests are routed by what this gateway sent itself. A replica the
route mirror replaced (`gateway/route_mirror.py`: a new `ReplicaRoute`) is fetched again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from modelyard.core.cluster_keys import DIGEST_STAMPS_KEY, DIGESTS_KEY
from modelyard.core.periodic import Periodic
from modelyard.core.prefix_keys import parse_shared
from modelyard.core.routing import ReplicaRoute, RoutingTable

log = logging.getLogger(__name__)

MAX_FETCH = 64  # digests fetched in one round (22 KiB each at most); the rest the next
_STAMP_MAX = 64  # bytes of a stamp (the publisher's are 16)


def _parse_all(values: list[Any]) -> list[tuple[int, frozenset[bytes]] | None]:
    return [parse_shared(v) for v in values]


class DigestMirror:
    def __init__(self, redis: Any, routing: RoutingTable, every_s: float = 0.5) -> None:
        self.redis = redis
        self.routing = routing
        self.applied = 0  # digests applied so far (tests)
        self.refused = 0  # malformed ones
        self._stamps: dict[str, tuple[ReplicaRoute, bytes]] = {}  # field -> replica, stamp
        self._rounds = Periodic(
            self.refresh, every_s, "digest-mirror",
            "reading the replicas' prefix digests from Redis failed", log,
        )  # fmt: skip

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def refresh(self) -> int:
        """One round; returns how many digests were applied."""
        replicas = {
            f"{route.endpoint_id}/{r.replica_id}": r
            for route in self.routing.all_routes()
            for r in route.replicas
        }
        for field in [f for f in self._stamps if f not in replicas]:
            del self._stamps[field]
        if not replicas:
            return 0
        fields = list(replicas)
        stamps = await self.redis.hmget(DIGEST_STAMPS_KEY, fields)
        fetch: dict[str, bytes] = {}
        for field, given in zip(fields, stamps, strict=True):
            replica, applied = replicas[field], self._stamps.get(field)
            if isinstance(given, str):  # a client that decodes replies
                given = given.encode()
            if not isinstance(given, bytes):  # none shared (any more): this gateway's sends
                self._forget(field, replica)
                continue
            given = given[: _STAMP_MAX + 1]  # bounded (a longer one is refused)
            current = applied is not None and applied[0] is replica and applied[1] == given
            if not current and len(fetch) < MAX_FETCH:
                fetch[field] = given
        if not fetch:
            return 0
        values = await self.redis.hmget(DIGESTS_KEY, list(fetch))
        parsed = await asyncio.to_thread(_parse_all, values)
        count = 0
        for (field, given), value, digest in zip(fetch.items(), values, parsed, strict=True):
            replica = replicas[field]
            if value is None:  # left between the two reads
                self._forget(field, replica)
                continue
            if digest is None or len(given) > _STAMP_MAX:
                self.refused += 1
                log.warning("refused a malformed prefix digest for %s from Redis", field[:200])
                replica.cache.update(frozenset(), -1)
            else:
                replica.cache.update(digest[1], digest[0])
                count += 1
            self._stamps[field] = (replica, given)  # not fetched again until it changes
        self.applied += count
        return count

    def _forget(self, field: str, replica: ReplicaRoute) -> None:
        if self._stamps.pop(field, None) is not None:
            replica.cache.update(frozenset(), -1)
