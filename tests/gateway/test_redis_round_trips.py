"""Redis round trips per request on the gateway's path, counted on the wire (every command or
pipeline a connection sends to the real Redis) for a key with RPM and TPM limits under a tenant
with a monthly quota and a ceiling on requests in flight: admission (limits, quota
reservation, concurrency slot) and settlement (TPM and quota settled, the slot released), one
each; and what settlement's one script leaves in Redis, served or refunded."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import Connection

from modelyard.core.errors import QuotaExceeded, RateLimited
from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import EndpointRoute
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import (
    LimitsUnavailable,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    month_of,
)
from modelyard.gateway.ratelimit import RedisRateLimiter
from modelyard.gateway.redis_connect import open_redis
from modelyard.store.db import Database
from modelyard.store.repository import now
from tests.chaos_harness import RedisServer
from tests.databases import fresh_redis


class CountingConnection(Connection):
    """A connection that counts what it sends: one write per command or per pipeline, each
    answered before the caller goes on, so one round trip each."""

    sent = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        await super().send_packed_command(command, check_health)


@pytest.fixture
def redis_url() -> Iterator[str]:
    with fresh_redis() as url:
        yield url


def principal() -> Principal:
    return Principal(
        key_id="key-1",
        key_name="k",
        tenant_id="tenant-1",
        tenant_name="t",
        scopes=frozenset({"inference"}),
        limits=Limits(rpm=10_000, tpm=10_000_000),
        monthly_token_quota=10**12,
        platform_admin=False,
        max_concurrent_requests=100,
    )


async def round_trips(redis_url: str, db_path: Path, requests: int) -> tuple[float, float]:
    """Mean round trips per request at admission and at settlement."""
    pool = ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    redis = Redis(connection_pool=pool)
    db = Database(f"sqlite:///{db_path}")
    db.migrate()
    quota = RedisQuotaCounter(redis)
    accounting = Accounting(
        RedisRateLimiter(redis),
        quota,
        RedisConcurrencyLimiter(redis),
        UsageRecorder(db),
        GatewayMetrics(),
    )
    route = EndpointRoute("ep-1", "tenant-1", "m", False, None, 4096)
    await redis.ping()  # the connection (and its handshake) made before counting
    admit = settle = 0
    try:
        for i in range(-1, requests):  # the first loads the scripts into Redis: not counted
            p = principal()
            before = CountingConnection.sent
            call = Call(p, route, "chat.completions", f"req-{i}", 40, NO_LIMITS)
            await accounting.admit_at_once(call, "m")  # as `Admission.admit` does on Redis
            admitted = CountingConnection.sent
            call.prompt_tokens, call.completion_tokens = 12, 9  # not what was reserved
            await accounting.close(call, served=True)
            if i >= 0:
                admit += admitted - before
                settle += CountingConnection.sent - admitted
    finally:
        await redis.aclose()
        db.engine.dispose()
    return admit / requests, settle / requests


def test_one_round_trip_to_admit(redis_url: str, tmp_path: Path) -> None:
    admit, settle = asyncio.run(round_trips(redis_url, tmp_path / "usage.db", 20))
    print(f"round trips per request: admission {admit}, settlement {settle}")
    assert admit == 1  # limits, quota and the concurrency slot checked and taken together
    # TPM settled, the quota moved to the real count and the slot released together.
    assert settle == 1


@dataclasses.dataclass
class GatewayLimits:
    """A gateway's accounting over the real Redis, as the gateway builds it."""

    redis: Redis
    db: Database
    quota: RedisQuotaCounter
    slots: RedisConcurrencyLimiter
    limiter: RedisRateLimiter
    accounting: Accounting

    @classmethod
    async def open(cls, redis_url: str, db_path: Path) -> GatewayLimits:
        redis = Redis.from_url(redis_url)
        db = Database(f"sqlite:///{db_path}")
        db.migrate()
        quota = RedisQuotaCounter(redis)
        slots, limiter = RedisConcurrencyLimiter(redis), RedisRateLimiter(redis)
        recorder = UsageRecorder(db)
        accounting = Accounting(limiter, quota, slots, recorder, GatewayMetrics())
        await accounting.quota_rebuild.at_start()  # as the gateway starts: counters built
        return cls(redis, db, quota, slots, limiter, accounting)

    async def close(self) -> None:
        await self.redis.aclose()
        self.db.engine.dispose()


async def refusals(redis_url: str, db_path: Path) -> None:
    g = await GatewayLimits.open(redis_url, db_path)
    redis, quota, slots, limiter, accounting = g.redis, g.quota, g.slots, g.limiter, g.accounting
    route = EndpointRoute("ep-1", "tenant-1", "m", False, None, 4096)
    p = principal()
    try:
        # A quota already used up: refused, and neither the key's buckets nor a slot taken.
        month = month_of(now())
        await quota.seed(p.tenant_id, month, 10**12)
        call = Call(p, route, "chat.completions", "req-q", 40, NO_LIMITS)
        with pytest.raises(QuotaExceeded) as refused:
            await accounting.admit_at_once(call, "m")
        assert (refused.value.type, refused.value.code) == (
            "insufficient_quota",
            "insufficient_quota",
        )
        assert refused.value.headers["x-ratelimit-remaining-requests"] == "10000"
        assert await quota.used(p.tenant_id, month) == 10**12
        assert await slots.held(f"{p.tenant_id}:requests") == 0
        assert not await redis.exists(limiter.key(p.key_id, "requests"))
        # The ceiling of requests in flight reached: refused, the quota not moved.
        await redis.delete(quota.key(p.tenant_id, month))
        one = dataclasses.replace(p, max_concurrent_requests=1)
        first = Call(one, route, "chat.completions", "req-1", 40, NO_LIMITS)
        await accounting.admit_at_once(first, "m")
        assert (first.slot, first.quota_reserved) == (True, 40)
        second = Call(one, route, "chat.completions", "req-2", 40, NO_LIMITS)
        with pytest.raises(RateLimited) as full:
            await accounting.admit_at_once(second, "m")
        assert full.value.code == "concurrency_limit_exceeded"
        assert await quota.used(p.tenant_id, month) == 40
        # Settled (served), the slot is free again and the quota holds the real count.
        first.prompt_tokens, first.completion_tokens = 5, 5
        await accounting.close(first, served=True)
        assert await slots.held(f"{p.tenant_id}:requests") == 0
        assert await quota.used(p.tenant_id, month) == 10
    finally:
        await g.close()


def test_a_refusal_at_admission_takes_nothing(redis_url: str, tmp_path: Path) -> None:
    asyncio.run(refusals(redis_url, tmp_path / "usage.db"))


async def settled_state(redis_url: str, db_path: Path) -> None:
    g = await GatewayLimits.open(redis_url, db_path)
    redis, quota, slots, limiter, accounting = g.redis, g.quota, g.slots, g.limiter, g.accounting
    route = EndpointRoute("ep-1", "tenant-1", "m", False, None, 4096)
    # 60 TPM refills one token a second: the bucket's level shows what settlement gave back.
    p = dataclasses.replace(principal(), limits=Limits(rpm=10_000, tpm=60))
    scope, month = f"{p.tenant_id}:requests", month_of(now())

    async def level() -> float:
        return float(await redis.hget(limiter.key(p.key_id, "tokens"), "level") or 0)

    try:
        # Served: 40 reserved, 21 used: the bucket keeps 21 taken, the quota counts 21.
        served = Call(p, route, "chat.completions", "req-served", 40, NO_LIMITS)
        started = time.monotonic()
        await accounting.admit_at_once(served, "m")
        assert await slots.held(scope) == 1 and await quota.used(p.tenant_id, month) == 40
        served.prompt_tokens, served.completion_tokens = 12, 9
        await accounting.close(served, served=True)
        assert 39 <= await level() <= 39 + (time.monotonic() - started) + 0.01
        assert await quota.used(p.tenant_id, month) == 21
        assert await slots.held(scope) == 0
        # Refused by its replica (nothing served): its 20 tokens given back.
        failed = Call(p, route, "chat.completions", "req-failed", 20, NO_LIMITS)
        await accounting.admit_at_once(failed, "m")
        held, started = await level(), time.monotonic()
        assert await quota.used(p.tenant_id, month) == 41
        failed.status_code = 503
        await accounting.close(failed, served=False)
        assert held + 20 <= await level() <= held + 20 + (time.monotonic() - started) + 0.01
        assert await quota.used(p.tenant_id, month) == 21
        assert await slots.held(scope) == 0
        # Admitted in one month, finished in the next: two counters move in the one script.
        late = Call(p, route, "chat.completions", "req-late", 30, NO_LIMITS)
        await accounting.admit_at_once(late, "m")
        await redis.rename(quota.key(p.tenant_id, month), quota.key(p.tenant_id, "2000-01"))
        late.quota_month = "2000-01"
        late.prompt_tokens, late.completion_tokens = 5, 5
        await accounting.close(late, served=True)
        assert await quota.used(p.tenant_id, "2000-01") == 21  # its 30 reserved given back
        assert await quota.used(p.tenant_id, month) == 10
        assert await slots.held(scope) == 0
    finally:
        await g.close()


def test_settlement_in_one_script_leaves_what_each_call_would(
    redis_url: str, tmp_path: Path
) -> None:
    asyncio.run(settled_state(redis_url, tmp_path / "usage.db"))


async def test_pooled_connections_survive_a_redis_restart() -> None:
    """After a Redis restart every pooled connection is dead: the next request on each must
    still be admitted (one retry on a new connection), and with Redis down admission still
    fails closed at once."""
    server = RedisServer()  # its own redis-server: this test kills it
    server.start()
    store = open_redis(server.url, 1.0)
    limiter = RedisRateLimiter(store)
    limits = Limits(rpm=1000, tpm=None)
    try:
        # Requests at once leave as many connections in the pool.
        await asyncio.gather(*(limiter.acquire(f"k{i}", limits, 1) for i in range(4)))
        assert len(store.connection_pool._available_connections) == 4
        server.kill()
        server.start()
        decisions = await asyncio.gather(*(limiter.acquire(f"k{i}", limits, 1) for i in range(4)))
        assert all(d.allowed for d in decisions)
        server.kill()
        started = time.monotonic()
        with pytest.raises(LimitsUnavailable):
            await limiter.acquire("k0", limits, 1)
        assert time.monotonic() - started < 1.0
    finally:
        await store.aclose()
        server.close()
