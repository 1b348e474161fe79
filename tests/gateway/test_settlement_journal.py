"""The limits journal and the outage guard against a real Redis (a private `redis-server` this
test kills or freezes) and a real database: a journaled settlement reaches the counter exactly
once (two gateways reconciling the same rows, a crash between applying and removing), never on
a Redis that came back as another data set, and the guard notices a dead or hung Redis and its
return from its background heartbeat, without a caller waiting on it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from modelyard.config import RedisOutage
from modelyard.core.identity import Limits, Principal
from modelyard.gateway.limits_outage import LimitsOutage, unsent
from modelyard.gateway.local_limits import LocalLimits
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import (
    LimitsUnavailable,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
)
from modelyard.gateway.redis_connect import open_redis
from modelyard.gateway.settlement_journal import EPOCH_KEY, SettlementJournal
from modelyard.store import limits_journal
from modelyard.store.db import Database, sqlite_url
from tests.chaos_harness import RedisServer
from tests.waiting import async_wait_until

MONTH = "2026-12"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    s.start()
    try:
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)  # a frozen one must die too
        s.close()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(sqlite_url(tmp_path / "journal.db"))
    database.migrate()
    try:
        yield database
    finally:
        database.dispose()


def parts(redis: Redis, db: Database) -> tuple[RedisQuotaCounter, SettlementJournal]:
    quota = RedisQuotaCounter(redis)
    return quota, SettlementJournal(db, quota, RedisConcurrencyLimiter(redis))


async def test_a_journaled_settlement_counts_once(server: RedisServer, db: Database) -> None:
    redis = open_redis(server.url, 1.0)
    try:
        await redis.set(EPOCH_KEY, "e1")
        quota, first = parts(redis, db)
        _, second = parts(redis, db)  # another gateway on the same database
        await quota.add("t1", MONTH, 100)  # reserved before the outage
        await redis.zadd("modelyard:slots:t1:requests", {"req-1": 1.0})
        # Settled during the outage: 100 reserved, 40 used; then a request admitted locally.
        first.add("t1", "e1", [(MONTH, -60)], ("t1:requests", "req-1"))
        first.add("t1", "e1", [(MONTH, -30), (MONTH, 55)], None)  # nets to +25
        await first.save()
        with db.session() as s:
            rows = limits_journal.oldest(s, 10)
        assert len(rows) == 2
        assert await first.reconcile() == 2
        assert await quota.used("t1", MONTH) == 100 - 60 + 25
        assert await redis.zcard("modelyard:slots:t1:requests") == 0
        # A crash between applying and removing leaves the rows: whoever reads them again
        # (this gateway or another) applies nothing twice.
        with db.session() as s:
            limits_journal.add(s, rows)
        assert await second.reconcile() == 0
        assert await quota.used("t1", MONTH) == 65
        with db.session() as s:
            assert limits_journal.oldest(s, 10) == []
        # A Redis that came back as another data set (restarted empty) takes nothing: its
        # counters come from the usage rows, which already hold this usage.
        first.add("t1", "e1", [(MONTH, 10)], None)
        await redis.set(EPOCH_KEY, "e2")
        assert await first.reconcile() == 0
        assert await quota.used("t1", MONTH) == 65
        assert first.pending == 0
    finally:
        await redis.aclose()


def principal(**limits: int) -> Principal:
    return Principal(
        key_id="key-1",
        key_name="k",
        tenant_id="t1",
        tenant_name="t",
        scopes=frozenset({"inference"}),
        limits=Limits(rpm=limits.get("rpm"), tpm=limits.get("tpm")),
        monthly_token_quota=limits.get("quota"),
        platform_admin=False,
        max_concurrent_requests=limits.get("slots"),
    )


async def test_local_shares_divide_each_limit(db: Database) -> None:
    local = LocalLimits(db)
    p = principal(rpm=5, quota=1000, slots=3)
    local.saw("t1", MONTH, 400)  # the counter as Redis last reported it
    # 2 gateways: RPM 5 // 2 = 2 here, 1 slot, and (1000 - 400) // 2 = 300 quota tokens.
    first = await local.admit(p, 100, "r1", 2, MONTH)
    assert first.decision.allowed and first.refused is None
    second = await local.admit(p, 100, "r2", 2, MONTH)
    assert second.refused == "concurrency"  # one slot each
    await local.settle(local.generation, p, 2, 0, [], ("t1:requests", "r1"))
    assert (await local.admit(p, 250, "r3", 2, MONTH)).refused is None
    refused = await local.admit(p, 10, "r4", 2, MONTH)  # 350 of its 300 spent here
    assert refused.refused == "quota" and refused.quota_used == 400 + 350
    # Settled for less than reserved: the share has room again (and its one slot).
    await local.settle(local.generation, p, 2, 0, [(MONTH, -200)], ("t1:requests", "r3"))
    assert (await local.admit(p, 10, "r5", 2, MONTH)).refused is None
    local.reset()
    assert (await local.admit(p, 10, "r6", 2, MONTH)).refused is None
    local.reset()
    p = principal(rpm=5)
    assert [(await local.admit(p, 1, f"x{i}", 2, MONTH)).decision.allowed for i in range(3)] == [
        True,
        True,
        False,
    ]


@pytest.fixture
async def guard(server: RedisServer, db: Database) -> AsyncIterator[LimitsOutage]:
    redis = open_redis(server.url, 0.5)
    quota, journal = parts(redis, db)
    outage = LimitsOutage(
        quota, journal, LocalLimits(db), GatewayMetrics(), RedisOutage.FAIL_OPEN, 0.1
    )
    await outage.start()
    try:
        yield outage
    finally:
        await outage.stop()
        await redis.aclose()


async def test_the_guard_sees_a_dead_redis_and_its_return(
    server: RedisServer, guard: LimitsOutage, db: Database
) -> None:
    assert not guard.degraded and guard.epoch
    epoch = guard.epoch
    server.kill()
    await async_wait_until(lambda: guard.degraded, "the outage noticed", 10)
    # Settled during the outage: journaled, kept until Redis answers.
    guard.journal.add("t1", guard.epoch, [(MONTH, 7)], None)
    server.start()  # no persistence: another data set
    await async_wait_until(lambda: not guard.degraded, "the return noticed", 10)
    assert guard.epoch != epoch and guard.journal.pending == 0
    assert guard.gateways == 1
    # A second gateway's heartbeat: both count two live gateways (the N of each share).
    redis = open_redis(server.url, 0.5)
    quota, journal = parts(redis, db)
    other = LimitsOutage(quota, journal, LocalLimits(db), GatewayMetrics(), RedisOutage.FAIL_OPEN)
    try:
        await other.probe()
        await async_wait_until(lambda: guard.gateways == 2, "two gateways counted", 10)
        assert other.gateways == 2
    finally:
        await other.stop()
        await redis.aclose()
    await async_wait_until(lambda: guard.gateways == 1, "the stopped one forgotten", 10)


async def test_a_hung_redis_stalls_no_caller(server: RedisServer, guard: LimitsOutage) -> None:
    """SIGSTOP: connections are accepted by the kernel and never answered. The heartbeat trips
    the breaker after the client's timeout; nothing on the loop waits meanwhile."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = loop.create_task(ticking())
        await async_wait_until(lambda: guard.degraded, "the hung Redis noticed", 10)
        ticker.cancel()
        assert ticks > 5  # the loop kept turning while the heartbeat waited
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    await async_wait_until(lambda: not guard.degraded, "the return noticed", 10)


async def test_a_refused_connection_is_known_unsent() -> None:
    from tests.conftest import free_port

    redis = open_redis(f"redis://127.0.0.1:{free_port()}/0", 0.5)
    try:
        with pytest.raises(LimitsUnavailable) as info:
            await RedisQuotaCounter(redis).used("t1", MONTH)
        assert unsent(info.value)
        assert not unsent(LimitsUnavailable("a timeout"))
    finally:
        await redis.aclose()
