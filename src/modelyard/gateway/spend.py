"""Spend counters of budgets in dollars: micro-dollars per budget and period, reserved at
admission against every budget a request falls under at once (all or nothing), settled to the
real cost afterwards. In process memory (one gateway) or in Redis (every gateway sharing them),
like the monthly token quota's counters (`quota.py`); every check-and-take is atomic, so a burst
overshoots a budget by at most one request's reservation.

A counter is seeded, the first time a process counts its period, with the cost of the usage rows
already written in it (`SET NX`: a counter another gateway holds is never overwritten), so a
restarted gateway (memory) starts from what was spent. In Redis the counters are also guarded
like the quota's (`quota.BuiltMarker`): a reservation or a read on a Redis server they were not
rebuilt on (it restarted, or a replica took over) changes nothing and raises
`SpendCountersLost`, and the budgets rebuild them from the usage rows (`spend_rebuild.py`).
A settlement carries the run id of the server its reservation was taken on, so it never gives
back a reservation the counters lost (see `RedisSpend.settle`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from modelyard.gateway.quota import (
    COUNTERS_LOST,
    QUOTA_TTL_S,
    BuiltMarker,
    CountersLost,
    lost_check,
    shared_store,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis


class SpendCountersLost(CountersLost):
    """The budgets' spend counters are lost (`quota.CountersLost`)."""


class SpendCounter(Protocol):
    async def seed(self, counter: str, micro: int) -> None:
        """Set the counter only if it holds nothing yet."""
        ...

    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> tuple[int, str]:
        """Atomically: if every counter is below its limit, add `micro` to each and return
        (-1, the run id of the Redis server that took it: "" in memory); else change nothing
        and return (the index of the first counter at its limit, "")."""
        ...

    async def settle(
        self, counters: list[str], reserved: int, cost: int, reserved_on: str
    ) -> list[int]:
        """Move each counter from the `reserved` micro-dollars a `reserve` that answered
        `reserved_on` took to the real `cost`; the new totals ([] when left to a rebuild)."""
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

    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> tuple[int, str]:
        for i, (counter, limit) in enumerate(zip(counters, limits, strict=True)):
            if self._totals.get(counter, 0) >= limit:
                return i, ""
        for counter in counters:
            self._totals[counter] = self._totals.get(counter, 0) + micro
        return -1, ""

    async def settle(
        self, counters: list[str], reserved: int, cost: int, reserved_on: str
    ) -> list[int]:
        for counter in counters:
            self._totals[counter] = self._totals.get(counter, 0) + cost - reserved
        return [self._totals[c] for c in counters]

    async def spent(self, counters: list[str]) -> list[int]:
        return [self._totals.get(c, 0) for c in counters]


# Every script: KEYS[1] is the marker, the counters follow; replies start with a status.
# ARGV: micro-dollars, ttl, then each counter's limit. {-1, run id} taken, {index, ''} refused.
_RESERVE_LUA = f"""{lost_check("KEYS[1]", f"{{{COUNTERS_LOST}, ''}}")}
for i = 2, #KEYS do
  if tonumber(redis.call('GET', KEYS[i]) or '0') >= tonumber(ARGV[i + 1]) then
    return {{i - 2, ''}}
  end
end
for i = 2, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return {{-1, run_id}}
"""

# ARGV: the ttl, the run id the reservation was taken on, cost - reserved, cost. {0, totals...}.
_SETTLE_LUA = f"""{lost_check("KEYS[1]", f"{{{COUNTERS_LOST}}}")}
local move = ARGV[3]
if ARGV[2] ~= run_id then
  move = ARGV[4]
end
local totals = {{0}}
for i = 2, #KEYS do
  totals[i] = redis.call('INCRBY', KEYS[i], move)
  redis.call('EXPIRE', KEYS[i], ARGV[1])
end
return totals
"""

# {0, totals...}
_SPENT_LUA = f"""{lost_check("KEYS[1]", f"{{{COUNTERS_LOST}}}")}
local totals = {{0}}
for i = 2, #KEYS do
  totals[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
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
        self.marker = BuiltMarker(redis, f"{prefix}built-on")  # no counter's name: no ':'
        self._reserve = redis.register_script(_RESERVE_LUA)
        self._settle = redis.register_script(_SETTLE_LUA)
        self._spent = redis.register_script(_SPENT_LUA)

    def key(self, counter: str) -> str:
        return self._prefix + counter

    def _keys(self, counters: list[str]) -> list[str]:
        return [self.marker.key, *(self._prefix + c for c in counters)]

    @shared_store
    async def seed(self, counter: str, micro: int) -> None:
        await self._redis.set(self.key(counter), micro, nx=True, ex=QUOTA_TTL_S)

    async def rebuild(self, totals: dict[str, int]) -> bool:
        """Set the counters to `totals` (from the usage rows) and mark them built on this
        server; False when another gateway did first (`BuiltMarker.rebuild`)."""
        keyed = {self.key(c): micro for c, micro in totals.items()}
        return await self.marker.rebuild(keyed, QUOTA_TTL_S)

    @shared_store
    async def reserve(self, counters: list[str], limits: list[int], micro: int) -> tuple[int, str]:
        status, run_id = await self._reserve(
            keys=self._keys(counters), args=[micro, QUOTA_TTL_S, *limits]
        )
        if int(status) == COUNTERS_LOST:
            raise SpendCountersLost("the spend counters in Redis are not rebuilt on this server")
        return int(status), run_id.decode() if isinstance(run_id, bytes) else str(run_id)

    @shared_store
    async def settle(
        self, counters: list[str], reserved: int, cost: int, reserved_on: str
    ) -> list[int]:
        """On the server the reservation was taken on, the counters move by `cost - reserved`.
        On another one whose counters were rebuilt since, the reservation is not in them (nor
        is this request's usage row, written after its settlement; a batch item's is committed
        before: `spend_rebuild.py`), so they take `cost`. On one not rebuilt yet, nothing
        changes (a counter Redis lost must not go below zero): the rebuild to come counts the
        usage row instead."""
        if not counters:
            return []
        reply = await self._settle(
            keys=self._keys(counters),
            args=[QUOTA_TTL_S, reserved_on, cost - reserved, cost],
        )
        status, *totals = (int(v) for v in reply)
        return [] if status == COUNTERS_LOST else totals

    @shared_store
    async def spent(self, counters: list[str]) -> list[int]:
        if not counters:
            return []
        status, *totals = (int(v) for v in await self._spent(keys=self._keys(counters)))
        if status == COUNTERS_LOST:
            raise SpendCountersLost("the spend counters in Redis are not rebuilt on this server")
        return totals
