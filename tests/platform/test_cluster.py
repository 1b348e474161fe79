"""Cluster mode with real processes: two `modelyard controller`s (one leads, one stands by) and
two `modelyard gateway`s on one PostgreSQL database and one Redis database, local worker
replicas of a tiny random model.

In order (the tests share the cluster): a deploy made through gateway 1 serves through gateway
2 within 2 s of being ready; a key's RPM limit holds across both gateways (±1); usage rows equal
the requests answered; the leader SIGKILLed under traffic: a control read in the takeover
answers (no 503), the standby leads within 15 s, no request fails, the replica is adopted (same
process), a deploy after the takeover serves; a gateway SIGKILLed under traffic: a client
retrying on the other loses nothing acknowledged; a batch survives a controller failover with
every custom_id exactly once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster_harness import Cluster, Traffic, chat, kill_workers
from tests.databases import fresh_postgres, fresh_redis
from tests.platform_harness import (
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    wait_request_ids,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        c = Cluster(tmp_path_factory.mktemp("cluster"), models_dir, database_url, redis_url)
        try:
            c.controllers[0].start()
            c.leader()  # the first one leads (and bootstraps the admin key) before the standby
            others = [c.controllers[1], *c.gateways]
            for p in others:
                p.launch()
            for p in others:
                p.wait_up()
            yield c
        finally:
            for p in c.gateways + c.controllers:
                p.kill(signal.SIGTERM)
            kill_workers(str(models_dir))


def test_deploy_through_one_gateway_serves_through_the_other(cluster: Cluster) -> None:
    with cluster.api(0) as g1, cluster.api(1) as g2:
        endpoint_id = deploy(g1, "tiny", str(cluster.models_dir / "tiny"), public=True)
        ready_at = time.monotonic()
        while (r := chat(g2)).status_code != 200:
            assert time.monotonic() - ready_at < 2.0, (
                f"{r.status_code} {r.text}\n{cluster.output()}"
            )
            time.sleep(0.05)
        # Both gateways show the endpoint as the leader has it.
        assert g2.get(f"/v1/endpoints/{endpoint_id}").json()["status"] == "ready"


def test_rpm_limit_holds_across_gateways_and_usage_matches(cluster: Cluster) -> None:
    with cluster.api(0) as admin:
        tenant = create_tenant(admin, "acme")
        key = create_key(admin, tenant, rpm_limit=6)["key"]
    answered: list[str] = []
    codes: list[int] = []
    with cluster.api(0, key) as g1, cluster.api(1, key) as g2:
        for i in range(14):
            r = chat(g1 if i % 2 else g2)
            codes.append(r.status_code)
            if r.status_code == 200:
                answered.append(r.headers["x-request-id"])
    assert set(codes) <= {200, 429}, codes
    assert 6 <= len(answered) <= 7, codes
    with cluster.api(0) as admin:
        rows = wait_request_ids(admin, answered)
        mine = [r for r in rows if r["tenant_id"] == tenant]
    assert sorted(r["request_id"] for r in mine) == sorted(answered)


def _replica_pids(api: httpx.Client, name: str) -> set[int]:
    r = api.get("/v1/endpoints")
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    body = next(e for e in r.json()["data"] if e["model_name"] == name)
    return {r["pid"] for r in body["replicas"]["items"] if r["state"] == "ready"}


def test_leader_killed_under_traffic(cluster: Cluster) -> None:
    old = cluster.leader()
    standby = cluster.standby()
    try:
        with cluster.api(0) as g1, cluster.api(1) as g2:
            pids = _replica_pids(g1, "tiny")
            assert _replica_pids(g2, "tiny") == pids  # gateway 2 now holds the old leader's URL
            with Traffic(lambda: [cluster.api(0), cluster.api(1)]) as traffic:
                traffic.wait_ok(5)
                old.kill()
                killed_at = time.monotonic()
                # A control request in the takeover waits for the next leader, never a 503.
                r = g2.get("/v1/endpoints")
                assert r.status_code == 200, r.text
                assert cluster.leader() is standby
                took = time.monotonic() - killed_at
                traffic.wait_ok(10)
            print(f"standby led {took:.1f}s after the SIGKILL; {len(traffic.ok)} requests answered")
            assert took < 15.0, took
            assert traffic.failed == [], traffic.failed[:5]
            assert _replica_pids(g2, "tiny") == pids  # adopted, not restarted
            deploy(g2, "tiny2", str(cluster.models_dir / "tiny"))
            deadline = time.monotonic() + 2.0
            while (r := chat(g1, "tiny2")).status_code != 200:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.05)
    finally:
        old.start()  # back as the standby


def test_gateway_killed_under_traffic_loses_nothing_acknowledged(cluster: Cluster) -> None:
    gateway = cluster.gateways[0]
    with Traffic(lambda: [cluster.api(0), cluster.api(1)]) as traffic:
        traffic.wait_ok(5)
        gateway.kill()
        traffic.wait_ok(5)
    assert traffic.failed == [], traffic.failed[:5]
    gateway.start()  # a restarted gateway bills what its killed run journaled
    with cluster.api(1) as g2:
        wait_request_ids(g2, traffic.ok)


def test_batch_survives_controller_failover(cluster: Cluster) -> None:
    n = 30
    lines = [batch_line(f"item-{i}", max_tokens=2) for i in range(n)]
    with cluster.api(1) as g2:
        r = g2.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"}
        )
        assert r.status_code == 200, r.text
        body = {
            "input_file_id": r.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch = g2.post("/v1/batches", json=body).json()
        batch_id = batch["id"]
        deadline = time.monotonic() + 120
        while _batch(g2, batch_id)["request_counts"]["completed"] < 5:
            assert time.monotonic() < deadline, _batch(g2, batch_id)
            time.sleep(0.1)
        old = cluster.leader()
        old.kill()
        try:
            while (b := _batch_or_none(g2, batch_id)) is None or b["status"] != "completed":
                assert time.monotonic() < deadline, (b, cluster.output())
                time.sleep(0.2)
            out = g2.get(f"/v1/files/{b['output_file_id']}/content").text
        finally:
            old.start()
    custom_ids = [json.loads(x)["custom_id"] for x in out.splitlines() if x]
    assert sorted(custom_ids) == sorted(f"item-{i}" for i in range(n))
    assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}


def _batch(api: httpx.Client, batch_id: str) -> dict[str, Any]:
    r = api.get(f"/v1/batches/{batch_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _batch_or_none(api: httpx.Client, batch_id: str) -> dict[str, Any] | None:
    """None while no controller leads (the gateway answers 503 then)."""
    r = api.get(f"/v1/batches/{batch_id}")
    return dict(r.json()) if r.status_code == 200 else None
