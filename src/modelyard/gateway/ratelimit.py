"""Admission control for the gateway: per-API-key requests-per-minute and tokens-per-minute limits
kept as token buckets (in process memory for one gateway here, or in Redis so that several
gateways share them: `ratelimit_redis.py`), and the OpenAI-style rate-limit headers that report
them (`rate_decision.py`). (Monthly quotas and concurrency ceilings are in `quota.py`.)"""

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
    open_limits_store,
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
        requests_key, tokens_key = (key_id, "requests"), (key_id, "tokens")
        requests = None if limits.rpm is None else self._level(requests_key, limits.rpm, now)
        available = None if limits.tpm is None else self._level(tokens_key, limits.tpm, now)

        refused: str | None = None
        retry = 0.0
        if limits.tpm is not None and tokens > limits.tpm:
            refused, retry = "tokens", 60.0
        elif limits.rpm is not None and requests is not None and requests < 1 - EPS:
            refused, retry = "requests", (1 - requests) * 60.0 / limits.rpm
        elif limits.tpm is not None and available is not None and available < tokens - EPS:
            refused, retry = "tokens", (tokens - available) * 60.0 / limits.tpm

        if refused is None:
            if limits.rpm is not None and requests is not None:
                requests -= 1
                self._buckets[requests_key] = _Bucket(requests, now, limits.rpm)
            if limits.tpm is not None and available is not None:
                available -= tokens
                self._buckets[tokens_key] = _Bucket(available, now, limits.tpm)
        return decision(limits, refused, retry, requests, available)

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
    "open_limits_store",
]
