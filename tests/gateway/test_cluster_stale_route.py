"""A request routed on a stale entry (cluster mode): its replica is gone (the connection is
refused), so the gateway waits for the fresh entry and sends it there, with the same request id
and once; without the wait (`serve`, where the table is never stale) it fails as before. Real
HTTP: an aiohttp replica stand-in and a port nobody listens on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from modelyard.config import PlatformSettings
from modelyard.core.errors import Unavailable
from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.call import Call
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.upstream import Upstream
from tests.conftest import free_port


async def _replica(seen: list[str]) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers["x-request-id"])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _send(tmp_path: Path, wait_s: float, seen: list[str]) -> int:
    routing = RoutingTable()
    gone = ReplicaRoute("rep-gone", f"http://127.0.0.1:{free_port()}")  # nobody listens
    route = EndpointRoute("ep-1", "tn-1", "tiny", True, None, 128, replicas=[gone])
    routing.publish(route)
    upstream = Upstream(PlatformSettings(data_dir=tmp_path), routing, GatewayMetrics(), None)
    upstream.stale_route_wait_s = wait_s
    await upstream.start()
    runner, url = await _replica(seen)

    async def fresh_entry() -> None:  # what the mirror does when the new generation arrives
        await asyncio.sleep(0.3)  # the scenario: the new generation arrives late (not a wait)
        routing.set_replicas(route, [ReplicaRoute("rep-new", url)])

    task = asyncio.create_task(fresh_entry())
    call = Call(None, route, "chat.completions", "req-1", 0, None)  # type: ignore[arg-type]
    try:
        status, _ = await upstream.call_unary(call, b"{}")
        return status
    finally:
        await task
        await upstream.stop()
        await runner.cleanup()


def test_gone_replica_retried_on_the_fresh_entry(tmp_path: Path) -> None:
    seen: list[str] = []
    assert asyncio.run(_send(tmp_path, 3.0, seen)) == 200
    assert seen == ["req-1"]  # the same request id, sent once


def test_without_the_wait_a_gone_replica_fails_the_request(tmp_path: Path) -> None:
    seen: list[str] = []
    with pytest.raises(Unavailable):
        asyncio.run(_send(tmp_path, 0.0, seen))
    assert seen == []
