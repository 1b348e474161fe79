"""The shared core's contracts: domain errors reach HTTP through one mapping, principals are
built one way per kind, and the routing table changes only through its verbs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from modelyard.api.errors import install_error_handlers, status_of, to_api_error
from modelyard.core.errors import Conflict, Forbidden, NotFound, TooLarge, Unavailable
from modelyard.core.identity import Limits, Principal, TenantLimits, Tier
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.protocol.oip import install_oip_error_handlers


@dataclass
class _Tenant:
    id: str = "t-1"
    name: str = "acme"
    tier: str | None = "priority"
    max_rpm: int | None = 100
    max_tpm: int | None = None
    monthly_token_quota: int | None = 1000
    max_concurrent_requests: int | None = 4
    max_concurrent_batch_items: int | None = 2
    is_system: bool = False


@dataclass
class _Key:
    id: str = "k-1"
    name: str = "ci"
    scopes: str = "inference,admin"
    rpm_limit: int | None = 500
    tpm_limit: int | None = 50
    allowed_models: list[str] | None = None
    owner_user_id: str | None = None
    owner_team_id: str | None = None


def test_principal_constructors() -> None:
    key = Principal.for_key(_Key(), _Tenant())
    # A key may be tighter than its tenant's ceiling, never looser.
    # ... and the tenant's ceilings are buckets all its keys share.
    assert key.limits == Limits(rpm=100, tpm=50, tenant=TenantLimits("t-1", 100, None))
    assert key.tier is Tier.PRIORITY and not key.platform_admin
    assert Principal.for_key(_Key(), _Tenant(is_system=True)).platform_admin
    system = Principal.system(_Tenant(is_system=True))
    assert system.platform_admin and system.limits == Limits(None, None)
    assert system.scopes == {"admin", "inference"}
    batch = Principal.for_batch("k-gone", None, _Tenant())
    assert batch.key_id == "k-gone" and batch.key_name == "" and batch.scopes == {"inference"}
    assert batch.limits == Limits(None, None) and batch.monthly_token_quota == 1000
    with pytest.raises(Forbidden):
        batch.require("admin")
    with pytest.raises(NotFound):
        batch.tenant_filter("t-2")
    # A key's model allow-list: `*` is the only wildcard, and a batch runs under it too.
    scoped = _Key(allowed_models=["smollm2", "support-*", "*-v?"])
    for principal in (
        Principal.for_key(scoped, _Tenant()),
        Principal.for_batch("k-1", scoped, _Tenant()),
    ):
        assert principal.allows_model("smollm2") and principal.allows_model("support-")
        assert principal.allows_model("support-bot-2") and principal.allows_model("x-v?")
        assert not principal.allows_model("smollm2x") and not principal.allows_model("x-v1")
        with pytest.raises(Forbidden) as refused:
            principal.require_model("other")
        assert refused.value.code == "model_not_allowed"
    assert key.allows_model("anything") and batch.allows_model("anything")


def test_domain_errors_map_to_statuses_once() -> None:
    assert status_of(Conflict("x")) == 409 and status_of(TooLarge("x")) == 413
    error = to_api_error(Unavailable("busy", code="no_capacity", retry_after_s=7))
    assert error.status == 503 and error.headers == {"retry-after": "7"}
    assert error.body() == {
        "error": {
            "message": "busy",
            "type": "service_unavailable",
            "param": None,
            "code": "no_capacity",
        }
    }


async def test_a_domain_error_is_answered_in_the_routes_shape() -> None:
    app = FastAPI()
    install_error_handlers(app)
    install_oip_error_handlers(app)

    @app.get("/v1/thing")
    async def thing() -> None:
        raise NotFound("no such thing", param="id", code="not_found")

    @app.get("/v2/models/m")
    async def model() -> None:
        raise Forbidden("not yours")

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.get("/v1/thing")
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "no such thing",
            "type": "not_found_error",
            "param": "id",
            "code": "not_found",
        }
        r = await client.get("/v2/models/m")
        assert r.status_code == 403 and r.json() == {"error": "not yours"}


async def test_routing_table_verbs() -> None:
    table = RoutingTable()
    route = EndpointRoute("ep-1", "t-1", "m", public=False, version_id=None, max_tokens_cap=8)
    replica = ReplicaRoute("r-1", "http://a")
    table.publish(route)
    assert table.resolve("t-1", "m") is route and table.resolve("t-2", "m") is None
    generation = table.generation
    waiting = asyncio.create_task(route.wait_change(5.0))
    await asyncio.sleep(0)
    table.add_replica(route, replica)
    await asyncio.wait_for(waiting, 1.0)  # a waiting request is woken by the change
    assert table.generation > generation and table.pick(route) is replica
    assert table.mark_unready(replica, route) and not table.mark_unready(replica, route)
    assert table.pick(route) is None
    assert table.readmit(replica, route, url="http://b") and replica.url == "http://b"
    table.bench(replica)  # the gateway could not reach it
    assert table.pick(route) is None
    table.set_unavailable(route, "its model failed to start", 30)
    assert (route.unavailable, route.retry_after_s) == ("its model failed to start", 30)
    table.drop_replica(route, replica)
    assert route.replicas == []
    assert table.remove("ep-1") is route and table.resolve("t-1", "m") is None
