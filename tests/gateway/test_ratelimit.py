"""Rate limits and quotas: the same behaviour checked on the in-memory backend (with a fake clock)
and on a real Redis at 127.0.0.1:6379 (with short real waits)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest

from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    ConcurrencyLimiter,
    LimitsUnavailable,
    MemoryConcurrencyLimiter,
    RedisConcurrencyLimiter,
)
from modelyard.gateway.ratelimit import (
    Decision,
    MemoryQuotaCounter,
    MemoryRateLimiter,
    QuotaCounter,
    RateLimiter,
    RedisQuotaCounter,
    RedisRateLimiter,
    format_reset,
    month_of,
)
from tests.conftest import free_port

if TYPE_CHECKING:
    from redis.asyncio import Redis

REDIS_HOST = "127.0.0.1"
REDIS_PORT = 6379


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RedisEnv:
    """A reachable Redis and a key prefix of this test's own, deleted afterwards."""

    prefix: str

    def connect(self) -> Redis:
        import redis.asyncio

        return redis.asyncio.Redis(host=REDIS_HOST, port=REDIS_PORT)


@pytest.fixture(scope="session")
def redis_unavailable() -> str | None:
    """Why the Redis backend cannot be tested, or None; found out once per run, without the
    client's retries, so that a missing server costs seconds rather than minutes."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        return "the redis package is not installed, so the Redis backend cannot be tested"
    client = redis.Redis(
        host=REDIS_HOST, port=REDIS_PORT, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
    )
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT} ({exc})"
    finally:
        client.close()
    return None


@pytest.fixture
def redis_env(redis_unavailable: str | None) -> Iterator[RedisEnv]:
    if redis_unavailable is not None:
        pytest.skip(redis_unavailable)
    import redis

    admin = redis.Redis(host=REDIS_HOST, port=REDIS_PORT)
    env = RedisEnv(prefix=f"modelyard-test:{uuid.uuid4().hex}:")
    try:
        yield env
    finally:
        keys = list(admin.scan_iter(match=env.prefix + "*"))
        if keys:
            admin.delete(*keys)
        admin.close()


@dataclass
class Backend:
    limiter: RateLimiter
    # Lets bucket time pass: moves the fake clock, or really sleeps for Redis.
    advance: Callable[[float], Awaitable[None]]
    # How far a measured duration may fall short of the ideal because real time passed.
    slack: float


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    limiter: RateLimiter
    if request.param == "memory":
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        limiter = MemoryRateLimiter(clock)
        yield Backend(limiter, advance, 1e-6)
        await limiter.close()
    else:
        env: RedisEnv = request.getfixturevalue("redis_env")
        client = env.connect()
        limiter = RedisRateLimiter(client, prefix=env.prefix)
        yield Backend(limiter, asyncio.sleep, 0.25)
        await limiter.close()
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def quota(request: pytest.FixtureRequest) -> AsyncIterator[QuotaCounter]:
    if request.param == "memory":
        yield MemoryQuotaCounter()
    else:
        env: RedisEnv = request.getfixturevalue("redis_env")
        client = env.connect()
        counter = RedisQuotaCounter(client, prefix=env.prefix)
        await counter.rebuild("2026-01", {})  # as a gateway's start does (from no usage rows)
        yield counter
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def slots(request: pytest.FixtureRequest) -> AsyncIterator[ConcurrencyLimiter]:
    if request.param == "memory":
        yield MemoryConcurrencyLimiter()
    else:
        env: RedisEnv = request.getfixturevalue("redis_env")
        client = env.connect()
        yield RedisConcurrencyLimiter(client, prefix=env.prefix)
        await client.aclose()


def key() -> str:
    return f"key_{uuid.uuid4().hex[:8]}"


# --- headers and formatting ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9999, "1m0s"),
        (360, "6m0s"),
        (361.25, "6m1.25s"),
        (3723, "1h2m3s"),
        (7200, "2h0m0s"),
    ],
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_headers_when_allowed() -> None:
    decision = Decision(
        allowed=True,
        reason=None,
        retry_after_s=0.0,
        limit_requests=60,
        remaining_requests=59,
        reset_requests_s=1.0,
        limit_tokens=150_000,
        remaining_tokens=149_000,
        reset_tokens_s=0.4,
    )
    assert decision.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149000",
        "x-ratelimit-reset-tokens": "400ms",
    }


def test_headers_when_refused_omit_unlimited_and_add_retry_after() -> None:
    decision = Decision(
        allowed=False,
        reason="tokens",
        retry_after_s=2.1,
        limit_requests=None,
        remaining_requests=None,
        reset_requests_s=0.0,
        limit_tokens=1000,
        remaining_tokens=3,
        reset_tokens_s=360.0,
    )
    assert decision.headers() == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "3",
        "x-ratelimit-reset-tokens": "6m0s",
        "retry-after": "3",
    }
    short = Decision(False, "requests", 0.2, 10, 0, 5.0, None, None, 0.0)
    assert short.headers()["retry-after"] == "1"


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Limits(rpm=0, tpm=None)
    with pytest.raises(ValueError):
        Limits(rpm=None, tpm=-5)


# --- token buckets, on both backends ---------------------------------------------------------


async def test_allowed_until_empty_then_refused(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=5, tpm=None)
    for expected in (4, 3, 2, 1, 0):
        d = await backend.limiter.acquire(k, limits, 10)
        assert d.allowed and d.reason is None and d.retry_after_s == 0
        assert d.remaining_requests == expected
        assert d.limit_requests == 5 and d.limit_tokens is None and d.remaining_tokens is None
    refused = await backend.limiter.acquire(k, limits, 10)
    assert not refused.allowed
    assert refused.reason == "requests"
    # One request refills in 60 / 5 = 12 s.
    assert 12 - backend.slack <= refused.retry_after_s <= 12
    assert refused.remaining_requests == 0
    assert 60 - backend.slack <= refused.reset_requests_s <= 60
    assert refused.headers()["retry-after"] == "12"


async def test_tokens_refused_with_time_until_enough(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=None, tpm=100)
    first = await backend.limiter.acquire(k, limits, 60)
    assert first.allowed and first.remaining_tokens == 40
    refused = await backend.limiter.acquire(k, limits, 50)
    assert not refused.allowed and refused.reason == "tokens"
    # 10 more tokens at 100 / 60 per second.
    assert 6 - backend.slack <= refused.retry_after_s <= 6
    assert refused.remaining_tokens == 40


async def test_all_or_nothing(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=5, tpm=100)
    d = await backend.limiter.acquire(k, limits, 80)
    assert d.allowed and d.remaining_requests == 4 and d.remaining_tokens == 20
    refused = await backend.limiter.acquire(k, limits, 50)
    assert not refused.allowed and refused.reason == "tokens"
    assert refused.remaining_requests == 4
    # The refused request consumed neither a request nor tokens.
    d = await backend.limiter.acquire(k, limits, 10)
    assert d.allowed and d.remaining_requests == 3 and d.remaining_tokens == 10


async def test_requests_checked_first(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=1, tpm=100)
    assert (await backend.limiter.acquire(k, limits, 10)).allowed
    # Both buckets are short now; the request bucket is the one reported.
    refused = await backend.limiter.acquire(k, limits, 95)
    assert not refused.allowed and refused.reason == "requests"
    assert 60 - backend.slack <= refused.retry_after_s <= 60
    assert refused.remaining_tokens == 90


async def test_refill_over_time(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=60, tpm=None)
    for _ in range(60):
        assert (await backend.limiter.acquire(k, limits, 0)).allowed
    refused = await backend.limiter.acquire(k, limits, 0)
    assert not refused.allowed and 1 - backend.slack <= refused.retry_after_s <= 1
    await backend.advance(refused.retry_after_s + 0.05)
    assert (await backend.limiter.acquire(k, limits, 0)).allowed
    assert not (await backend.limiter.acquire(k, limits, 0)).allowed

    k, limits = key(), Limits(rpm=None, tpm=600)
    assert (await backend.limiter.acquire(k, limits, 600)).remaining_tokens == 0
    # 10 tokens a second.
    await backend.advance(0.5)
    assert (await backend.limiter.acquire(k, limits, 5)).allowed
    assert not (await backend.limiter.acquire(k, limits, 5)).allowed


async def test_refused_at_exactly_retry_after_boundary_memory() -> None:
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock)
    limits = Limits(rpm=3, tpm=None)
    for _ in range(3):
        assert (await limiter.acquire("k", limits, 0)).allowed
    refused = await limiter.acquire("k", limits, 0)
    assert refused.retry_after_s == pytest.approx(20)
    clock.now += refused.retry_after_s - 0.01
    assert not (await limiter.acquire("k", limits, 0)).allowed
    clock.now += 0.01
    allowed = await limiter.acquire("k", limits, 0)
    assert allowed.allowed and allowed.remaining_requests == 0
    clock.now += 60
    assert (await limiter.acquire("k", limits, 0)).remaining_requests == 2


async def test_request_larger_than_capacity(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=10, tpm=100)
    refused = await backend.limiter.acquire(k, limits, 101)
    assert not refused.allowed and refused.reason == "tokens"
    assert refused.retry_after_s == 60
    assert refused.remaining_requests == 10 and refused.remaining_tokens == 100
    d = await backend.limiter.acquire(k, limits, 100)
    assert d.allowed and d.remaining_requests == 9 and d.remaining_tokens == 0


async def test_reconcile_gives_back_up_to_capacity(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=None, tpm=60)
    assert (await backend.limiter.acquire(k, limits, 50)).remaining_tokens == 10
    await backend.limiter.reconcile(k, limits, reserved=50, actual=20)
    assert (await backend.limiter.acquire(k, limits, 0)).remaining_tokens == 40
    await backend.limiter.reconcile(k, limits, reserved=1000, actual=0)
    assert (await backend.limiter.acquire(k, limits, 0)).remaining_tokens == 60


async def test_reconcile_takes_extra_into_debt_that_refills(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=None, tpm=6000)
    assert (await backend.limiter.acquire(k, limits, 6000)).remaining_tokens == 0
    await backend.limiter.reconcile(k, limits, reserved=6000, actual=6050)
    refused = await backend.limiter.acquire(k, limits, 50)
    assert not refused.allowed and refused.reason == "tokens"
    assert refused.remaining_tokens == 0
    # 50 of debt plus 50 asked for, at 100 tokens a second.
    assert 1 - backend.slack <= refused.retry_after_s <= 1
    await backend.advance(1.1)
    assert (await backend.limiter.acquire(k, limits, 50)).allowed


async def test_reconcile_on_an_unseen_key_starts_from_full(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=None, tpm=60)
    await backend.limiter.reconcile(k, limits, reserved=10, actual=30)
    assert (await backend.limiter.acquire(k, limits, 0)).remaining_tokens == 40


async def test_unlimited(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=None, tpm=None)
    for _ in range(100):
        d = await backend.limiter.acquire(k, limits, 1_000_000)
        assert d.allowed and d.remaining_requests is None and d.remaining_tokens is None
    assert d.headers() == {}
    await backend.limiter.reconcile(k, limits, reserved=0, actual=5_000_000)

    k, limits = key(), Limits(rpm=None, tpm=10)
    d = await backend.limiter.acquire(k, limits, 10)
    assert d.allowed and d.remaining_requests is None and d.remaining_tokens == 0
    assert "x-ratelimit-limit-requests" not in d.headers()
    refused = await backend.limiter.acquire(k, limits, 1)
    assert not refused.allowed and refused.reason == "tokens"


async def test_concurrent_acquires_let_exactly_the_limit_through(backend: Backend) -> None:
    k, limits = key(), Limits(rpm=20, tpm=None)
    decisions = await asyncio.gather(*(backend.limiter.acquire(k, limits, 1) for _ in range(50)))
    assert sum(d.allowed for d in decisions) == 20
    assert {d.reason for d in decisions if not d.allowed} == {"requests"}

    k, limits = key(), Limits(rpm=1000, tpm=200)
    decisions = await asyncio.gather(*(backend.limiter.acquire(k, limits, 10) for _ in range(50)))
    assert sum(d.allowed for d in decisions) == 20


# --- Redis specifics -------------------------------------------------------------------------


async def test_redis_keeps_no_state_for_unlimited_and_expires_idle_keys(
    redis_env: RedisEnv,
) -> None:
    client = redis_env.connect()
    limiter = RedisRateLimiter(client, prefix=redis_env.prefix)
    try:
        await limiter.acquire("free", Limits(rpm=None, tpm=None), 100)
        await limiter.acquire("half", Limits(rpm=None, tpm=100), 100)
        keys = sorted([k.decode() async for k in client.scan_iter(match=redis_env.prefix + "*")])
        assert keys == [f"{redis_env.prefix}{{half}}:tokens"]
        # Empty bucket: full again in 60 s, then two idle minutes.
        ttl = await client.pttl(keys[0])
        assert 170_000 < ttl <= 180_000
        level, stamp = await client.hmget(keys[0], "level", "ts")
        assert float(level) == 0 and float(stamp) > 1_600_000_000
    finally:
        await limiter.close()
        await client.aclose()


async def test_redis_gateways_share_buckets(redis_env: RedisEnv) -> None:
    # Two gateways: separate clients, separate limiters, one Redis.
    clients = [redis_env.connect(), redis_env.connect()]
    first, second = (RedisRateLimiter(c, prefix=redis_env.prefix) for c in clients)
    limits = Limits(rpm=3, tpm=None)
    try:
        assert (await first.acquire("k", limits, 0)).allowed
        assert (await second.acquire("k", limits, 0)).allowed
        assert (await first.acquire("k", limits, 0)).remaining_requests == 0
        assert not (await second.acquire("k", limits, 0)).allowed
    finally:
        for c in clients:
            await c.aclose()


# --- monthly quota ---------------------------------------------------------------------------


async def test_quota_add_used_seed(quota: QuotaCounter) -> None:
    assert await quota.used("t1", "2026-11") == 0
    assert await quota.add("t1", "2026-11", 10) == 10
    assert await quota.add("t1", "2026-11", 5) == 15
    assert await quota.used("t1", "2026-11") == 15
    # Seed does not overwrite a total that is already there.
    await quota.seed("t1", "2026-11", 1000)
    assert await quota.used("t1", "2026-11") == 15
    # Months and tenants are separate.
    assert await quota.used("t1", "2026-12") == 0
    assert await quota.used("t2", "2026-11") == 0
    await quota.seed("t2", "2026-11", 100)
    assert await quota.used("t2", "2026-11") == 100
    assert await quota.add("t2", "2026-11", 1) == 101
    await quota.seed("t2", "2026-11", 0)
    assert await quota.used("t2", "2026-11") == 101


async def test_quota_concurrent_adds(quota: QuotaCounter) -> None:
    totals = await asyncio.gather(*(quota.add("t", "2026-01", 3) for _ in range(40)))
    assert sorted(totals) == list(range(3, 121, 3))
    assert await quota.used("t", "2026-01") == 120


async def test_redis_quota_keys_and_expiry(redis_env: RedisEnv) -> None:
    client = redis_env.connect()
    counter = RedisQuotaCounter(client, prefix=redis_env.prefix)
    try:
        await counter.add("acme", "2026-11", 7)
        await counter.seed("acme", "2026-12", 9)
        for month, value in (("2026-11", b"7"), ("2026-12", b"9")):
            name = f"{redis_env.prefix}quota:acme:{month}"
            assert await client.get(name) == value
            ttl: Any = await client.ttl(name)
            assert 39 * 86_400 < ttl <= 40 * 86_400
    finally:
        await client.aclose()


async def test_quota_reservations_let_a_burst_overshoot_by_at_most_one(
    quota: QuotaCounter,
) -> None:
    """Forty concurrent reservations of 30 tokens against a quota of 100: each is admitted only
    while the total (reservations included) is below the quota, so four get in (0, 30, 60,
    90) and the total ends at 120, one reservation past the quota."""
    results = await asyncio.gather(*(quota.reserve("t", "2026-01", 30, 100) for _ in range(40)))
    admitted = sorted(r for r in results if r is not None)
    assert admitted == [0, 30, 60, 90]
    assert await quota.used("t", "2026-01") == 120
    # Settling to the real use and refunding move the total back; then there is room again.
    await quota.add("t", "2026-01", 5 - 30)  # one used 5 of its 30
    for _ in range(3):
        await quota.add("t", "2026-01", -30)  # three failed
    assert await quota.used("t", "2026-01") == 5
    assert await quota.reserve("t", "2026-01", 30, 100) == 5
    # A tenant at its quota is refused, even for a request reserving nothing.
    await quota.add("t", "2026-01", 65)
    assert await quota.reserve("t", "2026-01", 0, 100) is None
    assert await quota.used("t", "2026-01") == 100


async def test_concurrency_slots(slots: ConcurrencyLimiter) -> None:
    scope = f"tn-{uuid.uuid4().hex[:6]}:requests"
    taken = await asyncio.gather(*(slots.acquire(scope, f"r{i}", 3) for i in range(10)))
    assert sum(taken) == 3 and await slots.held(scope) == 3
    holders = [f"r{i}" for i, ok in enumerate(taken) if ok]
    assert not await slots.acquire(scope, "late", 3)
    await slots.release(scope, holders[0])
    await slots.release(scope, "never-held")  # nothing happens
    assert await slots.held(scope) == 2
    assert await slots.acquire(scope, "late", 3)
    # Scopes are separate.
    assert await slots.acquire(scope + "x", "r0", 1)
    for slot in [*holders[1:], "late"]:
        await slots.release(scope, slot)
    assert await slots.held(scope) == 0


async def test_redis_slots_of_a_dead_gateway_expire(redis_env: RedisEnv) -> None:
    client = redis_env.connect()
    try:
        slots = RedisConcurrencyLimiter(client, prefix=redis_env.prefix, lease_s=0.3)
        assert await slots.acquire("s", "a", 1)
        assert not await slots.acquire("s", "b", 1)
        await asyncio.sleep(0.4)  # "a" is never released: its gateway died
        assert await slots.acquire("s", "b", 1)
        assert await slots.held("s") == 1
    finally:
        await client.aclose()


def test_month_of() -> None:
    assert month_of(datetime(2026, 11, 30, 23, 59, tzinfo=UTC)) == "2026-11"
    assert month_of(datetime(2026, 1, 1)) == "2026-01"
    # Midnight on 1 December in UTC+2 is still November in UTC.
    plus_two = timezone(timedelta(hours=2))
    assert month_of(datetime(2026, 12, 1, 1, 0, tzinfo=plus_two)) == "2026-11"


@pytest.fixture()
def database_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'usage.db'}"


async def test_an_unreachable_redis_is_limits_unavailable(database_url: str) -> None:
    """Every Redis-backed call raises the domain's `LimitsUnavailable` (admission turns it into a
    503), and a request settled meanwhile still gets its usage row."""
    import redis.asyncio
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from modelyard.core.identity import Principal
    from modelyard.core.routing import EndpointRoute
    from modelyard.gateway.accounting import Accounting
    from modelyard.gateway.call import NO_LIMITS, Call
    from modelyard.gateway.metering import UsageRecorder
    from modelyard.gateway.metrics import GatewayMetrics
    from modelyard.store.db import Database

    client = redis.asyncio.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    quota = RedisQuotaCounter(client)
    slots = RedisConcurrencyLimiter(client)
    limiter = RedisRateLimiter(client)
    calls: list[Awaitable[Any]] = [
        limiter.acquire("k", Limits(10, None), 1),
        limiter.reconcile("k", Limits(None, 100), 5, 1),
        quota.reserve("t", "2026-01", 5, 100),
        quota.add("t", "2026-01", 5),
        quota.used("t", "2026-01"),
        slots.acquire("s", "a", 1),
        slots.release("s", "a"),
    ]
    for call in calls:
        with pytest.raises(LimitsUnavailable):
            await call
    db = Database(database_url)
    db.migrate()
    recorder = UsageRecorder(db)
    # Settled as the gateway settles a served request: its TPM, quota and slot in one script
    # that cannot run, and its row written all the same.
    accounting = Accounting(limiter, quota, slots, recorder, GatewayMetrics())
    principal = Principal(
        key_id="k", key_name="k", tenant_id="t", tenant_name="t",
        scopes=frozenset({"inference"}), limits=Limits(rpm=10, tpm=100),
        monthly_token_quota=1000, platform_admin=False, max_concurrent_requests=1,
    )  # fmt: skip
    route = EndpointRoute("ep", "t", "m", False, None, 4096)
    call = Call(principal, route, "chat.completions", "req-1", 20, NO_LIMITS)
    call.prompt_tokens, call.completion_tokens = 3, 4
    call.quota_reserved, call.quota_month, call.slot = 20, "2026-01", True
    await accounting.close(call, served=True)
    await recorder.stop()
    assert recorder.written == 1
    await client.aclose()
    db.dispose()
