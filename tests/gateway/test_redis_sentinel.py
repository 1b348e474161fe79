"""The gateway's Redis client through Sentinel (`gateway/redis_connect.py`), on real processes
(`tests/redis_sentinel.py`): after the primary is SIGKILLed and the replica promoted, the next
command on every pooled connection reaches the new primary (with redis-py's own Sentinel
connection, which reconnects a retried command to the address it had, these commands failed
after the promotion: checked), and until the promotion the limits calls fail as
`LimitsUnavailable` (admission's 503)."""

from __future__ import annotations

import asyncio

import pytest

from modelyard.core.identity import Limits
from modelyard.gateway.quota import LimitsUnavailable
from modelyard.gateway.ratelimit import RedisRateLimiter
from modelyard.gateway.redis_connect import open_redis
from tests.redis_sentinel import SentinelRedis, printed_on_failure

pytestmark = pytest.mark.timeout(120)


async def test_pooled_connections_follow_a_failover() -> None:
    with SentinelRedis(sentinels=1) as redis_set, printed_on_failure(redis_set.logs):
        client = open_redis(redis_set.url, 1.0)
        limiter = RedisRateLimiter(client)
        limits = Limits(rpm=1000, tpm=None)
        try:
            # Requests at once leave as many connections in the pool.
            await asyncio.gather(*(limiter.acquire(f"k{i}", limits, 1) for i in range(4)))
            assert len(client.connection_pool._available_connections) == 4
            redis_set.kill_primary()
            with pytest.raises(LimitsUnavailable):  # no primary until the promotion
                await limiter.acquire("k0", limits, 1)
            redis_set.wait_promoted()
            decisions = await asyncio.gather(
                *(limiter.acquire(f"k{i}", limits, 1) for i in range(4))
            )
            assert all(d.allowed for d in decisions)
            port = client.connection_pool._available_connections[0].port
            assert port == redis_set.replica_port
        finally:
            await client.aclose()
