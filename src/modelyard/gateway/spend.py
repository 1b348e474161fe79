"""Spend counters of budgets in dollars: micro-dollars per budget and period, reserved at
admission against every budget a request falls under at once (all or nothing), settled to the
real cost afterwards. In process memory (one gateway) or in Redis (every gateway sharing them),
like the monthly token quota's counters (`quota.py`); every check-and-take is atomic, so a burst
overshoots a budget by at most one request's reservation.

A counter is seeded, the first time a process counts its period, with the cost of the usage rows
already written in it (`SET NX`: a counter another gateway holds is never overwritten), so a
restarted gateway (memory) or a Redis that lost its data starts from what was spent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from modelyard.gateway.quota import QUOTA_TTL_S, shared_store

if TYPE_CHECKING:
    from redis.asyncio import Redis


class SpendCounter(Protocol):
    async def seed(self, counter: str, micro: int) -> None:
        """Set the counter only if it holds nothing yet."""
        ...

    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> int:
        """Atomically: if every counter is below its limit, add `micro` to each and return -1;
        else change nothing and return the index of the first counter at its limit."""
        ...

    async def add(self, moves: list[tuple[str, int]]) -> list[int]:
        """Add each move's micro-dollars (negative gives back); the new totals."""
        ...

    async def spent(self, counters: list[str]) -> list[int]:
        """The counters' totals (0 for one not held)."""
        ...


class MemorySpend:
    """Counters in this process (atomic because nothing awaits between check and take)."""

    def __init__(self) -> None:
        self._totals: dict[str, int] = {}

    async def seed(self, counter: str, micro: int) -> None:
        self._totals.setdefault(counter, micro)

    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> int:
        for i, (counter, limit) in enumerate(zip(counters, limits, strict=True)):
            if self._totals.get(counter, 0) >= limit:
                return i
        for counter in counters:
            self._totals[counter] = self._totals.get(counter, 0) + micro
        return -1

    async def add(self, moves: list[tuple[str, int]]) -> list[int]:
        totals = []
        for counter, micro in moves:
            self._totals[counter] = self._totals.get(counter, 0) + micro
            totals.append(self._totals[counter])
        return totals

    async def spent(self, counters: list[str]) -> list[int]:
        return [self._totals.get(c, 0) for c in counters]


# KEYS: the counters. ARGV: micro-dollars, ttl, then each counter's limit.
_RESERVE_LUA = """
for i = 1, #KEYS do
  if tonumber(redis.call('GET', KEYS[i]) or '0') >= tonumber(ARGV[i + 2]) then
    return i - 1
  end
end
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return -1
"""

# KEYS: the counters. ARGV: the ttl, then each counter's move.
_ADD_LUA = """
local totals = {}
for i = 1, #KEYS do
  totals[i] = redis.call('INCRBY', KEYS[i], ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], ARGV[1])
end
return totals
"""


class RedisSpend:
    """Counters in Redis, shared by every gateway using the same prefix. The client is
    borrowed, not closed here. (With several counters in one script, a Redis Cluster would
    need them in one hash slot: the platform uses one Redis, or Sentinel.)"""

    def __init__(self, redis: Redis, prefix: str = "modelyard:spend:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._reserve = redis.register_script(_RESERVE_LUA)
        self._add = redis.register_script(_ADD_LUA)

    def _key(self, counter: str) -> str:
        return self._prefix + counter

    @shared_store
    async def seed(self, counter: str, micro: int) -> None:
        await self._redis.set(self._key(counter), micro, nx=True, ex=QUOTA_TTL_S)

    @shared_store
    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> int:
        keys = [self._key(c) for c in counters]
        return int(await self._reserve(keys=keys, args=[micro, QUOTA_TTL_S, *limits]))

    @shared_store
    async def add(self, moves: list[tuple[str, int]]) -> list[int]:
        if not moves:
            return []
        keys = [self._key(c) for c, _ in moves]
        totals = await self._add(keys=keys, args=[QUOTA_TTL_S, *(m for _, m in moves)])
        return [int(t) for t in totals]

    @shared_store
    async def spent(self, counters: list[str]) -> list[int]:
        if not counters:
            return []
        values = await self._redis.mget([self._key(c) for c in counters])
        return [0 if v is None else int(v) for v in values]
