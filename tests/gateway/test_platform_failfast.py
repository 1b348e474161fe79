"""Failures fail fast, and overload serves the better tier first.

The admission queue's order and shares run on the gateway's real `_replica` against a routing
table the test drives itself (no model: fast). The control plane's side runs on real
`modelyard serve` processes with real workers: a hung worker (SIGSTOP) is benched, reported and
replaced; a SIGKILLed one is replaced and its next request gets a 503 that names no internal
address; a model that cannot load makes its endpoint `failed`, and requests to it (unary and
streamed) get a 503 with Retry-After at once instead of waiting for a replica that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from modelyard.config import PlatformSettings
from modelyard.core.errors import DomainError
from modelyard.core.identity import Limits, Principal, Tier
from modelyard.core.routing import Activate, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Gateway
from modelyard.gateway.quota import MemoryQuotaCounter
from modelyard.gateway.ratelimit import MemoryRateLimiter
from modelyard.protocol.errors import STATUS_BY_KIND
from modelyard.store.db import Database
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    deploy,
    platform_running,
    wait_status,
)
from tests.tiny_models import build_model
from tests.waiting import async_wait_until

MESSAGES = [{"role": "user", "content": "Hello there"}]
ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})

# ----- the admission queue, on the gateway's own code path ---------------------------------------


def _gateway(
    database: Database,
    routing: RoutingTable,
    queue_size: int = 8,
    activate: Activate | None = None,
) -> Gateway:
    settings = PlatformSettings(admission_queue_size=queue_size, admission_timeout_s=10.0)
    # Authentication and metering are real but not on this path: admission only picks a replica.
    return Gateway(
        settings,
        Authenticator(database),
        MemoryRateLimiter(),
        MemoryQuotaCounter(),
        routing,
        UsageRecorder(database),
        GatewayMetrics(),
        activate=activate,
    )


def _route(routing: RoutingTable, slots: int = 1) -> tuple[EndpointRoute, ReplicaRoute]:
    route = EndpointRoute("ep-1", "t-1", "m", public=False, version_id=None, max_tokens_cap=64)
    replica = ReplicaRoute("rep-1", "http://127.0.0.1:9", max_concurrency=slots)
    replica.outstanding = slots  # full: every request from here on queues
    route.replicas.append(replica)
    routing.publish(route)
    return route, replica


def _call(route: EndpointRoute, tier: str | None, batch: bool = False) -> Call:
    principal = Principal(
        key_id="k", key_name="k", tenant_id="t-1", tenant_name="t", scopes=frozenset(),
        limits=Limits(None, None), monthly_token_quota=None, platform_admin=False,
        tier=Tier(tier or "standard"),
    )  # fmt: skip
    return Call(principal, route, "chat.completions", tier or "batch", 0, NO_LIMITS, batch=batch)


async def _admit_all(
    gateway: Gateway, route: EndpointRoute, replica: ReplicaRoute, arrivals: list[Call]
) -> tuple[list[str], dict[str, int]]:
    """Queue `arrivals` in order on a full replica, then free one slot at a time; the order
    they were admitted in, and the HTTP status of those refused."""
    admitted: list[str] = []
    refused: dict[str, int] = {}

    async def request(call: Call) -> None:
        try:
            chosen = await gateway._replica(call, set())
        except DomainError as exc:
            refused[call.request_id] = STATUS_BY_KIND[exc.kind]
            return
        assert chosen is replica
        replica.outstanding += 1  # what `_send` does with the slot it got
        admitted.append(call.request_id)

    tasks = []
    for call in arrivals:
        tasks.append(asyncio.create_task(request(call)))
        # Arrival order is the order of the list: each one queues before the next is sent.
        await async_wait_until(
            lambda: route.waiting + len(refused) == len(tasks), "the request to queue"
        )
    while len(admitted) + len(refused) < len(arrivals):
        count = len(admitted)
        route.release(replica)
        for _ in range(100):
            if len(admitted) > count or len(admitted) + len(refused) == len(arrivals):
                break
            await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return admitted, refused


async def test_waiters_are_admitted_best_tier_first_then_in_arrival_order(
    database: Database,
) -> None:
    routing = RoutingTable()
    route, replica = _route(routing)
    gateway = _gateway(database, routing)
    names = ["free", "standard", "priority", "free", "standard", "priority"]
    arrivals = [_call(route, t) for t in names]
    for i, call in enumerate(arrivals):
        call.request_id = f"{call.request_id}-{i}"
    admitted, refused = await _admit_all(gateway, route, replica, arrivals)
    assert not refused
    assert admitted == [
        "priority-2", "priority-5", "standard-1", "standard-4", "free-0", "free-3",
    ]  # fmt: skip


async def test_batch_items_wait_behind_every_tier(database: Database) -> None:
    """A batch item waits apart from the admission queue (it takes no interactive request's
    place there, and is no queued demand), and a freed slot goes to the queued request first."""
    routing = RoutingTable()
    route, replica = _route(routing)
    gateway = _gateway(database, routing)
    looks = [0]
    wait_change = route.wait_change

    async def counted(at_most_s: float) -> None:
        looks[0] += 1
        await wait_change(at_most_s)

    route.wait_change = counted  # type: ignore[method-assign]

    async def take(call: Call) -> ReplicaRoute | None:
        chosen = await gateway._replica(call, set())
        replica.outstanding += 1  # what `_send` does with the slot it got
        return chosen

    batch = asyncio.create_task(take(_call(route, None, batch=True)))
    await async_wait_until(lambda: looks[0] >= 1, "the batch item to wait")
    assert route.waiting == 0
    free = asyncio.create_task(take(_call(route, "free")))
    await async_wait_until(lambda: route.waiting == 1, "the free request to queue")
    route.release(replica)  # one slot: the queued request's, though the batch item came first
    assert await free is replica
    seen = looks[0]
    await async_wait_until(lambda: looks[0] >= seen + 2, "the batch item to look again")
    assert not batch.done()
    route.release(replica)
    assert await batch is replica


async def test_a_new_request_does_not_overtake_a_waiter_of_its_tier(database: Database) -> None:
    routing = RoutingTable()
    route, replica = _route(routing)
    gateway = _gateway(database, routing)

    async def take(tier: str) -> ReplicaRoute | None:
        """A request that takes its replica's slot the moment it has one (as the relay does,
        with no await between), so the slot is never free for a waiter it woke on leaving."""
        chosen = await gateway._replica(_call(route, tier), set())
        if chosen is not None:
            chosen.outstanding += 1
        return chosen

    waiting = asyncio.create_task(take("standard"))
    await async_wait_until(lambda: route.waiting == 1, "the first request to queue")
    # A slot frees, and before the waiter runs a newcomer of the same tier asks: it queues
    # behind it; a priority newcomer may take the slot at once.
    replica.outstanding -= 1
    late = asyncio.create_task(take("standard"))
    await async_wait_until(lambda: route.waiting == 2, "the newcomer to queue")
    assert not late.done()
    route.notify()
    assert await waiting is replica
    assert route.waiting == 1
    replica.outstanding -= 1  # a slot frees; the priority newcomer outranks the waiter
    assert await take("priority") is replica
    # An absence is watched for a while: woken by the slot's release, the newcomer looks and
    # waits on (no state tells that it has looked).
    await asyncio.sleep(0.05)
    assert not late.done() and route.waiting == 1
    late.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await late
    assert route.waiting == 0


async def test_under_overload_the_lower_tier_is_refused_first(database: Database) -> None:
    """Queue of 4: free may fill half of it, standard 80 % (3), priority all of it; past its
    share a request takes the place of the newest waiter of a worse tier."""
    routing = RoutingTable()
    route, _ = _route(routing)
    gateway = _gateway(database, routing, queue_size=4)

    asked: list[asyncio.Task[ReplicaRoute | None]] = []

    def decided() -> tuple[int, int]:
        return route.waiting, sum(t.done() for t in asked)

    async def ask(tier: str) -> asyncio.Task[ReplicaRoute | None]:
        """A request of `tier`, once the gateway has decided on it: it queued (the queue
        grew), or it was refused or displaced a waiter (a request ended)."""
        before = decided()
        task = asyncio.create_task(gateway._replica(_call(route, tier), set()))
        asked.append(task)
        await async_wait_until(lambda: decided() != before, f"a decision on a {tier} request")
        return task

    free = [await ask("free") for _ in range(3)]
    assert route.waiting == 2
    with pytest.raises(DomainError) as refused:
        await free[2]
    assert STATUS_BY_KIND[refused.value.kind] == 429 and "higher tiers" in refused.value.message
    assert refused.value.headers.get("retry-after")

    standard = [await ask("standard") for _ in range(2)]
    # The second standard request found the queue at its share (3) and displaced a free one.
    with pytest.raises(DomainError) as displaced:
        await free[1]
    assert STATUS_BY_KIND[displaced.value.kind] == 429 and "higher tier" in displaced.value.message
    assert route.waiting == 3

    priority = [await ask("priority") for _ in range(2)]
    # The first priority request filled the queue (4); the second displaced the last free one.
    with pytest.raises(DomainError):
        await free[0]
    assert route.waiting == 4
    assert not any(t.done() for t in standard + priority)
    # Full of better tiers: a standard request is refused; a priority one displaces a standard.
    with pytest.raises(DomainError) as full:
        await (await ask("standard"))
    assert STATUS_BY_KIND[full.value.kind] == 429
    third = await ask("priority")
    with pytest.raises(DomainError):
        await standard[1]
    for task in [*standard[:1], *priority, third]:
        task.cancel()
    await asyncio.gather(*standard[:1], *priority, third, return_exceptions=True)
    assert route.waiting == 0


async def test_an_unavailable_endpoint_fails_at_once_and_wakes_its_waiters(
    database: Database,
) -> None:
    routing = RoutingTable()
    route, replica = _route(routing)
    # The control plane has a replica starting.
    activated: list[str] = []
    gateway = _gateway(database, routing, activate=activated.append)
    routing.mark_unready(replica, route)
    # No replica serves, and nothing said waiting is pointless: a request waits (loading)...
    waiting = asyncio.create_task(gateway._replica(_call(route, "standard"), set()))
    await async_wait_until(lambda: activated, "the request to ask for a replica and wait")
    assert not waiting.done()
    # ...until the control plane says none will come up by waiting; then it is a 503 at once.
    routing.set_unavailable(route, "its model failed to start", 30)
    with pytest.raises(DomainError) as exc:
        await asyncio.wait_for(waiting, 2.0)
    assert STATUS_BY_KIND[exc.value.kind] == 503 and exc.value.headers["retry-after"] == "30"
    assert "failed to start" in exc.value.message
    with pytest.raises(DomainError):
        await asyncio.wait_for(gateway._replica(_call(route, "priority"), set()), 1.0)


# ----- the control plane, on real processes ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture(scope="module", params=["missing-weights", "garbage-weights"])
def broken_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose config is fine and whose weights cannot load: a valid file that lacks
    most tensors (the worker fails to load it and exits), or bytes that are no safetensors
    file at all (the control plane fails sizing it)."""
    from safetensors.torch import load_file, save_file

    folder = build_model(tmp_path_factory.mktemp("m") / "broken", "llama")
    for weights in folder.glob("*.safetensors"):
        if request.param == "garbage-weights":
            weights.write_bytes(b"not a safetensors file")
        else:
            tensors = load_file(weights)
            first = sorted(tensors)[0]
            save_file({first: tensors[first]}, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_WORKER_ENGINE": ENGINE,
        # Long enough that a request sent right after a SIGKILL reaches the gateway before the
        # control plane notices (the gateway's own path), short enough for quick repairs.
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "1.0",
        "MODELYARD_HEALTH_PROBE_TIMEOUT_S": "1.0",
        "MODELYARD_REPLICA_HEALTH_FAILURES": "2",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


def _chat(platform: PlatformProcess, model: str, stream: bool = False) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "stream": stream}
    with platform.api() as api:
        return api.post("/v1/chat/completions", json=body, timeout=30.0)


def _wait_for(check: object, what: str, timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()  # type: ignore[operator]
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_model_that_cannot_load_fails_fast(platform: PlatformProcess, broken_dir: Path) -> None:
    api = platform.api()
    endpoint = deploy(api, f"broken-{broken_dir.parent.name}", str(broken_dir), wait=False)
    model = f"broken-{broken_dir.parent.name}"
    body = wait_status(api, endpoint, "failed")
    assert "failed to start" in (body["status_message"] or ""), body
    for stream in (False, True):
        started = time.monotonic()
        r = _chat(platform, model, stream=stream)
        took = time.monotonic() - started
        assert r.status_code == 503, (stream, r.status_code, r.text[:300])
        assert r.headers.get("retry-after"), r.headers
        assert r.json()["error"]["code"] == "model_unavailable"
        assert "loading" not in r.text and "127.0.0.1" not in r.text
        assert took < 10, f"took {took:.1f}s"  # a failed endpoint answers; it does not wait
    api.delete(f"/v1/endpoints/{endpoint}")


def test_a_hung_replica_is_benched_reported_and_replaced(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    endpoint = deploy(api, "hung", str(tiny_dir))
    assert _chat(platform, "hung").status_code == 200
    [replica] = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    victim = replica["pid"]
    assert victim in platform.worker_pids()
    os.kill(victim, signal.SIGSTOP)  # alive, but answers nothing: a wedged engine
    try:
        degraded = wait_status(api, endpoint, "degraded", timeout=30)
        assert "health check" in (degraded["status_message"] or ""), degraded
        # The replacement serves and the stopped one is gone (killed, not left stopped).
        body = _wait_for(
            lambda: (
                (b := api.get(f"/v1/endpoints/{endpoint}").json())["status"] == "ready"
                and victim not in [r["pid"] for r in b["replicas"]["items"]]
                and b
            ),
            "a replacement replica",
        )
        assert body["replicas"]["restarts"] >= 1  # type: ignore[index]
        _wait_for(lambda: victim not in platform.worker_pids(), "the hung worker to be killed", 10)
        assert _chat(platform, "hung").status_code == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
            os.kill(victim, signal.SIGKILL)
    api.delete(f"/v1/endpoints/{endpoint}")


def test_a_killed_single_replica_is_a_clean_503_then_replaced(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    endpoint = deploy(api, "killed", str(tiny_dir))
    [replica] = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    victim = replica["pid"]
    os.kill(victim, signal.SIGKILL)
    # Sent at once: the gateway finds nobody listening (the control plane notices later). It
    # is answered at once, not after a replacement loads, and names no internal address.
    started = time.monotonic()
    r = _chat(platform, "killed")
    assert r.status_code == 503, r.text
    assert time.monotonic() - started < 10
    assert r.headers.get("retry-after")
    # (aiohttp's error names it as `host='127.0.0.1', port=…`, the URL as `127.0.0.1:…`)
    assert "127.0.0.1" not in r.text and "port=" not in r.text, r.text

    def noticed() -> dict | None:
        b = api.get(f"/v1/endpoints/{endpoint}").json()
        replaced = victim not in [r["pid"] for r in b["replicas"]["items"]]
        return b if b["status"] != "ready" or replaced else None

    degraded = _wait_for(noticed, "the endpoint to report or replace its dead replica", 30)
    if degraded["status"] == "degraded":  # type: ignore[index]
        assert "exited" in degraded["status_message"], degraded  # type: ignore[index]
        r = _chat(platform, "killed")
        if r.status_code != 200:  # unless the replacement already serves
            assert r.status_code == 503 and r.headers.get("retry-after"), r.text
            assert "127.0.0.1" not in r.text, r.text
    wait_status(api, endpoint, "ready", timeout=90)
    assert _chat(platform, "killed").status_code == 200
    api.delete(f"/v1/endpoints/{endpoint}")


# ----- tiers end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_slot_platform(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    """Both store modes: a tenant's tier comes from its stored row and admission is a limit."""
    env = {
        **platform_env,
        "MODELYARD_WORKER_ENGINE": ENGINE,
        # /metrics (the queue the test watches) skips the stopped replica's series quickly.
        "MODELYARD_METRICS_SCRAPE_TIMEOUT_S": "0.2",
        # No health tick while the test runs: its stopped worker holds the one slot, unprobed.
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "3600",
        "MODELYARD_ADMISSION_TOKENS_PER_REQUEST": "1000000000",  # one request per replica
        "MODELYARD_ADMISSION_QUEUE_SIZE": "4",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


def _gauge(text: str, name: str, endpoint: str) -> float:
    """The value of gauge `name` for `endpoint` in a /metrics exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'endpoint="{endpoint}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {endpoint} on /metrics")


def test_tenants_tiers_order_the_queue_and_the_free_tier_is_refused_first(
    one_slot_platform: PlatformProcess, tiny_dir: Path
) -> None:
    platform = one_slot_platform
    api = platform.api()
    endpoint = deploy(api, "tiers", str(tiny_dir), public=True)
    keys = {}
    for tier in ("free", "standard", "priority"):
        r = api.post("/v1/tenants", json={"name": f"tenant-{tier}", "tier": tier})
        assert r.status_code == 201, r.text
        keys[tier] = create_key(api, r.json()["id"])["key"]
    [replica] = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    done: dict[str, tuple[int, str, str]] = {}

    def ask(name: str, tier: str) -> None:
        body = {"model": "tiers", "messages": MESSAGES, "max_tokens": 2}
        with platform.api(keys[tier]) as client:
            r = client.post("/v1/chat/completions", json=body, timeout=60.0)
        done[name] = (r.status_code, r.headers.get("x-request-id", ""), r.text)

    def arrived(in_flight: int, queued: int, refused: tuple[str, ...] = ()) -> bool:
        """The gateway holds `in_flight` sent and `queued` waiting for the endpoint, and has
        answered `refused`: the last request has arrived (its place is taken)."""
        text = api.get("/metrics").text
        return (
            _gauge(text, "modelyard_gateway_requests_in_flight", endpoint) == in_flight
            and _gauge(text, "modelyard_gateway_queue_depth", endpoint) == queued
            and all(n in done for n in refused)
        )

    # Each request is sent once the one before it has arrived (arrival order at the gateway).
    arrivals = [
        ("hold", "standard", (1, 0, ())),  # takes the one slot, and hangs there
        ("free-1", "free", (1, 1, ())),
        ("free-2", "free", (1, 2, ())),  # the queue (4) is now half full: free's share
        ("free-3", "free", (1, 2, ("free-3",))),  # refused: the rest is kept for higher tiers
        ("priority", "priority", (1, 3, ())),
        ("standard", "standard", (1, 3, ("free-2",))),  # past its share (3): ousts free-2
    ]
    os.kill(replica["pid"], signal.SIGSTOP)
    threads = []
    try:
        for name, tier, state in arrivals:
            thread = threading.Thread(target=ask, args=(name, tier))
            thread.start()
            threads.append(thread)
            _wait_for(lambda s=state: arrived(*s), f"{name} to arrive at the gateway", 30)
    finally:
        os.kill(replica["pid"], signal.SIGCONT)
    for thread in threads:
        thread.join(60)
    for name in ("free-3", "free-2"):
        status, _, text = done[name]
        assert status == 429, (name, status, text)
        assert "higher tier" in text, text
    # The order the gateway served them in, from its own usage records (one slot: each is
    # metered before the next one is admitted), not the order the client threads happened to
    # wake up in: the answers come back milliseconds apart, closer than a loaded machine
    # schedules threads.
    metered_at = {
        row["request_id"]: datetime.fromisoformat(row["created_at"])
        for row in csv.DictReader(io.StringIO(api.get("/v1/usage/export").text))
    }
    served = sorted((metered_at[done[n][1]], n) for n in ("hold", "free-1", "priority", "standard"))
    assert all(done[n][0] == 200 for _, n in served), done
    assert [n for _, n in served] == ["hold", "priority", "standard", "free-1"]
