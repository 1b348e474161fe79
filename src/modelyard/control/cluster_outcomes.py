"""Every gateway's per-version outcomes, summed from Redis on the leading controller (cluster
mode): the `ReadVersionStats` verb its canary SLO gate reads (`control/canary.py`), in place
of the controller's own gateway's outcomes alone.

The gate asks for a window synchronously each reconcile tick; the answer comes from what this
reader last fetched. A version asked about is fetched every `every_s` (its buckets over the
longest window asked, `core/outcome_counts.py`), and forgotten when not asked about for
`forget_after_s`. So a canary's first tick sees no requests (not judged) and later ones see the
gateways' counts up to `every_s` plus a gateway's flush period old. Bucket granularity: a
window takes in whole buckets of `OUTCOME_BUCKET_S`, up to one bucket more than asked.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from modelyard.core.outcome_counts import (
    OUTCOME_BUCKET_S,
    OutcomeCounts,
    bucket_of,
    outcome_key,
)
from modelyard.core.periodic import Periodic
from modelyard.core.routing import VersionWindow

log = logging.getLogger(__name__)

_Version = tuple[str, str]  # (endpoint id, version id)


class ClusterOutcomes:
    def __init__(self, redis: Any, every_s: float = 1.0, forget_after_s: float = 60.0) -> None:
        self.redis = redis
        self.every_s = every_s
        self.forget_after_s = forget_after_s
        self._asked: dict[_Version, tuple[float, float]] = {}  # -> (window_s, asked at)
        self._buckets: dict[_Version, dict[int, OutcomeCounts]] = {}
        self._rounds = Periodic(
            self.fetch,
            every_s,
            "cluster-outcomes",
            "reading the gateways' request outcomes from Redis failed",
            log,
        )

    def window(self, endpoint_id: str, version_id: str, window_s: float) -> VersionWindow:
        """`ReadVersionStats`: the version's outcomes at every gateway over `window_s`."""
        version = (endpoint_id, version_id)
        known = self._asked.get(version, (0.0, 0.0))[0]
        self._asked[version] = (max(window_s, known), time.monotonic())
        first = bucket_of(time.time() - window_s)
        total = OutcomeCounts()
        for bucket, counts in self._buckets.get(version, {}).items():
            if bucket >= first:
                total.merge(counts)
        return total.window()

    async def fetch(self) -> None:
        now = time.monotonic()
        for version in [v for v, (_, at) in self._asked.items() if now - at > self.forget_after_s]:
            del self._asked[version]
            self._buckets.pop(version, None)
        if not self._asked:
            return
        last = bucket_of(time.time())
        wanted = [
            (version, bucket)
            for version, (window_s, _) in self._asked.items()
            for bucket in range(last - int(window_s // OUTCOME_BUCKET_S) - 1, last + 1)
        ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for (endpoint_id, version_id), bucket in wanted:
                pipe.hgetall(outcome_key(endpoint_id, version_id, bucket))
            raws = await pipe.execute()
        fetched: dict[_Version, dict[int, OutcomeCounts]] = {}
        for (version, bucket), raw in zip(wanted, raws, strict=True):
            if raw:
                fetched.setdefault(version, {})[bucket] = OutcomeCounts.parse(raw)
        self._buckets = fetched

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
