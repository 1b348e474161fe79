"""The routing table's index of tenants' registry adapters (`core/adapter_routes.py`) and the
adapter-affinity hint: a tenant finds only its own adapters, by name or pinned version, its own
base endpoint before a public one; an adapter's requests stay on one replica within bounded
load."""

from __future__ import annotations

from modelyard.core.adapter_affinity import adapter_hint
from modelyard.core.adapter_routes import internal_name, is_internal, target_for
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable


def _route(endpoint_id: str, tenant: str, public: bool) -> EndpointRoute:
    return EndpointRoute(endpoint_id, tenant, "smollm2", public, "mv-base", 64)


def test_each_tenant_resolves_only_its_own_adapters() -> None:
    table = RoutingTable()
    public, own = _route("ep-pub", "tn-sys", True), _route("ep-own", "tn-a", False)
    table.publish(public)
    table.publish(own)
    a1, a2 = internal_name("tn-a", "mv-01"), internal_name("tn-a", "mv-02")
    b1 = internal_name("tn-b", "mv-03")
    table.set_adapters(public, {("tn-a", "bot"): {1: a1}, ("tn-b", "bot"): {1: b1}})
    assert table.adapter_index.lookup("tn-a", "bot") is public
    assert table.adapter_index.lookup("tn-c", "bot") is None
    assert target_for(public, "tn-b", "bot").internal == b1  # type: ignore[union-attr]
    # The tenant's own endpoint of the base comes first; versions pin.
    table.set_adapters(own, {("tn-a", "bot"): {1: a1, 2: a2}})
    assert table.adapter_index.lookup("tn-a", "bot") is own
    assert target_for(own, "tn-a", "bot").ref == "bot:2"  # type: ignore[union-attr]
    assert target_for(own, "tn-a", "bot:1").internal == a1  # type: ignore[union-attr]
    assert target_for(own, "tn-a", "smollm2:bot").internal == a2  # type: ignore[union-attr]
    assert target_for(own, "tn-a", "bot:3") is None
    assert table.adapter_index.lookup("tn-a", "bot:3") is None
    assert target_for(public, "tn-c", "bot") is None and target_for(own, "tn-a", "smollm2") is None
    assert is_internal(a1) and not is_internal("bot")
    assert [n for n, _ in table.adapter_index.names("tn-a")] == ["bot"]
    # A removed endpoint leaves the index; adapters set on it afterwards do not bring it back.
    table.remove("ep-own")
    table.set_adapters(own, {("tn-a", "bot"): {1: a1}})
    assert table.adapter_index.lookup("tn-a", "bot") is public
    table.set_adapters(public, {})
    assert table.adapter_index.lookup("tn-a", "bot") is None
    assert not table.adapter_index.names("tn-b")


def test_an_adapters_requests_stay_on_one_replica_within_bounded_load() -> None:
    route = _route("ep-pub", "tn-sys", True)
    route.replicas = [ReplicaRoute(f"r{i}", f"http://r{i}") for i in range(4)]
    hint = adapter_hint("tn-a.mv-01", 1.25)
    first = RoutingTable.pick(route, prefix=hint)
    assert first is not None
    assert {RoutingTable.pick(route, prefix=hint) for _ in range(5)} == {first}
    first.outstanding = 10  # past its share: the adapter spills to another replica
    spill = RoutingTable.pick(route, prefix=hint)
    assert spill is not None and spill is not first
