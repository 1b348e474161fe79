"""The replicas' prefix digests reach every gateway through Redis (real Redis, the real publisher
and mirror, no processes): what the leader's health checks set on its routing table is applied
to a gateway's table with its generation; an unchanged digest is neither written nor fetched
again; a replica that left, or digests no leader renews, leave the gateway's table; a new term
replaces its predecessor's; malformed or oversized data is refused, and a round fetches a
bounded number of digests."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from modelyard.control.digest_publisher import DigestPublisher
from modelyard.core.cluster_keys import DIGEST_STAMPS_KEY, DIGESTS_KEY
from modelyard.core.prefix_keys import MAX_DIGEST_KEYS, encode_digest, share_digest
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway import digest_mirror
from modelyard.gateway.digest_mirror import DigestMirror
from tests.databases import fresh_redis


@pytest.fixture()
def redis_url() -> Iterator[str]:
    with fresh_redis() as url:
        yield url


def table(n: int = 2) -> tuple[RoutingTable, EndpointRoute]:
    routing = RoutingTable()
    route = EndpointRoute("ep-1", "tn-1", "tiny", True, None, 128)
    route.replicas = [ReplicaRoute(f"rep-{i}", f"http://r{i}") for i in range(n)]
    routing.publish(route)
    return routing, route


def keys(*names: str) -> frozenset[bytes]:
    return frozenset(name.encode().ljust(8, b"-") for name in names)


def seen(route: EndpointRoute) -> list[tuple[int, frozenset[bytes]]]:
    return [(r.cache.generation, r.cache.held) for r in route.replicas]


def test_the_leaders_digests_reach_a_gateway(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url)
        try:
            leader, l_route = table()
            gateway, g_route = table()
            a, b = l_route.replicas
            a.cache.update(keys("a1", "a2"), 3)  # as the leader's health check sets it
            publisher, mirror = DigestPublisher(client, leader), DigestMirror(client, gateway)
            assert await publisher.publish() == 1  # b has not reported one yet
            assert await mirror.refresh() == 1
            assert seen(g_route) == [(3, keys("a1", "a2")), (-1, frozenset())]
            assert 0 < await client.pttl(DIGESTS_KEY) <= 30_000  # lapses without a leader

            # The next probe reports the same digest: nothing written, nothing fetched.
            a.cache.update(frozenset(keys("a1", "a2")), 3)
            assert await publisher.publish() == 0
            assert await mirror.refresh() == 0
            # A block evicted on one, a first report from the other.
            a.cache.update(keys("a1"), 4)
            b.cache.update(keys("b1"), 1)
            assert await publisher.publish() == 2
            assert await mirror.refresh() == 2
            assert seen(g_route) == [(4, keys("a1")), (1, keys("b1"))]

            # The route mirror replaced a replica's route (its address moved): fetched again.
            g_route.replicas = [ReplicaRoute("rep-0", "http://moved"), g_route.replicas[1]]
            assert await mirror.refresh() == 1
            assert seen(g_route)[0] == (4, keys("a1"))

            # A replica that left the leader's table leaves the gateway's digests.
            l_route.replicas = [a]
            await publisher.publish()
            await mirror.refresh()
            assert seen(g_route) == [(4, keys("a1")), (-1, frozenset())]
            assert await client.hkeys(DIGESTS_KEY) == [b"ep-1/rep-0"]

            # Lost (a Redis restart, or lapsed): the gateway forgets; the leader writes it again.
            await client.delete(DIGESTS_KEY, DIGEST_STAMPS_KEY)
            await mirror.refresh()
            assert seen(g_route)[0] == (-1, frozenset())
            assert await publisher.publish() == 0  # unchanged here, found gone
            assert await publisher.publish() == 1
            assert await mirror.refresh() == 1
            assert seen(g_route)[0] == (4, keys("a1"))

            # A new term's publisher replaces what its predecessor left.
            await client.hset(DIGESTS_KEY, "ep-gone/rep-9", share_digest(1, keys("x")))
            await client.hset(DIGEST_STAMPS_KEY, "ep-gone/rep-9", "0123")
            assert await DigestPublisher(client, leader).publish() == 1
            assert await client.hkeys(DIGEST_STAMPS_KEY) == [b"ep-1/rep-0"]
        finally:
            await client.aclose()

    asyncio.run(run())


def test_malformed_or_oversized_digests_are_refused(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url)
        try:
            gateway, route = table(6)
            full = [i.to_bytes(8, "big") for i in range(MAX_DIGEST_KEYS)]
            values = {
                "rep-0": share_digest(7, full),  # the most a digest holds: taken
                "rep-1": "7 " + base64.b64encode(b"".join(full) + b"one more").decode(),
                "rep-2": "seven " + encode_digest(full[:1]),  # no generation
                "rep-3": "7 not base64!",
                "rep-4": "7 AAAA",  # not whole keys
                "rep-5": share_digest(7, full[:1]),  # its stamp is too long
            }
            stamps = {f"ep-1/{r}": "s" for r in values} | {"ep-1/rep-5": "s" * 65}
            await client.hset(DIGESTS_KEY, mapping={f"ep-1/{r}": v for r, v in values.items()})
            await client.hset(DIGEST_STAMPS_KEY, mapping=stamps)
            mirror = DigestMirror(client, gateway)
            assert await mirror.refresh() == 1
            assert mirror.refused == 5
            assert seen(route) == [(7, frozenset(full))] + [(-1, frozenset())] * 5
            assert await mirror.refresh() == 0 and mirror.refused == 5  # not fetched again
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_round_fetches_a_bounded_number_of_digests(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url)
        try:
            n = digest_mirror.MAX_FETCH + 6
            leader, l_route = table(n)
            gateway, g_route = table(n)
            for i, r in enumerate(l_route.replicas):
                r.cache.update(keys(f"k{i}"), i)
            assert await DigestPublisher(client, leader).publish() == n
            mirror = DigestMirror(client, gateway)
            assert await mirror.refresh() == digest_mirror.MAX_FETCH
            assert await mirror.refresh() == 6  # the rest, the next round
            assert seen(g_route) == [(i, keys(f"k{i}")) for i in range(n)]
        finally:
            await client.aclose()

    asyncio.run(run())
