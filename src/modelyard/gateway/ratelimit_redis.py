"""Rate limits kept in Redis, so that several gateway processes share each key's buckets: one
Lua script per acquire checks and takes both buckets atomically, timed by the server's clock;
and `RedisAdmission`, which admits a request (limits, quota, concurrency slot) in one script."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    QUOTA_TTL_S,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    shared_store,
)
from modelyard.gateway.rate_decision import EPS, Decision, check_tokens, decision

if TYPE_CHECKING:
    # Only for annotations: redis is needed at run time only by whoever builds a Redis client.
    from redis.asyncio import Redis

# Redis keys outlive the moment their bucket is full again by this much, so a key that comes
# back shortly after still finds its state while idle keys do not pile up.
IDLE_GRACE_MS = 120_000


# Take what was asked from each limited bucket and save it (level, server time, an expiry once
# it would be full again): the end of an admission in both scripts below.
_TAKE_LUA = f"""for i = 1, 2 do
  if caps[i] > 0 then
    levels[i] = levels[i] - needs[i]
    redis.call('HSET', KEYS[i], 'level', string.format('%.17g', levels[i]),
               'ts', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[i],
               string.format('%d', math.ceil((caps[i] - levels[i]) * 60000 / caps[i])
                                   + {IDLE_GRACE_MS}))
  end
end
"""

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
{_TAKE_LUA}end
return {{refused, string.format('%.17g', retry), string.format('%.17g', levels[1]),
        string.format('%.17g', levels[2])}}
"""

# Give `back` tokens (negative takes) to the token bucket KEYS[1] of capacity `cap`, refilled
# to the server's time first as an acquire would, never above its capacity. Expects the locals
# `cap` and `back`; the settlement script (settlement.py) runs it too.
GIVE_BACK_LUA = f"""local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local saved = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level, ts = tonumber(saved[1]), tonumber(saved[2])
if level == nil or ts == nil then
  level = cap
else
  level = math.min(cap, level + math.max(0, now - ts) * cap / 60)
end
level = math.min(cap, level + back)
redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level),
           'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1],
           string.format('%d', math.ceil((cap - level) * 60000 / cap) + {IDLE_GRACE_MS}))
"""

# KEYS: the token bucket. ARGV: tpm, reserved - actual (positive gives back, negative takes).
_RECONCILE_LUA = (
    "local cap, back = tonumber(ARGV[1]), tonumber(ARGV[2])\n" + GIVE_BACK_LUA + "return 1\n"
)

# One round trip for the whole admission of a request: the key's buckets, then the tenant's
# monthly quota, then its concurrency slot are checked, and only when all pass are all taken
# (a refusal takes nothing). KEYS: request bucket, token bucket, the month's quota counter, the
# tenant's slots. ARGV: rpm, tpm, tokens, quota (-1 none), slot limit (-1 none), slot id,
# slot lease s, quota ttl s. Returns {refused (0 none, 1 requests, 2 tokens, 3 quota,
# 4 concurrency), retry_after_s, request level, token level, quota total before}.
_ADMIT_LUA = (
    _ACQUIRE_LUA.split("if refused == 0 then")[0]
    + f"""
local levels_text = {{string.format('%.17g', levels[1]), string.format('%.17g', levels[2])}}
if refused ~= 0 then
  return {{refused, string.format('%.17g', retry), levels_text[1], levels_text[2], 0}}
end
local quota, slots = tonumber(ARGV[4]), tonumber(ARGV[5])
local before = 0
if quota >= 0 then
  before = tonumber(redis.call('GET', KEYS[3]) or '0')
  if before >= quota then
    return {{3, '0', levels_text[1], levels_text[2], before}}
  end
end
local lease = tonumber(ARGV[7])
if slots >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', string.format('%.6f', now - lease))
  if redis.call('ZCARD', KEYS[4]) >= slots then
    return {{4, '1', levels_text[1], levels_text[2], before}}
  end
end
{_TAKE_LUA}if quota >= 0 then
  redis.call('INCRBY', KEYS[3], ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[8])
end
if slots >= 0 then
  redis.call('ZADD', KEYS[4], string.format('%.6f', now), ARGV[6])
  redis.call('EXPIRE', KEYS[4], math.ceil(lease))
end
return {{0, '0', string.format('%.17g', levels[1]), string.format('%.17g', levels[2]), before}}
"""
)

_REASONS = {0: None, 1: "requests", 2: "tokens", 3: "quota", 4: "concurrency"}


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

    def key(self, key_id: str, kind: str) -> str:
        # The hash tag keeps both of a key's buckets in one Redis Cluster slot, which a
        # script touching both requires.
        return f"{self._prefix}{{{key_id}}}:{kind}"

    @shared_store
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        check_tokens(tokens)
        if limits.rpm is None and limits.tpm is None:
            return decision(limits, None, 0.0, None, None)
        result = await self._acquire(
            keys=[self.key(key_id, "requests"), self.key(key_id, "tokens")],
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
        await self._reconcile(keys=[self.key(key_id, "tokens")], args=[limits.tpm, delta])

    async def close(self) -> None:
        # Nothing of its own to release: the state lives in Redis and the client is borrowed.
        return None


@dataclass(frozen=True)
class Admitted:
    """What one `RedisAdmission.admit` came to: the key's rate-limit decision, and if that
    allowed it, whether the quota or the concurrency ceiling refused it (`refused`); on a
    refusal nothing was taken. `quota_before` is the month's total found (for the message)."""

    decision: Decision
    refused: str | None
    quota_before: int


class RedisAdmission:
    """The key's rate limits, the tenant's quota reservation and its concurrency slot in one
    Lua script: one Redis round trip to admit a request instead of three. It writes the keys
    `RedisRateLimiter`, `RedisQuotaCounter` and `RedisConcurrencyLimiter` use, so settlement
    (reconcile, quota moves, release) goes through them unchanged. A single Redis (or a shard
    chosen by tenant) holds them; a Redis Cluster would need them under one hash tag."""

    def __init__(
        self,
        limiter: RedisRateLimiter,
        quota: RedisQuotaCounter,
        slots: RedisConcurrencyLimiter,
    ) -> None:
        self._limiter, self._quota, self._slots = limiter, quota, slots
        self._admit = quota.redis.register_script(_ADMIT_LUA)

    @shared_store
    async def admit(
        self,
        key_id: str,
        limits: Limits,
        tokens: int,
        tenant_id: str,
        month: str,
        quota: int | None,
        slot_scope: str,
        slot_id: str,
        slot_limit: int | None,
    ) -> Admitted:
        check_tokens(tokens)
        result = await self._admit(
            keys=[
                self._limiter.key(key_id, "requests"),
                self._limiter.key(key_id, "tokens"),
                self._quota.key(tenant_id, month),
                self._slots.key(slot_scope),
            ],
            args=[
                limits.rpm or 0,
                limits.tpm or 0,
                tokens,
                -1 if quota is None else quota,
                -1 if slot_limit is None else slot_limit,
                slot_id,
                self._slots.lease_s,
                QUOTA_TTL_S,
            ],
        )
        refused, retry, requests, available, before = result
        reason = _REASONS[int(refused)]
        rate_refusal = reason if reason in ("requests", "tokens") else None
        decision_ = decision(
            limits,
            rate_refusal,
            float(retry) if rate_refusal else 0.0,
            None if limits.rpm is None else float(requests),
            None if limits.tpm is None else float(available),
        )
        return Admitted(decision_, None if rate_refusal else reason, int(before))
