"""Limits, quota, tiers and metering through a real `modelyard serve`, once per platform mode
(SQLite with limits in memory; PostgreSQL with limits in Redis): a dropped stream is billed, the
monthly quota is reserved so a concurrent burst cannot overspend it, the platform admin's tenant
ceilings bind the tenant's own admins, keys, requests in flight and deploys."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from starlette.requests import Request

from modelyard.config import PlatformSettings
from modelyard.core.errors import DomainError
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.auth import Authenticator, generate_key
from modelyard.gateway.metering import UsageEvent, UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Gateway
from modelyard.gateway.quota import MemoryQuotaCounter, month_of
from modelyard.gateway.ratelimit import MemoryRateLimiter
from modelyard.protocol.errors import status_of
from modelyard.registry_client import RegistryClient
from modelyard.store import repository as repo
from modelyard.store.db import Database
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    deploy,
    platform_running,
    tiny_models_env,
    wait_request_ids,
    wait_usage,
)

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> httpx.Client:
    return platform.api()


@pytest.fixture(scope="module")
def tiny(platform: PlatformProcess, admin: httpx.Client, models_dir: Path) -> str:
    """A public endpoint every tenant can use."""
    return deploy(admin, "tiny", str(models_dir / "tiny"), public=True)


class Tenant:
    """A tenant made by the platform admin with `settings` (quota, tier, ceilings), its admin
    key and an inference key."""

    def __init__(self, platform: PlatformProcess, admin: httpx.Client, **settings: Any) -> None:
        r = admin.post("/v1/tenants", json={"name": f"t-{time.time_ns()}", **settings})
        assert r.status_code == 201, r.text
        self.view = r.json()
        self.id = str(self.view["id"])
        self.admin_key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.key = create_key(admin, self.id, scopes=["inference"])
        self.api = platform.api(self.admin_key)
        self.http = platform.api(self.key["key"])


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, **extra}


def open_stream(platform: PlatformProcess, key: str, chunks: int) -> str:
    """Start a long stream, read `chunks` data lines, then drop the connection; its request id."""
    body = chat(400, stream=True, ignore_eos=True)
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks:
                break
    return request_id


def test_a_dropped_stream_is_billed(platform: PlatformProcess, admin: httpx.Client, tiny: str):
    """With Redis the settlement used to be cancelled with the client: no usage row at all."""
    t = Tenant(platform, admin, monthly_token_quota=1_000_000)
    request_id = open_stream(platform, t.key["key"], chunks=6)
    (row,) = [r for r in wait_request_ids(t.api, [request_id]) if r["request_id"] == request_id]
    assert row["status"] == "client_disconnected"
    assert 5 <= int(row["completion_tokens"]) < 400
    assert int(row["prompt_tokens"]) > 0


def test_a_burst_cannot_overspend_the_monthly_quota(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    """Four concurrent requests of a 60-token tenant: the first reservation (prompt + 64) takes
    the whole quota, so the others are refused; before, all four ran (256+ tokens)."""
    t = Tenant(platform, admin, monthly_token_quota=60)
    start = threading.Barrier(4)
    statuses: list[int] = []

    def one() -> None:
        with platform.api(t.key["key"]) as http:
            start.wait()
            r = http.post("/v1/chat/completions", json=chat(64, ignore_eos=True))
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "insufficient_quota"

    threads = [threading.Thread(target=one) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(statuses) == [200, 429, 429, 429]
    rows = wait_usage(t.api, lambda rows: len(rows) >= 1)
    assert len(rows) == 1 and int(rows[0]["completion_tokens"]) == 64
    # Settled to the real use: the quota is spent, and a later request is refused too.
    r = t.http.post("/v1/chat/completions", json=chat(1))
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"


def test_a_request_the_model_refuses_gives_its_quota_reservation_back(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    """Over-long prompts pass admission (reserving ~1000 tokens each, past the whole quota)
    and the worker refuses them; had the reservations been kept, the last request would be
    out of quota."""
    t = Tenant(platform, admin, monthly_token_quota=200)
    too_long = [{"role": "user", "content": "hello " * 700}]
    for _ in range(3):
        r = t.http.post("/v1/chat/completions", json={**chat(8), "messages": too_long})
        assert r.status_code == 400, r.text
    r = t.http.post("/v1/chat/completions", json=chat(2))
    assert r.status_code == 200, r.text
    (row,) = wait_usage(t.api, lambda rows: len(rows) >= 1)
    assert row["status"] == "ok" and row["request_id"] == r.headers["x-request-id"]


def test_requests_in_flight_are_capped_per_tenant(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    """Six simultaneous requests on two keys of a tenant allowed one in flight: the others are
    refused at once; slots come back when requests finish or their client drops them."""
    t = Tenant(platform, admin, max_concurrent_requests=1)
    keys = [t.key["key"], create_key(admin, t.id, scopes=["inference"])["key"]]
    start = threading.Barrier(6)
    answers: list[httpx.Response] = []

    def one(i: int) -> None:
        with platform.api(keys[i % 2]) as http:
            start.wait()
            answers.append(http.post("/v1/chat/completions", json=chat(300, ignore_eos=True)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    refused = [r for r in answers if r.status_code == 429]
    assert 1 <= len(answers) - len(refused) < 6, [r.status_code for r in answers]
    assert len(refused) + sum(r.status_code == 200 for r in answers) == 6
    for r in refused:
        assert r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert "1 concurrent" in r.json()["error"]["message"]
    # A dropped stream gives its slot back too (in the settlement that bills it).
    open_stream(platform, t.key["key"], chunks=2)
    deadline = time.monotonic() + 30
    while True:
        r = t.http.post("/v1/chat/completions", json=chat(2))
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_only_the_platform_admin_sets_tier_quota_and_ceilings(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin, tier="free", max_rpm=10, max_tpm=1000, max_endpoints=2)
    assert t.view["tier"] == "free"
    assert (t.view["max_rpm"], t.view["max_tpm"], t.view["max_endpoints"]) == (10, 1000, 2)
    for change in ({"tier": "priority"}, {"max_rpm": None}, {"monthly_token_quota": None}):
        r = t.api.patch(f"/v1/tenants/{t.id}", json=change)
        assert r.status_code == 403, r.text
    r = admin.patch(f"/v1/tenants/{t.id}", json={"tier": "priority", "max_concurrent_requests": 4})
    assert r.status_code == 200, r.text
    assert r.json()["tier"] == "priority" and r.json()["max_concurrent_requests"] == 4
    assert r.json()["max_rpm"] == 10  # fields left out are kept
    assert admin.patch(f"/v1/tenants/{t.id}", json={"tier": "gold"}).status_code == 400


def test_tenant_admins_only_tighten_key_limits_within_the_ceilings(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin, max_rpm=10, max_tpm=1000)
    # A key made without limits gets the ceilings (the inference key made above, and a new one).
    assert (t.key["rpm_limit"], t.key["tpm_limit"]) == (10, 1000)
    r = t.api.post("/v1/keys", json={"name": "k"})
    assert r.status_code == 201 and (r.json()["rpm_limit"], r.json()["tpm_limit"]) == (10, 1000)
    key_id = r.json()["id"]
    for body in ({"rpm_limit": 11}, {"tpm_limit": 5000}):
        r = t.api.post("/v1/keys", json={"name": "k2", **body})
        assert r.status_code == 403 and r.json()["error"]["code"] == "above_tenant_ceiling"
    for body in ({"rpm_limit": None}, {"tpm_limit": None}, {"rpm_limit": 100}):
        r = t.api.patch(f"/v1/keys/{key_id}", json=body)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "above_tenant_ceiling"
    r = t.api.patch(f"/v1/keys/{key_id}", json={"rpm_limit": 5})
    assert r.status_code == 200 and r.json()["rpm_limit"] == 5
    # Without a ceiling a tenant admin may still lift its keys' limits.
    free = Tenant(platform, admin)
    r = free.api.post("/v1/keys", json={"name": "k", "rpm_limit": 3})
    r = free.api.patch(f"/v1/keys/{r.json()['id']}", json={"rpm_limit": None})
    assert r.status_code == 200 and r.json()["rpm_limit"] is None


def test_a_lowered_ceiling_binds_existing_keys_at_the_gateway(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    """Keys made before a ceiling keep their stored limits; the gateway applies the lower."""
    t = Tenant(platform, admin)
    assert t.key["rpm_limit"] is None
    r = admin.patch(f"/v1/tenants/{t.id}", json={"max_rpm": 2})
    assert r.status_code == 200
    statuses = [t.http.post("/v1/chat/completions", json=chat(1)) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert statuses[0].headers["x-ratelimit-limit-requests"] == "2"
    assert statuses[2].json()["error"]["code"] == "rate_limit_exceeded"


def test_deploys_stay_within_the_endpoint_and_replica_ceilings(
    platform: PlatformProcess, admin: httpx.Client, models_dir: Path
) -> None:
    t = Tenant(platform, admin, max_endpoints=0, max_replicas=2)
    body = {"model_name": "mine", "model_artifact": "mine"}
    r = t.api.post("/v1/models/deploy", json=body)
    assert r.status_code == 403, r.text
    assert "max_endpoints=0" in r.json()["error"]["message"]
    assert admin.patch(f"/v1/tenants/{t.id}", json={"max_endpoints": 1}).status_code == 200
    RegistryClient(platform.url, t.admin_key).push(models_dir / "tiny", "mine")
    r = t.api.post("/v1/models/deploy", json={**body, "hardware": {"max_replicas": 3}})
    assert r.status_code == 403 and "max_replicas=2" in r.json()["error"]["message"]
    endpoint = deploy(t.api, "mine", "mine", wait=False, hardware={"max_replicas": 2})
    try:
        r = t.api.post("/v1/models/deploy", json={**body, "model_name": "second"})
        assert r.status_code == 403 and "max_endpoints=1" in r.json()["error"]["message"]
        assert admin.patch(f"/v1/tenants/{t.id}", json={"max_endpoints": 5}).status_code == 200
        r = t.api.post("/v1/models/deploy", json={**body, "model_name": "second"})
        assert r.status_code == 403 and "max_replicas=2" in r.json()["error"]["message"]
    finally:
        assert t.api.delete(f"/v1/endpoints/{endpoint}").status_code == 202


def test_clients_cannot_pick_their_engine_priority(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    """A negative priority is refused; any other is replaced by the tenant tier's."""
    t = Tenant(platform, admin, tier="free")
    r = t.http.post("/v1/chat/completions", json=chat(2, priority=-100))
    assert r.status_code == 400, r.text
    r = t.http.post("/v1/chat/completions", json=chat(2, priority=0))
    assert r.status_code == 200, r.text


# ----- in process: the auth cache and the settlement of a request --------------------------------


async def test_random_bad_keys_leave_the_auth_cache_bounded(database: Database) -> None:
    """Each unknown key used to stay cached forever; now they share a small bounded cache and
    do not push real keys out."""
    with database.session() as s:
        tenant = repo.create_tenant(s, "acme", None)
        key, key_hash, prefix = generate_key()
        repo.add_key(s, tenant.id, "k", key_hash, prefix, ["inference"], None, None)
    # A TTL no run outlasts (10,000 lookups once outlasted a 60 s one on a loaded, traced
    # 2-vCPU machine): what is checked is the caches' size, not their expiry.
    auth = Authenticator(database, cache_ttl_s=86_400.0, cache_size=100, negative_cache_size=50)
    principal = await auth.authenticate(f"Bearer {key}")
    for _ in range(1_000):
        with pytest.raises(DomainError) as info:
            await auth.authenticate(f"Bearer sk-my-{secrets.token_urlsafe(32)}")
        assert status_of(info.value) == 401
    assert auth.cached <= 100 + 50
    # The real key is still cached: revoked behind the cache's back, it still authenticates.
    with database.session() as s:
        row = repo.key_by_hash(s, key_hash)
        assert row is not None
        row.revoked_at = repo.now()
    assert await auth.authenticate(f"Bearer {key}") == principal


async def test_a_cancelled_settlement_still_records_the_request(database: Database) -> None:
    """The recorder runs a settlement in a task of its own: cancelling whoever awaits it (a
    client that disconnected) neither cancels the quota update nor loses the usage row."""
    quota = MemoryQuotaCounter()
    recorder = UsageRecorder(database)
    recorder.start()
    gate = asyncio.Event()
    event = UsageEvent("req-1", "tn-1", "key-1", None, "tiny", None, "chat.completions",
                       10, 20, 0, 5.0, None, 200, "client_disconnected")  # fmt: skip

    async def settle() -> None:
        await gate.wait()  # a slow Redis round trip
        # What the gateway's settlement does with memory limits: the quota moved from the 50
        # reserved to the real count, then the row written.
        first, moves = recorder.claim(event, reserved=50)
        for month, tokens in moves:
            await quota.add(event.tenant_id, month, tokens)
        if first:
            await recorder.write(event)

    async def client() -> None:
        await asyncio.shield(recorder.settle(settle()))

    waiting = asyncio.create_task(client())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.set()
    await recorder.stop()
    assert await quota.used("tn-1", month_of(event.created_at)) == 30 - 50  # settled: -20
    with database.session() as s:
        (row,) = repo.usage_rows(s, "tn-1", event.created_at - timedelta(1), repo.now())
    assert (row.request_id, row.completion_tokens) == ("req-1", 20)


async def test_the_engine_priority_comes_from_the_tenant_tier(database: Database) -> None:
    """What the gateway sends upstream, seen by an HTTP server in the worker's place: the
    client's `priority` is replaced by its tier's rank (0 priority, 1 standard, 2 free), and a
    batch item's by 3 + rank, after every interactive request."""
    seen: list[int] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append((await request.json())["priority"])
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [],
                                  "usage": usage})  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    keys: dict[str, str] = {}
    with database.session() as s:
        for tier in ("free", "standard", "priority"):
            tenant = repo.create_tenant(s, tier, None, tier=tier)
            key, key_hash, prefix = generate_key()
            repo.add_key(s, tenant.id, "k", key_hash, prefix, ["inference"], None, None)
            keys[tier] = key
    routing = RoutingTable()
    route = EndpointRoute("ep-1", "system", "m", public=True, version_id=None, max_tokens_cap=64)
    route.replicas.append(ReplicaRoute("rep-1", f"http://127.0.0.1:{port}", max_concurrency=8))
    routing.publish(route)
    quota = MemoryQuotaCounter()
    recorder = UsageRecorder(database)
    auth = Authenticator(database)
    gateway = Gateway(
        PlatformSettings(), auth, MemoryRateLimiter(), quota, routing, recorder, GatewayMetrics()
    )
    await gateway.start()
    try:
        for tier in ("free", "standard", "priority"):
            body = json.dumps(chat(1, model="m", priority=0 if tier == "free" else 9)).encode()

            async def receive(body: bytes = body) -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                     "query_string": b"",
                     "headers": [(b"authorization", f"Bearer {keys[tier]}".encode())]}  # fmt: skip
            response = await gateway.handle(Request(scope, receive), "chat.completions")
            assert response.status_code == 200
        principal = await auth.authenticate(f"Bearer {keys['free']}")
        status, _, _ = await gateway.run_internal(
            principal, "chat.completions", chat(1, model="m", priority=0), "b-1:1"
        )
        assert status == 200
    finally:
        await gateway.stop()
        await recorder.stop()
        await runner.cleanup()
    assert seen == [2, 1, 0, 5]
