"""Per-tenant budgets the gateway holds while a request runs: the monthly token quota (reserved
at admission, settled to the real count afterwards) and the ceiling on requests in flight.

Both exist in process memory (one gateway) and in Redis (several gateways sharing them); every
check-and-take is atomic, so concurrent requests cannot all pass one check: a burst overshoots
the quota by at most one request's reservation and never exceeds the concurrency ceiling.
When Redis cannot be reached, every Redis-backed call raises `LimitsUnavailable`: the gateway
then admits on its own shares or fails closed (`limits_outage.py`), journals the settlement,
and still records the usage.
When Redis answers but lost the counters (a restart, a failover), a reservation raises
`QuotaCountersLost` until they are rebuilt from the usage rows (`quota_rebuild.py`); the
budgets' spend counters (`spend.py`) are guarded by the same marker mechanism (`BuiltMarker`).
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


class CountersLost(LimitsUnavailable):
    """Redis answers, but the counters it holds were not built on this server: it restarted
    (empty, or from an older snapshot) or a replica took over (`BuiltMarker`). They are rebuilt
    from the usage rows (`quota_rebuild.py`) before anything is checked against them again."""


class QuotaCountersLost(CountersLost):
    """The monthly quota counters are lost (`CountersLost`)."""


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


# The run id of the Redis server running a script: a new one at every restart, and another
# server's after a failover. A set of counters is trusted only on the server whose run id its
# marker (`BuiltMarker`) holds: the one they were rebuilt on.
RUN_ID_LUA = "local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')\n"
COUNTERS_LOST = -2


def lost_check(marker: str, lost: str = str(COUNTERS_LOST)) -> str:
    """Lua that sets `run_id` and returns `lost` (a Lua expression) unless the marker (the Lua
    expression of its key, e.g. "KEYS[1]") holds it: the head of every script that checks
    against counters which Redis may have lost."""
    return f"{RUN_ID_LUA}if redis.call('GET', {marker}) ~= run_id then\n  return {lost}\nend\n"


# KEYS: the marker, then the counters. ARGV: the ttl, then each counter's total (0: deleted).
# Sets them only if no other gateway rebuilt them on this server first; 1 if it did.
_REBUILD_LUA = f"""{RUN_ID_LUA}
if redis.call('GET', KEYS[1]) == run_id then
  return 0
end
for i = 2, #KEYS do
  if tonumber(ARGV[i]) > 0 then
    redis.call('SET', KEYS[i], ARGV[i], 'EX', ARGV[1])
  else
    redis.call('DEL', KEYS[i])
  end
end
redis.call('SET', KEYS[1], run_id)
return 1
"""

_BUILT_LUA = f"""{RUN_ID_LUA}
return redis.call('GET', KEYS[1]) == run_id and 1 or 0
"""


class BuiltMarker:
    """The marker of a set of counters in Redis: the run id of the server they were rebuilt on
    (`key`). Every script that checks against them starts with `lost_check(...)` on it, so on
    a server that restarted or took over it changes nothing and reports the loss; `rebuild`
    sets them and the marker in one script, once per server (one gateway's rebuild wins)."""

    def __init__(self, redis: Redis, key: str) -> None:
        self.key = key
        self._rebuild = redis.register_script(_REBUILD_LUA)
        self._built = redis.register_script(_BUILT_LUA)

    @shared_store
    async def built(self) -> bool:
        """Whether the counters were rebuilt on the Redis server that answers now."""
        return bool(int(await self._built(keys=[self.key])))

    @shared_store
    async def rebuild(self, totals: dict[str, int], ttl_s: int) -> bool:
        """Set each counter (a Redis key) to its total (0: deleted) and mark them built on this
        server; False (nothing changed) when another gateway did first."""
        done = await self._rebuild(keys=[self.key, *totals], args=[ttl_s, *totals.values()])
        return bool(int(done))


# KEYS: the month's counter, the marker. ARGV: tokens, quota, ttl. Returns the total before,
# -1 refused, or COUNTERS_LOST.
_RESERVE_LUA = f"""{lost_check("KEYS[2]")}
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
    reads them any more. A reservation is refused with `QuotaCountersLost` until the counters
    have been rebuilt on the server that answers (`rebuild`). The client is borrowed, not
    closed here."""

    def __init__(self, redis: Redis, prefix: str = "modelyard:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._reserve = redis.register_script(_RESERVE_LUA)
        self.marker = BuiltMarker(redis, f"{prefix}quota-built-on")

    @property
    def redis(self) -> Redis:
        return self._redis

    def key(self, tenant_id: str, month: str) -> str:
        return f"{self._prefix}quota:{tenant_id}:{month}"

    @property
    def marker_key(self) -> str:
        """Holds the run id of the Redis server the counters were last rebuilt on."""
        return self.marker.key

    async def built(self) -> bool:
        """Whether the counters were rebuilt on the Redis server that answers now."""
        return await self.marker.built()

    @shared_store
    async def rebuild(self, month: str, totals: dict[str, int]) -> bool:
        """Set the month's counters to `totals` (the usage rows' sums per tenant), the others
        found in Redis to nothing, and mark them built on this server; False (nothing changed)
        when another gateway did first."""
        found = [k async for k in self._redis.scan_iter(match=self.key("*", month), count=1000)]
        counters = {self.key(t, month): tokens for t, tokens in totals.items()}
        for key in found:
            counters.setdefault(key.decode() if isinstance(key, bytes) else key, 0)
        return await self.marker.rebuild(counters, QUOTA_TTL_S)

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
                keys=[self.key(tenant_id, month), self.marker_key],
                args=[tokens, quota, QUOTA_TTL_S],
            )
        )
        if before == COUNTERS_LOST:
            raise QuotaCountersLost("the quota counters in Redis are not rebuilt on this server")
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
