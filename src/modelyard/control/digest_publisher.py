"""The replicas' prefix digests, shared by the leading controller with every gateway (cluster
mode), so that each gateway routes by what every replica's prefix cache holds, as `serve` does.

Only the leader probes the replicas: its health check hands each one's digest (the prefix keys
its KV cache holds, `core/prefix_keys.py`) to its own routing table (`ReplicaRoute.cache`). Every
`every_s` this publisher writes to Redis the digests that changed since its last round, for the
gateways' `gateway/digest_mirror.py`: in one transaction, `DIGESTS_KEY` (a hash of `<endpoint
id>/<replica id>` -> `<generation> <keys in base64>`, at most `MAX_DIGEST_KEYS` keys: 22 KiB)
and `DIGEST_STAMPS_KEY` (the same fields -> a short hash of that value: a gateway fetches only
the digests whose stamp moved). A replica that left the table leaves both. Every round renews
their expiry (`ttl_s`), so with no leader they lapse and the gateways drop the digests; found
lapsed (or lost with a Redis restart), they are written again whole. A new term's first round
replaces both hashes (its predecessor's fields go). The loop only collects each replica's
(generation, keys) as the health check left them; encoding them runs on a thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from modelyard.core.cluster_keys import DIGEST_STAMPS_KEY, DIGESTS_KEY
from modelyard.core.periodic import Periodic
from modelyard.core.prefix_keys import share_digest, stamp
from modelyard.core.routing import RoutingTable

log = logging.getLogger(__name__)

Digest = tuple[int, frozenset[bytes]]  # (generation, keys) as the health check set them


def _encode(digests: dict[str, Digest]) -> dict[str, tuple[str, str]]:
    """On a thread: each digest's shared value and its stamp."""
    out = {}
    for field, (generation, held) in digests.items():
        value = share_digest(generation, held)
        out[field] = (value, stamp(value))
    return out


class DigestPublisher:
    def __init__(
        self, redis: Any, routing: RoutingTable, every_s: float = 0.5, ttl_s: float = 30.0
    ) -> None:
        self.redis = redis
        self.routing = routing
        self.ttl_ms = int(ttl_s * 1000)
        self.writes = 0  # digests written so far (tests)
        self._encoded: dict[str, Digest] = {}  # field -> the digest last encoded
        self._stamps: dict[str, str] = {}  # field -> the stamp written
        self._whole = True  # the next round replaces both hashes
        self._rounds = Periodic(
            self.publish, every_s, "digest-publisher",
            "sharing the replicas' prefix digests through Redis failed", log,
        )  # fmt: skip

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    def _current(self) -> dict[str, Digest]:
        current: dict[str, Digest] = {}
        for route in self.routing.all_routes():
            for replica in route.replicas:
                cache = replica.cache
                if cache.generation >= 0:  # it has reported one
                    field = f"{route.endpoint_id}/{replica.replica_id}"
                    current[field] = (cache.generation, cache.held)
        return current

    async def publish(self) -> int:
        """One round: write what changed, drop what left, renew the expiry; returns how many
        digests were written."""
        whole = self._whole
        if whole:
            self._encoded.clear()
            self._stamps.clear()
        current = self._current()
        # A digest the health check has not replaced since it was encoded is the same one.
        todo = {
            f: d
            for f, d in current.items()
            if (seen := self._encoded.get(f)) is None or seen[0] != d[0] or seen[1] is not d[1]
        }
        encoded = await asyncio.to_thread(_encode, todo) if todo else {}
        changed = {f: e for f, e in encoded.items() if self._stamps.get(f) != e[1]}
        gone = [f for f in self._stamps if f not in current]
        async with self.redis.pipeline(transaction=True) as pipe:
            if whole:
                pipe.delete(DIGESTS_KEY, DIGEST_STAMPS_KEY)
            if changed:
                pipe.hset(DIGESTS_KEY, mapping={f: v for f, (v, _) in changed.items()})
                pipe.hset(DIGEST_STAMPS_KEY, mapping={f: s for f, (_, s) in changed.items()})
            if gone:
                pipe.hdel(DIGESTS_KEY, *gone)
                pipe.hdel(DIGEST_STAMPS_KEY, *gone)
            pipe.pexpire(DIGESTS_KEY, self.ttl_ms)
            pipe.pexpire(DIGEST_STAMPS_KEY, self.ttl_ms)
            renewed = (await pipe.execute())[-1]
        self._whole = False
        self._encoded.update(todo)
        self._stamps.update({f: s for f, (_, s) in changed.items()})
        for f in gone:
            self._encoded.pop(f, None)
            del self._stamps[f]
        if current and not renewed:  # the hashes lapsed or Redis lost them: all again
            self._whole = True
        self.writes += len(changed)
        return len(changed)
