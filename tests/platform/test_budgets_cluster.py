"""A dollar budget across two gateways (cluster mode: one controller and two `modelyard gateway`
processes on one PostgreSQL and one Redis): streams sent through both gateways at once, then
requests alternating between them, stop at the key's limit within one request's cost, because
both reserve and settle on the same spend counter in Redis."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster_harness import Cluster, chat, kill_workers
from tests.databases import fresh_postgres, fresh_redis
from tests.platform_harness import create_key, create_tenant, deploy, wait_request_ids

MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        c = Cluster(
            tmp_path_factory.mktemp("cluster"), models_dir, database_url, redis_url,
            env={"MODELYARD_BUDGET_REFRESH_S": "0.5"},
        )  # fmt: skip
        try:
            c.controllers[0].start()
            c.leader()
            for g in c.gateways:
                g.launch()
            for g in c.gateways:
                g.wait_up()
            yield c
        finally:
            for p in c.gateways + c.controllers:
                p.kill(signal.SIGTERM)
            kill_workers(str(models_dir))


def stream(api: httpx.Client) -> tuple[int, str]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with api.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())["error"]["code"]
        for _ in r.iter_lines():
            pass
        return 200, r.headers["x-request-id"]


@pytest.mark.timeout(420)  # a cluster of three processes starts first, on 2 vCPU
def test_a_budget_holds_across_two_gateways(cluster: Cluster) -> None:
    with cluster.logs_on_failure(), cluster.api(0) as admin, cluster.api(1) as admin2:
        endpoint_id = deploy(admin, "tiny", str(cluster.models_dir / "tiny"), public=True)
        price = {"input_usd_per_million": 100, "output_usd_per_million": 200}
        r = admin.put(f"/v1/prices/{endpoint_id}", json=price)
        assert r.status_code == 200, r.text
        tenant = create_tenant(admin, "spender")
        key = create_key(admin, tenant)
        r = admin.post("/v1/budgets", json={"tenant_id": tenant, "scope": "key",
                       "subject_id": key["id"], "period": "day", "limit_usd": "0.08"})  # fmt: skip
        assert r.status_code == 201, r.text
        budget_id = r.json()["id"]
        g1, g2 = cluster.api(0, key["key"]), cluster.api(1, key["key"])
        assert chat(g2).status_code == 200  # its row is among the key's below
        outcomes: list[tuple[int, str]] = []
        threads = [threading.Thread(target=lambda g=g: outcomes.append(stream(g)))
                   for g in (g1, g2, g1, g2, g1, g2)]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        answered = [rid for status, rid in outcomes if status == 200]
        assert {code for status, code in outcomes if status != 200} <= {"budget_exceeded"}
        refused_by = set()
        for i in range(40):  # alternating, until both gateways refuse
            g = (g1, g2)[i % 2]
            r = g.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "ignore_eos": True},
            )
            if r.status_code == 200:
                answered.append(r.headers["x-request-id"])
                refused_by.clear()
                continue
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
            refused_by.add(i % 2)
            if refused_by == {0, 1}:
                break
        assert refused_by == {0, 1}
        rows = wait_request_ids(admin, answered, tenant_id=tenant)
        costs = [int(x["prompt_tokens"]) * 100 + int(x["completion_tokens"]) * 200
                 for x in rows if x["key_id"] == key["id"]]  # fmt: skip
        assert 80_000 <= sum(costs) < 80_000 + max(costs), (sum(costs), costs)
        budget = admin2.get(f"/v1/budgets/{budget_id}").json()
        assert budget["spent_micro_usd"] == sum(costs), budget
        g1.close()
        g2.close()
