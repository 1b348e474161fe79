"""The canary SLO gate's cluster-wide numbers (`gateway/outcome_report.py` writes them,
`control/cluster_outcomes.py` sums them) on a real Redis: two gateways' outcomes of one
endpoint's versions come back as one window, failures and p95 included (the p95 within the
histogram's 10 %); an endpoint without a canary costs Redis nothing; a version's window keeps
only its own requests."""

from __future__ import annotations

import asyncio

from modelyard.control.cluster_outcomes import ClusterOutcomes
from modelyard.core.outcome_counts import bin_upper_s, latency_bin
from modelyard.core.routing import EndpointRoute, RoutingTable, VersionWindow
from modelyard.gateway.outcome_report import OutcomeReporter
from modelyard.gateway.redis_connect import open_redis
from tests.databases import fresh_redis


def _table(weights: dict[str, int]) -> RoutingTable:
    table = RoutingTable()
    for endpoint_id, w in (("ep-canary", weights), ("ep-plain", {"v1": 100})):
        route = EndpointRoute(endpoint_id, "t", endpoint_id, False, "v1", 100)
        table.publish(route)
        table.set_weights(route, w)
    return table


def test_latency_bins_bound_each_latency_within_ten_percent() -> None:
    for latency in (0.0005, 0.001, 0.0173, 0.25, 3.0, 42.0):
        upper = bin_upper_s(latency_bin(latency))
        assert max(latency, 0.001) <= upper * (1 + 1e-9) and upper <= max(latency, 0.001) * 1.1


def test_two_gateways_outcomes_are_judged_as_one() -> None:
    async def run(url: str) -> tuple[VersionWindow, VersionWindow, VersionWindow, list[bytes]]:
        redis = open_redis(url, 5.0)
        try:
            gateways = [OutcomeReporter(redis, _table({"v1": 50, "v2": 50})) for _ in range(2)]
            for _ in range(10):  # the canary fails at the first gateway ...
                gateways[0].record("ep-canary", "v2", False, None)
            for _ in range(5):  # ... and answers at the second
                gateways[1].record("ep-canary", "v2", True, 0.2)
            for i in range(100):  # the stable version, at both: 10 ms .. 1 s
                gateways[i % 2].record("ep-canary", "v1", True, (i + 1) / 100)
            gateways[1].record("ep-plain", "v1", False, None)  # no canary: not written
            for g in gateways:
                await g.flush()
            reader = ClusterOutcomes(redis)
            assert reader.window("ep-canary", "v2", 60) == VersionWindow()  # not fetched yet
            reader.window("ep-canary", "v1", 60)
            await reader.fetch()
            keys = [k async for k in redis.scan_iter(match="modelyard:outcomes:*")]
            return (
                reader.window("ep-canary", "v2", 60),
                reader.window("ep-canary", "v1", 60),
                reader.window("ep-canary", "v3", 60),
                keys,
            )
        finally:
            await redis.aclose()

    with fresh_redis() as url:
        canary, stable, other, keys = asyncio.run(run(url))
    assert (canary.samples, canary.errors) == (15, 10)
    assert canary.p95_s is not None and 0.2 <= canary.p95_s <= 0.22
    assert (stable.samples, stable.errors) == (100, 0)
    # The in-memory rank (`VersionStats`): the 96th of 100 latencies, 0.96 s.
    assert stable.p95_s is not None and 0.96 <= stable.p95_s <= 0.96 * 1.1
    assert other == VersionWindow()  # a version no gateway saw
    assert all(b"ep-plain" not in k for k in keys) and keys
