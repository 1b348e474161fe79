"""Adapter affinity: a registry adapter's requests placed by rendezvous hashing of its name,
bounded load, fallback to least-loaded.

Driven through the routing table's own `pick` (what the gateway calls for every request), with
the hint built the way the gateway builds it (`adapter_hint`).
"""

from __future__ import annotations

import math
from collections import Counter

from modelyard.core.adapter_affinity import AdapterHint, adapter_hint
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable


def endpoint(n: int, max_concurrency: int | None = None) -> EndpointRoute:
    route = EndpointRoute("ep-1", "t-1", "m", False, None, 4096)
    route.replicas = [
        ReplicaRoute(f"rep-{i}", f"http://127.0.0.1:{9000 + i}", max_concurrency=max_concurrency)
        for i in range(n)
    ]
    return route


def hint(name: str, factor: float = 1.25) -> AdapterHint:
    return adapter_hint(name, factor)


def pick(route: EndpointRoute, h: AdapterHint | None, hold: bool = False) -> ReplicaRoute:
    """One request: picked, and (unless `hold`) finished before the next."""
    r = RoutingTable.pick(route, prefix=h)
    assert r is not None
    if hold:
        r.outstanding += 1
    return r


def test_same_adapter_same_replica_and_adapters_spread() -> None:
    route = endpoint(4)
    homes = {}
    for t in range(200):
        h = hint(f"tn-{t}.adapter")
        first = pick(route, h)
        for _ in range(3):  # later requests for the same adapter: the same replica
            assert pick(route, hint(f"tn-{t}.adapter")) is first
        homes[t] = first.replica_id
    spread = Counter(homes.values())
    assert set(spread) == {"rep-0", "rep-1", "rep-2", "rep-3"}
    assert min(spread.values()) >= 25  # roughly even (50 each expected)


def test_a_replica_leaving_moves_only_its_own_adapters() -> None:
    route = endpoint(4)
    keys = [hint(f"tn-{t}.adapter") for t in range(200)]
    before = [pick(route, h).replica_id for h in keys]
    route.replicas = [r for r in route.replicas if r.replica_id != "rep-2"]
    after = [pick(route, h).replica_id for h in keys]
    for b, a in zip(before, after, strict=True):
        assert a == b or b == "rep-2"
    assert "rep-2" not in after


def test_bounded_load_spills_a_hot_adapter() -> None:
    """Requests held in flight: no replica goes past ceil(factor x fair share) while another
    is below it; the hot prefix fills its replica to the bound, then spills."""
    route = endpoint(3)
    hot = hint("tn-hot.adapter", factor=1.25)
    home = RoutingTable.pick(route, prefix=hot)
    assert home is not None
    for n in range(1, 31):
        chosen = pick(route, hot, hold=True)
        loads = [r.outstanding for r in route.replicas]
        cap = math.ceil(1.25 * n / 3)
        assert max(loads) <= cap, (n, loads)
        assert sum(loads) == n
        if n <= 1:
            assert chosen is home
    assert home.outstanding == math.ceil(1.25 * 30 / 3)  # full to its bound: 13 of 30
    assert sorted(r.outstanding for r in route.replicas) == [4, 13, 13]  # next in rank, then
    # A factor of 2 lets the home replica take twice its share: with 3 replicas, 2 of the first
    # 2 requests and 4 of 6 (ceil(2 x 6/3) = 4), the rest spilled.
    route2 = endpoint(3)
    h2 = hint("tn-other.adapter", factor=2.0)
    home2 = pick(route2, h2, hold=True)
    assert pick(route2, h2, hold=True) is home2
    assert pick(route2, h2, hold=True) is not home2
    for _ in range(3):
        pick(route2, h2, hold=True)
    assert home2.outstanding == 4 and sum(r.outstanding for r in route2.replicas) == 6


def test_fallbacks_full_tried_and_no_hint() -> None:
    route = endpoint(2, max_concurrency=1)
    h = hint("tn-1.adapter")
    home = pick(route, h, hold=True)
    other = pick(route, h, hold=True)  # home has no room: the other replica
    assert other is not home
    assert RoutingTable.pick(route, prefix=h) is None  # none has room: the caller waits
    home.outstanding = other.outstanding = 0
    assert RoutingTable.pick(route, exclude={home.replica_id}, prefix=h) is other  # retried
    home.ready = False  # out of routing: the prefix goes elsewhere
    assert pick(route, h) is other
    home.ready = True
    # No hint (embeddings, several prompts, or the setting off): least-loaded as before.
    route = endpoint(3)
    route.replicas[0].outstanding, route.replicas[1].outstanding = 3, 1
    route.replicas[2].outstanding = 2
    assert RoutingTable.pick(route) is route.replicas[1]
