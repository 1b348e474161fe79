"""The one way the platform opens Redis: every client (limits, quotas, the gateways' load, the
leader's address) comes from `open_redis`, for one server or through Sentinel (the client asks
the Sentinels for the current primary, and asks again after a failover)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from modelyard.core.redis_url import SentinelTarget, parse_redis_url

if TYPE_CHECKING:
    from redis.asyncio import Redis


def open_redis(url: str, timeout_s: float) -> Redis:
    """The Redis client at `url` (`core/redis_url.py`; a bad URL raises `RedisUrlError`).

    Short timeouts: with Redis down, admission must answer within a second or two, not after a
    library's backoff. One immediate retry, on a new connection and for connection errors only:
    after a Redis restart or a failover every pooled connection is dead and fails its first
    command, which must not cost a request its answer; the retry's connect (through Sentinel:
    to the primary the Sentinels name now) is refused at once while none answers. A timeout is
    not retried (the script may have run)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    target = parse_redis_url(url)
    timeouts = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if not isinstance(target, SentinelTarget):
        return aioredis.from_url(url, retry=retry, **timeouts)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=dict(timeouts))
    client: Redis = sentinel.master_for(
        target.service_name,
        redis_class=_primary_client(),
        connection_class=_primary_following_connection(),
        db=target.db,
        username=target.username,
        password=target.password,
        retry=retry,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
    )
    client.sentinels = tuple(sentinel.sentinels)  # type: ignore[attr-defined]
    return client


@functools.cache
def _primary_client() -> type:
    """The primary's client, which closes its Sentinels' connections with its own."""
    import redis.asyncio as aioredis

    class PrimaryClient(aioredis.Redis):
        sentinels: tuple[aioredis.Redis, ...] = ()

        async def aclose(self, close_connection_pool: bool | None = None) -> None:
            await super().aclose(close_connection_pool)
            for sentinel in self.sentinels:
                await sentinel.aclose()

    return PrimaryClient


@functools.cache
def _primary_following_connection() -> type:
    """A Sentinel-managed connection that asks the Sentinels for the primary on EVERY connect.
    redis-py's asks only when the pool hands a connection out: a command retried on its own
    connection (our one retry, after the old primary died) reconnected to the dead address, so
    the first command after a failover failed on every pooled connection."""
    from redis.asyncio.sentinel import SentinelManagedConnection

    class PrimaryFollowingConnection(SentinelManagedConnection):
        async def _connect(self) -> None:
            if self.connection_pool.is_master:
                self.host, self.port = await self.connection_pool.get_master_address()
            await super()._connect()  # type: ignore[no-untyped-call]

    return PrimaryFollowingConnection
