"""Which node classes a replica may use (`spot_policy`), and the static provider's fixed fleet."""

from __future__ import annotations

from modelyard.control.node_provider import (
    Choice,
    NodeClass,
    StaticNodeProvider,
    Workload,
    preference,
)

ON_DEMAND, SPOT = NodeClass.ON_DEMAND, NodeClass.SPOT


def test_batch_goes_to_spot_first_and_real_time_to_on_demand_first() -> None:
    batch, real_time = Workload.BATCH, Workload.REAL_TIME
    assert preference(batch, "batch") == [SPOT, ON_DEMAND]
    assert preference(real_time, "batch") == [ON_DEMAND]
    assert preference(batch, "overflow") == [SPOT, ON_DEMAND]
    assert preference(real_time, "overflow") == [ON_DEMAND, SPOT]
    assert preference(batch, "never") == preference(real_time, "never") == [ON_DEMAND]


def test_the_static_provider_places_anywhere_and_never_asks_or_releases() -> None:
    static = StaticNodeProvider()
    assert static.choose(Workload.BATCH, {"CPU": 1.0}) == Choice(None, True)
    assert static.request("r1", [{"CPU": 1.0}], ON_DEMAND).replica_id == "r1"
    assert static.release("node-a") is False and static.nodes() == []
