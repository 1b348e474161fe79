"""Rate limits kept in Redis, so that several gateway processes share each key's buckets (and
its tenant's shared ones): one Lua script per acquire checks and takes all of them atomically,
timed by the server's clock; and `RedisAdmission`, which admits a request (limits, quota,
concurrency slot) in one script."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    QUOTA_TTL_S,
    QuotaCountersLost,
    RedisConcurrencyLimiter,
    RedisQuotaCounter,
    lost_check,
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
_TAKE_LUA = f"""for i = 1, 4 do
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

# KEYS: the key's request and token buckets, then its tenant's (hashes of level and ts).
# ARGV: the four capacities (rpm, tpm, tenant rpm, tenant tpm; 0 = unlimited, no state), tokens
# asked for. Returns {refused (0 none, 1 requests, 2 tokens), retry_after_s, the four levels};
# numbers go back as strings because Redis truncates Lua numbers to integers.
_ACQUIRE_LUA = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local caps = {{tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}}
local tokens = tonumber(ARGV[5])
local needs = {{1, tokens, 1, tokens}}
local kinds = {{1, 2, 1, 2}}
local eps = {EPS!r}
local levels = {{0, 0, 0, 0}}
for i = 1, 4 do
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
if (caps[2] > 0 and tokens > caps[2]) or (caps[4] > 0 and tokens > caps[4]) then
  refused, retry = 2, 60
else
  for i = 1, 4 do
    if caps[i] > 0 and levels[i] < needs[i] - eps then
      refused, retry = kinds[i], (needs[i] - levels[i]) * 60 / caps[i]
      break
    end
  end
end
local levels_text = {{}}
for i = 1, 4 do
  levels_text[i] = string.format('%.17g', levels[i])
end
if refused == 0 then
{_TAKE_LUA}  for i = 1, 4 do
    levels_text[i] = string.format('%.17g', levels[i])
  end
end
return {{refused, string.format('%.17g', retry), levels_text[1], levels_text[2], levels_text[3],
        levels_text[4]}}
"""

# Give `back` tokens (negative takes) to the token bucket `bucket` of capacity `cap`, refilled
# to the server's time first as an acquire would, never above its capacity. Expects the locals
# `bucket`, `cap` and `back`; the settlement script (settlement.py) runs it too.
GIVE_BACK_LUA = f"""local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local saved = redis.call('HMGET', bucket, 'level', 'ts')
local level, ts = tonumber(saved[1]), tonumber(saved[2])
if level == nil or ts == nil then
  level = cap
else
  level = math.min(cap, level + math.max(0, now - ts) * cap / 60)
end
level = math.min(cap, level + back)
redis.call('HSET', bucket, 'level', string.format('%.17g', level),
           'ts', string.format('%.6f', now))
redis.call('PEXPIRE', bucket,
           string.format('%d', math.ceil((cap - level) * 60000 / cap) + {IDLE_GRACE_MS}))
"""

# KEYS: the key's token bucket, its tenant's. ARGV: their capacities (0: none), reserved -
# actual (positive gives back, negative takes).
_RECONCILE_LUA = (
    "for i = 1, 2 do\n"
    "local bucket, cap, back = KEYS[i], tonumber(ARGV[i]), tonumber(ARGV[3])\n"
    "if cap > 0 then\n" + GIVE_BACK_LUA + "end\nend\nreturn 1\n"
)

# One round trip for the whole admission of a request: the key's and its tenant's buckets,
# then the tenant's monthly quota, then its concurrency slot are checked, and only when all
# pass are all taken (a refusal takes nothing). KEYS: the four buckets, the month's quota
# counter, the tenant's slots, the counters' marker (a quota is checked only against counters
# rebuilt on this server). ARGV: the four capacities, tokens, quota (-1 none), slot limit
# (-1 none), slot id, slot lease s, quota ttl s. Returns {refused (0 none, 1 requests,
# 2 tokens, 3 quota, 4 concurrency, 5 counters lost), retry_after_s, the four levels, quota
# total before}.
_LOST_REPLY = "{5, '0', levels_text[1], levels_text[2], levels_text[3], levels_text[4], 0}"
_ADMIT_LUA = (
    _ACQUIRE_LUA.split("if refused == 0 then")[0]
    + f"""
if refused ~= 0 then
  return {{refused, string.format('%.17g', retry), levels_text[1], levels_text[2],
          levels_text[3], levels_text[4], 0}}
end
local quota, slots = tonumber(ARGV[6]), tonumber(ARGV[7])
local before = 0
if quota >= 0 then
  {lost_check("KEYS[7]", _LOST_REPLY)}  before = tonumber(redis.call('GET', KEYS[5]) or '0')
  if before >= quota then
    return {{3, '0', levels_text[1], levels_text[2], levels_text[3], levels_text[4], before}}
  end
end
local lease = tonumber(ARGV[9])
if slots >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', string.format('%.6f', now - lease))
  if redis.call('ZCARD', KEYS[6]) >= slots then
    return {{4, '1', levels_text[1], levels_text[2], levels_text[3], levels_text[4], before}}
  end
end
{_TAKE_LUA}if quota >= 0 then
  redis.call('INCRBY', KEYS[5], ARGV[5])
  redis.call('EXPIRE', KEYS[5], ARGV[10])
end
if slots >= 0 then
  redis.call('ZADD', KEYS[6], string.format('%.6f', now), ARGV[8])
  redis.call('EXPIRE', KEYS[6], math.ceil(lease))
end
return {{0, '0', string.format('%.17g', levels[1]), string.format('%.17g', levels[2]),
        string.format('%.17g', levels[3]), string.format('%.17g', levels[4]), before}}
"""
)

_REASONS = {0: None, 1: "requests", 2: "tokens", 3: "quota", 4: "concurrency", 5: "lost"}


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
        # The hash tag keeps both of a key's buckets in one Redis Cluster slot (a tenant's
        # shared buckets are under `tenant:<id>`, a second tag: the scripts that touch both need
        # one Redis, as `RedisAdmission` does).
        return f"{self._prefix}{{{key_id}}}:{kind}"

    def bucket_keys(self, key_id: str, limits: Limits) -> tuple[list[str], list[int]]:
        """The Redis keys of `Limits.buckets` and their capacities (0: not limited)."""
        buckets = limits.buckets(key_id)
        return (
            [self.key(owner, kind) for owner, kind, _ in buckets],
            [cap or 0 for _, _, cap in buckets],
        )

    @shared_store
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        check_tokens(tokens)
        keys, caps = self.bucket_keys(key_id, limits)
        if not any(caps):
            return decision(limits, None, 0.0, [None] * 4)
        result = await self._acquire(keys=keys, args=[*caps, tokens])
        refused, retry, *levels = result
        return decision(limits, _REASONS[int(refused)], float(retry), _levels(caps, levels))

    @shared_store
    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        delta = reserved - actual
        keys, caps = self.bucket_keys(key_id, limits)
        if delta == 0 or not (caps[1] or caps[3]):
            return
        await self._reconcile(keys=[keys[1], keys[3]], args=[caps[1], caps[3], delta])

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
        keys, caps = self._limiter.bucket_keys(key_id, limits)
        result = await self._admit(
            keys=[
                *keys,
                self._quota.key(tenant_id, month),
                self._slots.key(slot_scope),
                self._quota.marker_key,
            ],
            args=[
                *caps,
                tokens,
                -1 if quota is None else quota,
                -1 if slot_limit is None else slot_limit,
                slot_id,
                self._slots.lease_s,
                QUOTA_TTL_S,
            ],
        )
        refused, retry, *levels, before = result
        reason = _REASONS[int(refused)]
        if reason == "lost":
            raise QuotaCountersLost("the quota counters in Redis are not rebuilt on this server")
        rate_refusal = reason if reason in ("requests", "tokens") else None
        decision_ = decision(
            limits,
            rate_refusal,
            float(retry) if rate_refusal else 0.0,
            _levels(caps, levels),
        )
        return Admitted(decision_, None if rate_refusal else reason, int(before))


def _levels(caps: list[int], levels: list[bytes | str]) -> list[float | None]:
    """The script's levels as numbers, None for the buckets that are not limited."""
    return [float(level) if cap else None for cap, level in zip(caps, levels, strict=True)]
