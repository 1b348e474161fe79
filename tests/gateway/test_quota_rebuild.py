"""Monthly quota counters that survive Redis (`gateway/quota_rebuild.py`), on a private
`redis-server` this test kills and restarts: after Redis comes back empty, or reloads a snapshot
older than the last writes (what a failover to a replica that missed them looks like), the
gateway's accounting rebuilds the counters from the usage rows before it checks a quota, so a
tenant at its quota stays refused; several gateways rebuild once; and a rebuild that cannot read
the usage rows refuses with a 503, never admits unmetered."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from modelyard.core.errors import QuotaExceeded, Unavailable
from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import RedisConcurrencyLimiter, RedisQuotaCounter, month_of
from modelyard.gateway.ratelimit import RedisRateLimiter
from modelyard.gateway.redis_connect import open_redis
from modelyard.store.db import Database
from modelyard.store.repository import now
from tests.chaos_harness import RedisServer
from tests.conftest import free_port

QUOTA = 1_500
ROUTE = EndpointRoute("ep-1", "tenant-1", "m", False, None, 4096)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer.running() as s:  # its own redis-server: these tests kill it
        yield s


def principal() -> Principal:
    return Principal(
        key_id="key-1", key_name="k", tenant_id="tenant-1", tenant_name="t",
        scopes=frozenset({"inference"}), limits=Limits(rpm=10_000, tpm=10_000_000),
        monthly_token_quota=QUOTA, platform_admin=False, max_concurrent_requests=100,
    )  # fmt: skip


@dataclasses.dataclass
class Gateway:
    """One gateway's accounting over the real Redis and a usage database, as serve builds it."""

    redis: Redis
    quota: RedisQuotaCounter
    accounting: Accounting

    @classmethod
    async def start(cls, url: str, db: Database) -> Gateway:
        redis = open_redis(url, 1.0)
        quota = RedisQuotaCounter(redis)
        accounting = Accounting(
            RedisRateLimiter(redis), quota, RedisConcurrencyLimiter(redis), UsageRecorder(db),
            GatewayMetrics(),
        )  # fmt: skip
        await accounting.quota_rebuild.at_start()
        return cls(redis, quota, accounting)

    async def serve(self, request_id: str, tokens: int) -> None:
        """A request admitted, served with `tokens` and settled; its usage row written."""
        call = Call(principal(), ROUTE, "chat.completions", request_id, tokens, NO_LIMITS)
        await self.accounting.admit_at_once(call, "m")
        call.prompt_tokens, call.completion_tokens = tokens - 10, 10
        await self.accounting.close(call, served=True)
        await self.accounting.recorder.flush()

    async def admit(self, request_id: str) -> Call:
        call = Call(principal(), ROUTE, "chat.completions", request_id, 40, NO_LIMITS)
        await self.accounting.admit_at_once(call, "m")
        return call


def database(tmp_path: Path) -> Database:
    db = Database(f"sqlite:///{tmp_path / 'usage.db'}")
    db.migrate()
    return db


@pytest.mark.parametrize("comes_back", ["empty", "with an older snapshot"])
async def test_a_tenant_at_its_quota_stays_refused_after_redis_lost_the_counters(
    server: RedisServer, tmp_path: Path, comes_back: str
) -> None:
    db = database(tmp_path)
    g = await Gateway.start(server.url, db)
    try:
        await g.serve("req-1", 1_000)
        if comes_back != "empty":
            await g.redis.save()  # the snapshot Redis will come back with: 1,000 used
        await g.serve("req-2", 500)  # the quota used up
        with pytest.raises(QuotaExceeded):
            await g.admit("req-3")
        month = month_of(now())
        server.kill()
        server.start()  # loads the snapshot, if any (same folder)
        expected = 1_000 if comes_back != "empty" else None
        assert await g.redis.get(g.quota.key("tenant-1", month)) == (
            None if expected is None else str(expected).encode()
        )
        # Before the fix: 1,000 (or nothing) used, so 500 (or 1,500) more tokens were served.
        with pytest.raises(QuotaExceeded) as refused:
            await g.admit("req-4")
        assert refused.value.code == "insufficient_quota"
        assert "1500 of 1500" in str(refused.value)
        assert g.accounting.quota_rebuild.rebuilds == 2  # at start, and after the restart
        assert await g.quota.used("tenant-1", month) == 1_500
    finally:
        await g.redis.aclose()
        db.dispose()


async def test_gateways_rebuild_once_and_admit_on_the_rebuilt_counters(
    server: RedisServer, tmp_path: Path
) -> None:
    db = database(tmp_path)
    gateways = [await Gateway.start(server.url, db) for _ in range(3)]
    try:
        await gateways[0].serve("req-1", 1_400)
        server.kill()
        server.start()
        # Three gateways, four requests each, all at once after the restart: one rebuild.
        calls = await asyncio.gather(
            *(g.admit(f"req-{i}-{j}") for i, g in enumerate(gateways) for j in range(4)),
            return_exceptions=True,
        )
        assert sum(g.accounting.quota_rebuild.rebuilds for g in gateways) == 2  # start + 1
        # 1,400 used, 40 reserved each: admitted while the total is below 1,500 (three).
        admitted = [c for c in calls if isinstance(c, Call)]
        assert len(admitted) == 3, calls
        assert all(isinstance(c, QuotaExceeded) for c in calls if not isinstance(c, Call))
        assert await gateways[0].quota.used("tenant-1", month_of(now())) == 1_400 + 3 * 40
    finally:
        for g in gateways:
            await g.redis.aclose()
        db.dispose()


async def test_a_rebuild_without_the_usage_rows_refuses_with_a_503(
    server: RedisServer, tmp_path: Path
) -> None:
    """Counters lost and the database unreachable: the quota cannot be known, so the request
    is refused as while Redis is down (retryable 503), not admitted against an empty counter."""
    down = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    g = await Gateway.start(server.url, down)  # starts all the same (logged)
    try:
        with pytest.raises(Unavailable) as refused:
            await g.admit("req-1")
        assert refused.value.code == "limits_unavailable"
        assert not await g.quota.built()
    finally:
        await g.redis.aclose()
        down.dispose()
