"""`RoutingTable.resolve` answers from its model-name index exactly what a scan of `visible`
answers (the tenant's own endpoints first, then public ones it does not shadow), through
publishes, republishes under another name and removals."""

from __future__ import annotations

import random

from modelyard.core.routing import EndpointRoute, RoutingTable


def scan(table: RoutingTable, tenant_id: str, model: str) -> EndpointRoute | None:
    for route in table.visible(tenant_id):
        if model in (route.model_name, route.endpoint_id):
            return route
    return None


def route(i: int, tenant: str, name: str, public: bool) -> EndpointRoute:
    return EndpointRoute(
        endpoint_id=f"ep-{i}",
        tenant_id=tenant,
        model_name=name,
        public=public,
        version_id=None,
        max_tokens_cap=64,
    )


def test_resolve_matches_a_scan_of_visible() -> None:
    rng = random.Random(7)
    tenants = ["a", "b", "c", "d"]
    names = ["llama", "qwen", "ep-3", "mistral", "phi"]  # one name looks like an endpoint id
    table = RoutingTable()
    for step in range(600):
        i = rng.randrange(40)
        if rng.random() < 0.25:
            table.remove(f"ep-{i}")
        else:  # a new entry, or one replaced (possibly under another name or tenant)
            table.publish(route(i, rng.choice(tenants), rng.choice(names), rng.random() < 0.4))
        for tenant in tenants:
            for model in [*names, f"ep-{rng.randrange(40)}", "absent"]:
                assert table.resolve(tenant, model) is scan(table, tenant, model), (step, model)


def test_own_endpoint_shadows_a_public_one_of_the_same_name() -> None:
    table = RoutingTable()
    public = route(1, "other", "llama", True)
    own = route(2, "me", "llama", False)
    table.publish(public)
    assert table.resolve("me", "llama") is public
    table.publish(own)
    assert table.resolve("me", "llama") is own
    assert table.resolve("me", "ep-1") is None  # shadowed by name, so not visible by id either
    assert table.resolve("third", "llama") is public
    table.remove("ep-2")
    assert table.resolve("me", "llama") is public
