"""Rate limits kept in Redis, so that several gateway processes share each key's buckets: one
Lua script per acquire checks and takes both buckets atomically, timed by the server's clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelyard.core.identity import Limits
from modelyard.gateway.quota import shared_store
from modelyard.gateway.rate_decision import EPS, Decision, check_tokens, decision

if TYPE_CHECKING:
    # Only for annotations: redis is needed at run time only by whoever builds a Redis client.
    from redis.asyncio import Redis

# Redis keys outlive the moment their bucket is full again by this much, so a key that comes
# back shortly after still finds its state while idle keys do not pile up.
_IDLE_GRACE_MS = 120_000


# KEYS: the request bucket and the token bucket (hashes of level and ts).
# ARGV: rpm, tpm (0 = unlimited, no state), tokens asked for.
# Returns {refused (0 none, 1 requests, 2 tokens), retry_after_s, request level, token level};
# numbers go back as strings because Redis truncates Lua numbers to integers.
_ACQUIRE_LUA = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local caps = {{tonumber(ARGV[1]), tonumber(ARGV[2])}}
local needs = {{1, tonumber(ARGV[3])}}
local eps = {EPS!r}
local levels = {{0, 0}}
for i = 1, 2 do
  if caps[i] > 0 then
    local saved = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level, ts = tonumber(saved[1]), tonumber(saved[2])
    if level == nil or ts == nil then
      levels[i] = caps[i]
    else
      levels[i] = math.min(caps[i], level + math.max(0, now - ts) * caps[i] / 60)
    end
  end
end
local refused, retry = 0, 0
if caps[2] > 0 and needs[2] > caps[2] then
  refused, retry = 2, 60
else
  for i = 1, 2 do
    if caps[i] > 0 and levels[i] < needs[i] - eps then
      refused, retry = i, (needs[i] - levels[i]) * 60 / caps[i]
      break
    end
  end
end
if refused == 0 then
  for i = 1, 2 do
    if caps[i] > 0 then
      levels[i] = levels[i] - needs[i]
      redis.call('HSET', KEYS[i], 'level', string.format('%.17g', levels[i]),
                 'ts', string.format('%.6f', now))
      redis.call('PEXPIRE', KEYS[i],
                 string.format('%d', math.ceil((caps[i] - levels[i]) * 60000 / caps[i])
                                     + {_IDLE_GRACE_MS}))
    end
  end
end
return {{refused, string.format('%.17g', retry), string.format('%.17g', levels[1]),
        string.format('%.17g', levels[2])}}
"""

# KEYS: the token bucket. ARGV: tpm, reserved - actual (positive gives back, negative takes).
_RECONCILE_LUA = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cap = tonumber(ARGV[1])
local delta = tonumber(ARGV[2])
local saved = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level, ts = tonumber(saved[1]), tonumber(saved[2])
if level == nil or ts == nil then
  level = cap
else
  level = math.min(cap, level + math.max(0, now - ts) * cap / 60)
end
level = math.min(cap, level + delta)
redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level),
           'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1],
           string.format('%d', math.ceil((cap - level) * 60000 / cap) + {_IDLE_GRACE_MS}))
return 1
"""

_REASONS = {0: None, 1: "requests", 2: "tokens"}


class RedisRateLimiter:
    """Token buckets in Redis, shared by every gateway process using the same prefix.

    Each acquire is one Lua script, so the check and the take of both buckets happen atomically
    on the server, timed by the server's clock so that gateways with skewed clocks agree.
    The client is borrowed (typically shared with `RedisQuotaCounter`); its owner closes it."""

    def __init__(self, redis: Redis, prefix: str = "modelyard:rl:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._acquire = redis.register_script(_ACQUIRE_LUA)
        self._reconcile = redis.register_script(_RECONCILE_LUA)

    def _key(self, key_id: str, kind: str) -> str:
        # The hash tag keeps both of a key's buckets in one Redis Cluster slot, which a
        # script touching both requires.
        return f"{self._prefix}{{{key_id}}}:{kind}"

    @shared_store
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        check_tokens(tokens)
        if limits.rpm is None and limits.tpm is None:
            return decision(limits, None, 0.0, None, None)
        result = await self._acquire(
            keys=[self._key(key_id, "requests"), self._key(key_id, "tokens")],
            args=[limits.rpm or 0, limits.tpm or 0, tokens],
        )
        refused, retry, requests, available = result
        return decision(
            limits,
            _REASONS[int(refused)],
            float(retry),
            None if limits.rpm is None else float(requests),
            None if limits.tpm is None else float(available),
        )

    @shared_store
    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        delta = reserved - actual
        if limits.tpm is None or delta == 0:
            return
        await self._reconcile(keys=[self._key(key_id, "tokens")], args=[limits.tpm, delta])

    async def close(self) -> None:
        # Nothing of its own to release: the state lives in Redis and the client is borrowed.
        return None
