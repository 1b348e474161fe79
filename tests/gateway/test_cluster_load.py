"""The gateways' counters reach the leading controller through Redis (real Redis): two gateways'
requests in flight per replica, queued requests and requests so far are summed into the
controller's routing table by difference (its own in-flight counts stay), a dead gateway's report
expires out of the sum, and a scale-from-zero request reaches the controller's activate verb."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from modelyard.control.cluster_load import LoadAggregator
from modelyard.core.cluster_keys import ACTIVATE_KEY
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.traffic_report import TrafficReporter
from tests.databases import fresh_redis
from tests.waiting import async_wait_until


@pytest.fixture()
def redis_url() -> Iterator[str]:
    with fresh_redis() as url:
        yield url


def table(in_flight: int, requests: int) -> tuple[RoutingTable, EndpointRoute]:
    routing = RoutingTable()
    route = EndpointRoute("ep-1", "tn-1", "tiny", True, None, 128)
    route.replicas = [ReplicaRoute("rep-a", "http://a"), ReplicaRoute("rep-b", "http://b")]
    route.replicas[0].outstanding = in_flight
    route.requests_total = requests
    routing.publish(route)
    return routing, route


def test_counters_summed_by_difference_and_activations_delivered(redis_url: str) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_url)
        try:
            g1_table, g1_route = table(in_flight=2, requests=10)
            g2_table, _ = table(in_flight=3, requests=5)
            g1, g2 = TrafficReporter(client, g1_table), TrafficReporter(client, g2_table)
            activated: list[str] = []
            c_table, c_route = table(in_flight=1, requests=0)  # 1: the controller's own request
            aggregator = LoadAggregator(client, c_table, activated.append)

            await g1.report()
            await g2.report()
            g1.activate("ep-1")
            # The activation is sent in the background: once it is in Redis.
            await async_wait_until(
                lambda: client.sismember(ACTIVATE_KEY, "ep-1"), "the activation in Redis"
            )
            await aggregator.tick()
            assert c_route.replicas[0].outstanding == 1 + 2 + 3
            assert c_route.requests_total == 15
            assert activated == ["ep-1"]

            g1_route.replicas[0].outstanding = 0
            g1_route.requests_total = 12
            await g1.report()
            await client.delete(g2.key)  # gateway 2 died: its report expired
            await aggregator.tick()
            assert c_route.replicas[0].outstanding == 1
            assert c_route.requests_total == 17  # requests only add
            assert activated == ["ep-1"]
        finally:
            await client.aclose()

    asyncio.run(run())
