"""Backfill through the gateway's own replica choice, in both platform modes (SQLite with limits
in memory; PostgreSQL with limits in Redis): the real batch runner, gateway, database and
limits, with an HTTP server in the replicas' place that answers and notes which replica each
request reached.

A batch item goes to the replica that may take it (`core/backfill.py`) even where the least
loaded one is another: an idle replica whose health report leaves only the reserved slot. With
none that may, the item waits outside the admission queue (no queued demand) until a report
gives one room, and goes there; an interactive request meanwhile goes where it always went.
(The pick itself, with cache and adapter affinity: `tests/core/test_backfill.py`.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from modelyard.batch.files import FileService
from modelyard.batch.runner import BatchRunner
from modelyard.batch.service import BatchService
from modelyard.batch.webhook_policy import WebhookPolicy
from modelyard.config import PlatformSettings
from modelyard.core.identity import Limits, Principal
from modelyard.core.routing import CapacityReport, EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.call import NO_LIMITS, Call
from modelyard.gateway.metering import UsageRecorder
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.proxy import Gateway
from modelyard.gateway.quota import MemoryQuotaCounter, RedisQuotaCounter
from modelyard.gateway.ratelimit import MemoryRateLimiter, RedisRateLimiter
from modelyard.gateway.redis_connect import open_redis
from modelyard.store import repository as repo
from modelyard.store.artifacts import ArtifactStore
from modelyard.store.db import Database, sqlite_url
from tests.databases import PLATFORM_MODES, fresh_postgres, fresh_redis
from tests.platform_harness import batch_line, jsonl
from tests.waiting import async_wait_until

SETTINGS = {"backfill_reserved_slots": 1, "admission_tokens_per_request": 100}
ROOM = CapacityReport(free_slots=6, kv_free_tokens=10_000, outstanding=2)
RESERVED_ONLY = CapacityReport(free_slots=1, kv_free_tokens=10_000, outstanding=0)
NO_KV = CapacityReport(free_slots=6, kv_free_tokens=99, outstanding=2)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module", params=PLATFORM_MODES)
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[str | None, str | None]]:
    """(PostgreSQL URL, Redis URL), or (None, None) for SQLite with limits in memory."""
    if request.param == "sqlite-memory":
        yield None, None
        return
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        yield database_url, redis_url


@dataclass
class Platform:
    """The gateway and the batch runner as `modelyard serve` wires them, over two replicas."""

    db: Database
    routing: RoutingTable
    route: EndpointRoute
    idle: ReplicaRoute  # nothing in flight from here: the least loaded
    busy: ReplicaRoute  # two interactive requests in flight
    gateway: Gateway
    runner: BatchRunner
    batches: BatchService
    files: FileService
    principal: Principal
    served: list[str]  # the replica each request reached, in order
    waits: list[int]  # how often a request waited on the endpoint's change signal

    def batch(self, tmp: Path, n: int) -> str:
        source = tmp / f"in-{time.time_ns()}.jsonl"
        source.write_bytes(jsonl([batch_line(f"i-{i}", **BODY) for i in range(n)]))
        f = self.files.create_from_path(self.principal.tenant_id, source, "in.jsonl", "batch")
        created = self.batches.create(self.principal, f["id"], "/v1/chat/completions", "24h", None)
        return str(created["id"])

    def status(self, batch_id: str) -> dict[str, Any]:
        return self.batches.get(self.principal.tenant_id, batch_id)


async def _replicas(served: list[str]) -> tuple[web.AppRunner, int]:
    """One server in every replica's place: `/<replica>/v1/chat/completions` answers."""

    async def completions(request: web.Request) -> web.Response:
        served.append(request.match_info["replica"])
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "model": "tiny", "choices": [], "usage": usage}
        )

    app = web.Application()
    app.router.add_post("/{replica}/v1/chat/completions", completions)
    server = web.AppRunner(app)
    await server.setup()
    site = web.TCPSite(server, "127.0.0.1", 0)
    await site.start()
    return server, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.fixture()
async def platform(
    stores: tuple[str | None, str | None], tmp_path: Path
) -> AsyncIterator[Platform]:
    database_url, redis_url = stores
    db = Database(database_url or sqlite_url(tmp_path / "db.sqlite"))
    db.migrate()
    redis = open_redis(redis_url, 2.0) if redis_url else None
    settings = PlatformSettings(
        data_dir=tmp_path, batch_poll_interval_s=0.05, redis_url=redis_url, **SETTINGS
    )
    served: list[str] = []
    server, port = await _replicas(served)
    routing = RoutingTable()
    with db.session() as s:
        t = repo.create_tenant(s, f"t-{time.time_ns()}", None)
        k = repo.add_key(s, t.id, "k", f"hash-{t.id}", "sk-", ["inference"], None, None)
        principal = Principal(k.id, "k", t.id, t.name, frozenset({"inference"}),
                              Limits(None, None), None, False)  # fmt: skip
    idle = ReplicaRoute("idle", f"http://127.0.0.1:{port}/idle", max_concurrency=8)
    busy = ReplicaRoute("busy", f"http://127.0.0.1:{port}/busy", max_concurrency=8, outstanding=2)
    route = EndpointRoute("ep-1", t.id, "tiny", public=False, version_id=None, max_tokens_cap=64)
    route.replicas = [idle, busy]
    routing.publish(route)
    routing.set_report(route, idle, RESERVED_ONLY)
    recorder = UsageRecorder(db)
    gateway = Gateway(
        settings,
        Authenticator(db),
        RedisRateLimiter(redis) if redis else MemoryRateLimiter(),
        RedisQuotaCounter(redis) if redis else MemoryQuotaCounter(),
        routing,
        recorder,
        GatewayMetrics(),
    )
    files = FileService(db, ArtifactStore(tmp_path / "artifacts"), 1 << 30)
    runner = BatchRunner(settings, db, files, sender=gateway, routing=routing)
    waits = [0]
    wait_change = route.wait_change

    async def counted(at_most_s: float) -> None:
        waits[0] += 1
        await wait_change(at_most_s)

    route.wait_change = counted  # type: ignore[method-assign]
    await gateway.start()
    batches = BatchService(db, files, WebhookPolicy([]))
    try:
        yield Platform(db, routing, route, idle, busy, gateway, runner, batches, files,
                       principal, served, waits)  # fmt: skip
    finally:
        await runner.stop()
        await gateway.stop()
        await recorder.stop()
        await server.cleanup()
        if redis is not None:
            await redis.aclose()
        db.dispose()


async def test_batch_items_go_to_the_replica_with_room_not_the_least_loaded(
    platform: Platform, tmp_path: Path
) -> None:
    p = platform
    p.routing.set_report(p.route, p.busy, ROOM)
    batch = p.batch(tmp_path, 6)
    p.runner.start()
    await async_wait_until(lambda: p.status(batch)["status"] == "completed", "the batch to end")
    counts = p.status(batch)["request_counts"]
    assert (counts["completed"], counts["failed"]) == (6, 0)
    # The idle replica is the least loaded, but leaves its one free slot to interactive bursts.
    assert p.served == ["busy"] * 6
    assert (p.busy.outstanding, p.busy.batch_outstanding, p.idle.outstanding) == (2, 0, 0)


async def test_a_batch_item_waits_for_room_outside_the_queue(platform: Platform) -> None:
    p = platform
    p.routing.set_report(p.route, p.busy, NO_KV)  # neither replica may take a batch item
    item = asyncio.create_task(
        p.gateway.run_internal(p.principal, "chat.completions", dict(BODY), "b-1:1")
    )
    await async_wait_until(lambda: p.waits[0] >= 3 or item.done(), "the item to wait")
    assert not item.done() and p.served == []
    assert p.route.waiting == 0  # not queued demand: the autoscaler does not see it
    # An interactive request meanwhile: the least-loaded replica, as before.
    interactive = Call(p.principal, p.route, "chat.completions", "i-1", 0, NO_LIMITS)
    assert await p.gateway._replica(interactive, set()) is p.idle
    # The busy replica reports room: the item goes there (not to the idle one).
    p.routing.set_report(p.route, p.busy, ROOM)
    status, _, usage = await item
    assert status == 200 and usage is not None
    assert p.served == ["busy"]
    await p.gateway.settle_item(usage, recorded=False)


async def test_a_batch_held_back_for_room_is_cancelled_at_once(
    platform: Platform, tmp_path: Path
) -> None:
    """Interactive traffic can keep every replica without backfill room for hours: a batch
    whose items are held back for room still ends when it is cancelled, with nothing sent."""
    p = platform
    p.routing.set_report(p.route, p.busy, NO_KV)  # neither replica may take a batch item
    batch = p.batch(tmp_path, 4)
    p.runner.start()
    await async_wait_until(lambda: p.runner.budget.held_back >= 3, "the items to be held back")
    assert p.status(batch)["status"] == "in_progress"
    p.batches.cancel(p.principal.tenant_id, batch)
    await async_wait_until(lambda: p.status(batch)["status"] == "cancelled", "the cancel")
    assert p.served == []
    assert p.status(batch)["request_counts"]["completed"] == 0
