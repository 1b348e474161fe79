"""Counters in Redis rebuilt from the usage rows (the database) whenever the store that holds
them lost them, before anything is checked against them again: the monthly quota's
(`QuotaRebuild`, here) and the budgets' spend (`spend_rebuild.py`), both through
`CounterRebuild`.

In process memory they are lost only with the process: seeded at its start. In Redis they are
lost when Redis restarts (empty, or reloaded from an older snapshot) or fails over to a replica
that missed the last writes; every gateway would then hand its tenants their month back. So
Redis keeps a marker, the run id of the server the counters were rebuilt on, and every quota
check compares it to the run id of the server answering, in the same script
(`RedisQuotaCounter`, `RedisAdmission`, `quota.BuiltMarker`): on another server the check
raises `QuotaCountersLost`, the accounting rebuilds here and checks again. One gateway's rebuild
wins (the script sets the counters only if the marker is still stale); the others find it done.

What a quota rebuild cannot see, so may undercount by (bounded by the requests in flight then;
the spend counters' settlement avoids the first: `spend_rebuild.py`):
requests admitted before the loss and settled after the rebuild (their reservation was never in
the rebuilt counter, their settlement still gives it back), and rows other gateways had not yet
written (they write every ~50 ms).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy.exc import SQLAlchemyError

from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import (
    BuiltMarker,
    CountersLost,
    LimitsUnavailable,
    QuotaCounter,
    QuotaCountersLost,
    RedisQuotaCounter,
    month_of,
)
from modelyard.store import repository as repo

log = logging.getLogger(__name__)
T = TypeVar("T")


async def read_rows(load: Callable[[], T]) -> T:
    """`load` (a read of the usage rows) in a thread; the database away: `LimitsUnavailable`."""
    try:
        return await asyncio.to_thread(load)
    except SQLAlchemyError as exc:
        raise LimitsUnavailable(f"the usage rows cannot be read: {exc!r}") from exc


class CounterRebuild:
    """One process's rebuilds of a set of counters in Redis (guarded by `marker`; None: kept in
    this process, never lost while it runs) from the usage rows, after `flush` wrote this
    process's pending rows; each rebuild counted in `metrics` (labelled `what`). Subclasses
    read and set the counters (`_rebuild`)."""

    what = "counters"
    lost: type[CountersLost] = CountersLost

    def __init__(
        self,
        marker: BuiltMarker | None,
        flush: Callable[[], Awaitable[None]] | None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.marker = marker
        self._flush = flush
        self.metrics = metrics
        self._lock = asyncio.Lock()  # one rebuild at a time in this process
        self.rebuilds = 0  # done by this process (the others found the counters rebuilt)

    async def counted(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt` (a check against the counters), once more after rebuilding them if Redis
        lost them; a second loss, or a failed rebuild, raises `LimitsUnavailable`."""
        try:
            return await attempt()
        except self.lost:
            await self.rebuild()
            return await attempt()

    async def rebuild(self) -> None:
        """Rebuild the Redis counters unless they are built on the server answering now.
        Raises `LimitsUnavailable` if Redis or the database cannot be reached."""
        if self.marker is None:
            return
        async with self._lock:
            if await self.marker.built():
                return
            started = time.perf_counter()
            if self._flush is not None:
                try:
                    await self._flush()  # this process's rows are counted too
                except SQLAlchemyError as exc:
                    raise LimitsUnavailable(f"the usage rows cannot be read: {exc!r}") from exc
            counted = await self._rebuild()
            if counted is None:
                return
            self.rebuilds += 1
            if self.metrics is not None:
                self.metrics.counters_rebuilt.labels(self.what).inc()
            log.warning(
                "%s counters rebuilt from the usage rows (%d counters, %.0f ms): the Redis that "
                "held them restarted or failed over",
                self.what,
                counted,
                (time.perf_counter() - started) * 1000,
            )

    async def _rebuild(self) -> int | None:
        """Read the totals from the usage rows and set them with the marker: how many counters
        were set, None when another gateway rebuilt them on this server first."""
        raise NotImplementedError


class QuotaRebuild(CounterRebuild):
    """Rebuilds `quota` from the usage rows `recorder` writes (see the module's docstring)."""

    what = "quota"
    lost = QuotaCountersLost

    def __init__(
        self,
        quota: QuotaCounter,
        recorder: UsageRecorder,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        marker = quota.marker if isinstance(quota, RedisQuotaCounter) else None
        super().__init__(marker, recorder.flush, metrics)
        self.quota = quota
        self.recorder = recorder

    async def at_start(self) -> None:
        """Seed the counters in memory, or rebuild those in Redis if they were lost."""
        if isinstance(self.quota, RedisQuotaCounter):
            try:
                await self.rebuild()
            except LimitsUnavailable as exc:
                # Not a reason to stay down: the first quota check rebuilds them (or refuses).
                log.warning("quota counters not rebuilt at start: %s", exc)
            return
        month, totals = await self._totals()
        for tenant_id, tokens in totals.items():
            await self.quota.seed(tenant_id, month, tokens)

    async def _rebuild(self) -> int | None:
        assert isinstance(self.quota, RedisQuotaCounter)
        month, totals = await self._totals()
        return len(totals) if await self.quota.rebuild(month, totals) else None

    async def _totals(self) -> tuple[str, dict[str, int]]:
        """The current month and each tenant's tokens in it, from the usage rows."""
        now = datetime.now(UTC)
        month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)

        def load() -> dict[str, int]:
            with self.recorder.db.session() as s:
                return repo.tokens_used_since(s, month_start)

        return month_of(now), await read_rows(load)
