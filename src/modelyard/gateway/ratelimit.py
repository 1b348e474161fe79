"""Admission control for the gateway: per-API-key requests-per-minute and tokens-per-minute limits
kept as token buckets (in process memory for one gateway, or in Redis so that several gateways
share them), and the OpenAI-style rate-limit headers that report them. (Monthly quotas and
concurrency ceilings are in `quota.py`.)"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

# The quota counters live in `quota.py`; re-exported because callers import them from here.
from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    MemoryQuotaCounter,
    QuotaCounter,
    RedisQuotaCounter,
    month_of,
    shared_store,
)

if TYPE_CHECKING:
    # Only for annotations: redis is needed at run time only by whoever builds a Redis client.
    from redis.asyncio import Redis

# Float refill arithmetic lands a hair short of whole numbers (0.1 * 3 < 0.3); without this
# slack a client that waits exactly retry_after_s could be refused again.
_EPS = 1e-9
# Redis keys outlive the moment their bucket is full again by this much, so a key that comes
# back shortly after still finds its state while idle keys do not pile up.
_IDLE_GRACE_MS = 120_000
# Memory buckets that have refilled completely are forgotten every this many acquires.
_SWEEP_EVERY = 1024


@dataclass(frozen=True)
class Decision:
    """The outcome of one `acquire`, with what the rate-limit headers report."""

    allowed: bool
    reason: str | None
    retry_after_s: float
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limited buckets, plus retry-after on refusal."""
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(remaining or 0)
            out[f"x-ratelimit-reset-{kind}"] = format_reset(reset)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's style): "250ms", "1.5s", "6m0s",
    "1h2m3s". Rounded up to the millisecond so a client never retries too early."""
    total_ms = max(0, math.ceil(seconds * 1000 - _EPS))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    sec_text = f"{secs}.{millis:03d}".rstrip("0") if millis else str(secs)
    if hours:
        return f"{hours}h{minutes}m{sec_text}s"
    if minutes:
        return f"{minutes}m{sec_text}s"
    return f"{sec_text}s"


class RateLimiter(Protocol):
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        """Take one request and `tokens` tokens from the key's buckets, both or neither."""
        ...

    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        """Correct the token bucket once the real usage of a request that reserved
        `reserved` tokens is known."""
        ...

    async def close(self) -> None: ...


def _decision(
    limits: Limits,
    refused: str | None,
    retry_after_s: float,
    requests_level: float | None,
    tokens_level: float | None,
) -> Decision:
    def remaining(level: float | None) -> int | None:
        # A debt left by reconcile is internal; clients are told there is nothing left.
        return None if level is None else max(0, math.floor(level + _EPS))

    def reset(limit: int | None, level: float | None) -> float:
        if limit is None or level is None:
            return 0.0
        return max(0.0, (limit - level) * 60.0 / limit)

    return Decision(
        allowed=refused is None,
        reason=refused,
        retry_after_s=retry_after_s,
        limit_requests=limits.rpm,
        remaining_requests=remaining(requests_level),
        reset_requests_s=reset(limits.rpm, requests_level),
        limit_tokens=limits.tpm,
        remaining_tokens=remaining(tokens_level),
        reset_tokens_s=reset(limits.tpm, tokens_level),
    )


def _check_tokens(tokens: int) -> None:
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, got {tokens}")


@dataclass
class _Bucket:
    level: float
    stamp: float
    capacity: int


class MemoryRateLimiter:
    """Token buckets in this process, for a single gateway process.

    Atomic without a lock because nothing awaits between reading and writing the buckets, so
    no other coroutine can interleave; it is not meant to be shared across threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._acquires = 0

    def _level(self, key: tuple[str, str], capacity: int, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return float(capacity)
        elapsed = max(0.0, now - bucket.stamp)
        return min(float(capacity), bucket.level + elapsed * capacity / 60.0)

    def _sweep(self, now: float) -> None:
        full = [
            key
            for key, bucket in self._buckets.items()
            if self._level(key, bucket.capacity, now) >= bucket.capacity
        ]
        for key in full:
            del self._buckets[key]

    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        _check_tokens(tokens)
        now = self._clock()
        self._acquires += 1
        if self._acquires % _SWEEP_EVERY == 0:
            self._sweep(now)
        requests_key, tokens_key = (key_id, "requests"), (key_id, "tokens")
        requests = None if limits.rpm is None else self._level(requests_key, limits.rpm, now)
        available = None if limits.tpm is None else self._level(tokens_key, limits.tpm, now)

        refused: str | None = None
        retry = 0.0
        if limits.tpm is not None and tokens > limits.tpm:
            refused, retry = "tokens", 60.0
        elif limits.rpm is not None and requests is not None and requests < 1 - _EPS:
            refused, retry = "requests", (1 - requests) * 60.0 / limits.rpm
        elif limits.tpm is not None and available is not None and available < tokens - _EPS:
            refused, retry = "tokens", (tokens - available) * 60.0 / limits.tpm

        if refused is None:
            if limits.rpm is not None and requests is not None:
                requests -= 1
                self._buckets[requests_key] = _Bucket(requests, now, limits.rpm)
            if limits.tpm is not None and available is not None:
                available -= tokens
                self._buckets[tokens_key] = _Bucket(available, now, limits.tpm)
        return _decision(limits, refused, retry, requests, available)

    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        delta = reserved - actual
        if limits.tpm is None or delta == 0:
            return
        now = self._clock()
        key = (key_id, "tokens")
        level = self._level(key, limits.tpm, now) + delta
        self._buckets[key] = _Bucket(min(float(limits.tpm), level), now, limits.tpm)

    async def close(self) -> None:
        self._buckets.clear()


# KEYS: the request bucket and the token bucket (hashes of level and ts).
# ARGV: rpm, tpm (0 = unlimited, no state), tokens asked for.
# Returns {refused (0 none, 1 requests, 2 tokens), retry_after_s, request level, token level};
# numbers go back as strings because Redis truncates Lua numbers to integers.
_ACQUIRE_LUA = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local caps = {{tonumber(ARGV[1]), tonumber(ARGV[2])}}
local needs = {{1, tonumber(ARGV[3])}}
local eps = {_EPS!r}
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
        _check_tokens(tokens)
        if limits.rpm is None and limits.tpm is None:
            return _decision(limits, None, 0.0, None, None)
        result = await self._acquire(
            keys=[self._key(key_id, "requests"), self._key(key_id, "tokens")],
            args=[limits.rpm or 0, limits.tpm or 0, tokens],
        )
        refused, retry, requests, available = result
        return _decision(
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


__all__ = [
    "Decision",
    "Limits",
    "MemoryQuotaCounter",
    "MemoryRateLimiter",
    "QuotaCounter",
    "RateLimiter",
    "RedisQuotaCounter",
    "RedisRateLimiter",
    "format_reset",
    "month_of",
]
