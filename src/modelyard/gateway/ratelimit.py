"""Admission control for the gateway: per-API-key requests-per-minute and tokens-per-minute
limits, and the tenant's ceilings as buckets all its keys share, kept as token buckets (in
process memory for one gateway here, or in Redis so that several gateways share them:
`ratelimit_redis.py`), and the OpenAI-style rate-limit headers that report them
(`rate_decision.py`). (Monthly quotas and concurrency ceilings are in `quota.py`.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Callers import every limiter and counter from here, whichever store keeps it.
from modelyard.core.identity import Limits
from modelyard.gateway.quota import (
    MemoryQuotaCounter,
    QuotaCounter,
    RedisQuotaCounter,
    month_of,
)
from modelyard.gateway.rate_decision import (
    EPS,
    Decision,
    RateLimiter,
    check_tokens,
    decision,
    format_reset,
)
from modelyard.gateway.ratelimit_redis import RedisRateLimiter

# Memory buckets that have refilled completely are forgotten every this many acquires.
_SWEEP_EVERY = 1024


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
        check_tokens(tokens)
        now = self._clock()
        self._acquires += 1
        if self._acquires % _SWEEP_EVERY == 0:
            self._sweep(now)
        buckets = limits.buckets(key_id)
        needs = [1, tokens, 1, tokens]
        levels = [
            None if cap is None else self._level((owner, kind), cap, now)
            for owner, kind, cap in buckets
        ]
        refused: str | None = None
        retry = 0.0
        if any(cap is not None and tokens > cap for _, kind, cap in buckets if kind == "tokens"):
            refused, retry = "tokens", 60.0
        else:
            # The key's requests, then its tokens, then the tenant's: the first short one says.
            for (_, kind, cap), level, need in zip(buckets, levels, needs, strict=True):
                if cap is not None and level is not None and level < need - EPS:
                    refused, retry = kind, (need - level) * 60.0 / cap
                    break
        if refused is None:
            for i, ((owner, kind, cap), level) in enumerate(zip(buckets, levels, strict=True)):
                if cap is not None and level is not None:
                    levels[i] = level - needs[i]
                    self._buckets[(owner, kind)] = _Bucket(level - needs[i], now, cap)
        return decision(limits, refused, retry, levels)

    async def reconcile(self, key_id: str, limits: Limits, reserved: int, actual: int) -> None:
        delta = reserved - actual
        if delta == 0:
            return
        now = self._clock()
        for owner, kind, cap in limits.buckets(key_id):
            if kind != "tokens" or cap is None:
                continue
            key = (owner, kind)
            level = self._level(key, cap, now) + delta
            self._buckets[key] = _Bucket(min(float(cap), level), now, cap)

    async def close(self) -> None:
        self._buckets.clear()


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
