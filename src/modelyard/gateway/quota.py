"""Per-tenant budgets the gateway holds while a request runs: the monthly token quota (reserved
at admission, settled to the real count afterwards) and the ceiling on requests in flight.

Both exist in process memory (one gateway) and in Redis (several gateways sharing them); every
check-and-take is atomic, so concurrent requests cannot all pass one check: a burst overshoots
the quota by at most one request's reservation and never exceeds the concurrency ceiling.
When Redis cannot be reached, every Redis-backed call raises `LimitsUnavailable`: the gateway
then admits on its own shares or fails closed (`limits_outage.py`), journals the settlement,
and still records the usage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from redis.exceptions import RedisError

if TYPE_CHECKING:
    from redis.asyncio import Redis

QUOTA_TTL_S = 40 * 24 * 3600
# A slot in Redis whose gateway died without releasing it is forgotten after this long (longer
# than any request may run: the gateway cuts unary requests at ~130 s, idle streams at ~35 s).
SLOT_LEASE_S = 900.0


P = ParamSpec("P")
R = TypeVar("R")


class LimitsUnavailable(RuntimeError):
    """The shared store of limits and quotas (Redis) cannot be reached."""


def shared_store(
    fn: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R]]:
    """Redis failures of a limits call, as the domain's `LimitsUnavailable`."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise LimitsUnavailable(f"the limits store is unreachable: {exc!r}") from exc

    return call


def open_limits_store(url: str, timeout_s: float) -> Redis:
    """The Redis client of the limits store. Short timeouts: with Redis down, admission must
    answer its 503 within a second or two, not after a library's backoff. One immediate retry,
    on a new connection and for connection errors only: after a Redis restart every pooled
    connection is dead and fails its first command, which must not cost a request its answer;
    with Redis still down the retry's connect is refused at once. A timeout is not retried (the
    script may have run)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return aioredis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )


def month_of(ts: datetime) -> str:
    """The quota month of a moment, like "2026-11", in UTC; a naive datetime is taken as UTC."""
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC)
    return f"{ts.year:04d}-{ts.month:02d}"


class QuotaCounter(Protocol):
    async def used(self, tenant_id: str, month: str) -> int:
        """Tokens the tenant has used (or holds reserved) in `month` ("2026-11"); 0 if none."""
        ...

    async def add(self, tenant_id: str, month: str, tokens: int) -> int:
        """Add `tokens` (negative gives back) to the month's total and return the new total."""
        ...

    async def seed(self, tenant_id: str, month: str, tokens: int) -> None:
        """Set the month's total only if none is recorded yet (restoring from the ledger)."""
        ...

    async def reserve(self, tenant_id: str, month: str, tokens: int, quota: int) -> int | None:
        """Atomically: if the month's total is below `quota`, add `tokens` and return the total
        before; else change nothing and return None."""
        ...


class MemoryQuotaCounter:
    """Monthly token totals in this process, for a single gateway process (atomic because
    nothing awaits between the check and the take)."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, str], int] = {}

    async def used(self, tenant_id: str, month: str) -> int:
        return self._totals.get((tenant_id, month), 0)

    async def add(self, tenant_id: str, month: str, tokens: int) -> int:
        total = self._totals.get((tenant_id, month), 0) + tokens
        self._totals[(tenant_id, month)] = total
        return total

    async def seed(self, tenant_id: str, month: str, tokens: int) -> None:
        self._totals.setdefault((tenant_id, month), tokens)

    async def reserve(self, tenant_id: str, month: str, tokens: int, quota: int) -> int | None:
        before = self._totals.get((tenant_id, month), 0)
        if before >= quota:
            return None
        self._totals[(tenant_id, month)] = before + tokens
        return before


# KEYS: the month's counter. ARGV: tokens, quota, ttl. Returns the total before, or -1 refused.
_RESERVE_LUA = """
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
if before >= tonumber(ARGV[2]) then
  return -1
end
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return before
"""


class RedisQuotaCounter:
    """Monthly token totals in Redis, shared by every gateway process using the same prefix.

    Keys expire ~40 days after their last write: past the end of their month, when nothing
    reads them any more. The client is borrowed, not closed here."""

    def __init__(self, redis: Redis, prefix: str = "modelyard:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._reserve = redis.register_script(_RESERVE_LUA)

    @property
    def redis(self) -> Redis:
        return self._redis

    def key(self, tenant_id: str, month: str) -> str:
        return f"{self._prefix}quota:{tenant_id}:{month}"

    @shared_store
    async def used(self, tenant_id: str, month: str) -> int:
        value = await self._redis.get(self.key(tenant_id, month))
        return 0 if value is None else int(value)

    @shared_store
    async def add(self, tenant_id: str, month: str, tokens: int) -> int:
        key = self.key(tenant_id, month)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incrby(key, tokens)
            pipe.expire(key, QUOTA_TTL_S)
            total, _ = await pipe.execute()
        return int(total)

    @shared_store
    async def seed(self, tenant_id: str, month: str, tokens: int) -> None:
        await self._redis.set(self.key(tenant_id, month), tokens, nx=True, ex=QUOTA_TTL_S)

    @shared_store
    async def reserve(self, tenant_id: str, month: str, tokens: int, quota: int) -> int | None:
        before = int(
            await self._reserve(
                keys=[self.key(tenant_id, month)], args=[tokens, quota, QUOTA_TTL_S]
            )
        )
        return None if before < 0 else before


class ConcurrencyLimiter(Protocol):
    async def acquire(self, scope: str, slot: str, limit: int) -> bool:
        """Take a slot named `slot` (unique per request) under `scope` (e.g. a tenant's
        interactive requests) if fewer than `limit` are held; False if the ceiling is reached."""
        ...

    async def release(self, scope: str, slot: str) -> None:
        """Give a slot back; releasing one not held does nothing."""
        ...

    async def held(self, scope: str) -> int:
        """Slots held now under `scope`."""
        ...


class MemoryConcurrencyLimiter:
    """Slots in this process, for a single gateway process."""

    def __init__(self) -> None:
        self._slots: dict[str, set[str]] = {}

    async def acquire(self, scope: str, slot: str, limit: int) -> bool:
        held = self._slots.setdefault(scope, set())
        if len(held) >= limit:
            return False
        held.add(slot)
        return True

    async def release(self, scope: str, slot: str) -> None:
        held = self._slots.get(scope)
        if held is None:
            return
        held.discard(slot)
        if not held:
            del self._slots[scope]

    async def held(self, scope: str) -> int:
        return len(self._slots.get(scope, ()))


# KEYS: the scope's sorted set (slot -> acquire time). ARGV: slot, limit, lease seconds.
# Slots older than the lease (a gateway that died holding them) are dropped first.
_SLOT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - lease))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(lease))
return 1
"""


class RedisConcurrencyLimiter:
    """Slots in Redis (a sorted set per scope), shared by every gateway using the same prefix.
    The client is borrowed, not closed here."""

    def __init__(
        self, redis: Redis, prefix: str = "modelyard:slots:", lease_s: float = SLOT_LEASE_S
    ) -> None:
        self._redis = redis
        self._prefix = prefix
        self.lease_s = lease_s
        self._acquire = redis.register_script(_SLOT_LUA)

    def key(self, scope: str) -> str:
        return self._prefix + scope

    @shared_store
    async def acquire(self, scope: str, slot: str, limit: int) -> bool:
        taken = await self._acquire(keys=[self._prefix + scope], args=[slot, limit, self.lease_s])
        return bool(int(taken))

    @shared_store
    async def release(self, scope: str, slot: str) -> None:
        await self._redis.zrem(self._prefix + scope, slot)

    @shared_store
    async def held(self, scope: str) -> int:
        return int(await self._redis.zcard(self._prefix + scope))


def concurrency_beside(quota: QuotaCounter) -> ConcurrencyLimiter:
    """Slots kept where the quota is kept: in the same Redis, or in this process."""
    if isinstance(quota, RedisQuotaCounter):
        return RedisConcurrencyLimiter(quota.redis)
    return MemoryConcurrencyLimiter()
