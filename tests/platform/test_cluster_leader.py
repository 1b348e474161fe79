"""The cluster's leader under failure, with real processes (two `modelyard controller`s, two
`modelyard gateway`s, PostgreSQL, Redis, local workers of tiny random models); every request
here goes through the gateways, none to a controller.

In order (the tests share the cluster): a canary whose every request fails, its traffic sent
through the gateways only, is rolled back by the leader (the SLO gate sums every gateway's
outcomes from Redis); a takeover whose adoption of the running replicas takes three leases
(`test_adopt_delay_s`, a slow backend) keeps its lease: the new leader still leads after it,
never lost the lease, answers control requests throughout and adopted the same processes; a
leader frozen (SIGSTOP) holds a control request sent to it only for a short timeout, after
which the request goes to the next leader (or is a retryable 503), and once woken, having lost
its lease, it steps down to standby (it does not exit) and leads again, a fresh term that
adopts, deploys and serves, when the other leader is killed.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.registry_client import RegistryClient
from tests.cluster_harness import Cluster, RoleProcess, chat, kill_workers, leader_url
from tests.databases import fresh_postgres, fresh_redis
from tests.loop_stalls import assert_no_loop_stalls, stall_counts
from tests.platform_harness import deploy, wait_status
from tests.tiny_models import build_model
from tests.waiting import wait_until

# The module's cluster starts with the first test (four processes, two model pushes: 145 s
# with the first test on a busy 2 vCPU), and a takeover waits out three leases.
pytestmark = pytest.mark.timeout(420)

LEASE_S = 3.0
ADOPT_DELAY_S = 3 * LEASE_S
FORWARD_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    env = {
        "MODELYARD_CONTROLLER_LEASE_S": str(LEASE_S),
        "MODELYARD_TEST_ADOPT_DELAY_S": str(ADOPT_DELAY_S),
        "MODELYARD_CONTROL_FORWARD_TIMEOUT_S": str(FORWARD_TIMEOUT_S),
    }
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        tmp = tmp_path_factory.mktemp("cluster")
        c = Cluster(tmp, models_dir, database_url, redis_url, env)
        try:
            c.controllers[0].start()
            c.leader()
            others = [c.controllers[1], *c.gateways]
            for p in others:
                p.launch()
            for p in others:
                p.wait_up()
            yield c
        finally:
            for p in c.gateways + c.controllers:
                if p.proc is not None and p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGCONT)  # a test that failed with one frozen
                p.kill(signal.SIGTERM)
            kill_workers(str(models_dir))


def _steady(api: httpx.Client, model: str, stop: threading.Event, codes: list[int]) -> None:
    while not stop.is_set():
        payload = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 4, "ignore_eos": True}  # fmt: skip
        codes.append(api.post("/v1/chat/completions", json=payload).status_code)


def test_a_canary_failing_through_the_gateways_is_rolled_back(
    cluster: Cluster, models_dir: Path
) -> None:
    with cluster.logs_on_failure(), cluster.api(0) as g1, cluster.api(1) as g2:
        registry = RegistryClient(cluster.gateways[0].url, cluster.admin_key)
        registry.push(build_model(models_dir / "v1", "llama", seed=0), "slo")  # slo:1
        registry.push(build_model(models_dir / "v2", "llama", seed=1), "slo")  # slo:2
        endpoint = deploy(g1, "slo", "slo:1", hardware={"max_replicas": 2})
        stable = g1.get(f"/v1/endpoints/{endpoint}").json()["version_id"]
        slo = {"min_samples": 10, "window_s": 30, "max_error_rate_delta": 0.2}
        # The canary's worker times every request out: each is a failure at the gateway.
        r = g2.post(f"/v1/endpoints/{endpoint}/versions", json={
            "model_artifact": "slo:2", "weight": 50, "slo": slo,
            "engine": {"request_timeout_s": 0.001}})  # fmt: skip
        assert r.status_code == 201, r.text

        def canary() -> dict[str, Any] | None:
            return g1.get(f"/v1/endpoints/{endpoint}").json()["versions"]["canary"]

        wait_until(lambda: (canary() or {}).get("status") == "serving", "the canary serving")
        stop, codes = threading.Event(), []
        # Both gateways carry the traffic; the controllers' own gateways see none of it.
        threads = [
            threading.Thread(target=_steady, args=(api, "slo", stop, codes)) for api in (g1, g2)
        ]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: canary() is None, "the canary rolled back", timeout=120)
        finally:
            stop.set()
            for t in threads:
                t.join()
        body = g1.get(f"/v1/endpoints/{endpoint}").json()
        rollback = body["last_rollback"]
        print("rolled back:", rollback["reason"], rollback["numbers"], f"{len(codes)} requests")
        assert rollback["by"] == "system" and "error rate" in rollback["reason"]
        assert rollback["numbers"]["canary_errors"] >= 10
        assert rollback["to_version_id"] == stable and body["version_id"] == stable
        assert g1.delete(f"/v1/endpoints/{endpoint}").status_code == 202
        wait_status(g1, endpoint, "gone")


def _replica_pids(api: httpx.Client, name: str) -> set[int]:
    r = api.get("/v1/endpoints")
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    body = next(e for e in r.json()["data"] if e["model_name"] == name)
    return {r["pid"] for r in body["replicas"]["items"] if r["state"] == "ready"}


def test_a_slow_adoption_does_not_cost_the_new_leader_its_lease(cluster: Cluster) -> None:
    old = cluster.leader()
    standby = cluster.standby()
    with cluster.logs_on_failure(), cluster.api(0) as g1, cluster.api(1) as g2:
        deploy(g1, "tiny", str(cluster.models_dir / "tiny"), public=True)
        wait_until(lambda: chat(g2).status_code == 200, "tiny through gateway 2")
        pids = _replica_pids(g1, "tiny")
        stalls = stall_counts(standby, *cluster.gateways)
        old.kill()
        try:
            assert cluster.leader() is standby
            led_at = time.monotonic()
            # Throughout the adoption (three leases), control requests and inference answer.
            answers: list[int] = []
            while "adopted 1 running replica" not in standby.output():
                for api in (g1, g2):
                    answers += [api.get("/v1/endpoints").status_code, chat(api).status_code]
                assert time.monotonic() - led_at < 120, "the adoption never finished"
            adopted_after = time.monotonic() - led_at
            print(f"adopted {adopted_after:.1f}s after leading; {len(answers)} answers")
            assert adopted_after > LEASE_S  # the slow path was taken
            assert set(answers) == {200}, answers
            # Still the leader, several leases later: it never lost the lease.
            assert leader_url(cluster.redis_url) == standby.url
            assert standby.proc is not None and standby.proc.poll() is None
            assert "lost the leader lease" not in standby.output()
            assert _replica_pids(g2, "tiny") == pids  # the same processes, adopted
            # The slow backend held a thread, never the new leader's event loop.
            assert_no_loop_stalls(standby, *cluster.gateways, since=stalls)
        finally:
            old.start()  # back as the standby


def _freeze(role: RoleProcess) -> None:
    assert role.proc is not None
    role.proc.send_signal(signal.SIGSTOP)


def _thaw(role: RoleProcess) -> None:
    assert role.proc is not None
    role.proc.send_signal(signal.SIGCONT)


def test_a_frozen_leader_is_left_and_once_woken_steps_down_and_leads_again(
    cluster: Cluster,
) -> None:
    frozen = cluster.leader()
    other = cluster.standby()
    with cluster.logs_on_failure(), cluster.api(0) as g1, cluster.api(1) as g2:
        pids = _replica_pids(g1, "tiny")
        _freeze(frozen)
        try:
            # The gateway holds the frozen leader's address: it gives up on it after a short
            # timeout and sends the request on to the next leader (or answers a retryable 503
            # when none leads yet), never waiting for the frozen one.
            sent = time.monotonic()
            r = g1.get("/v1/endpoints", timeout=60)
            first_answer = time.monotonic() - sent
            print(f"first answer {r.status_code} after {first_answer:.1f}s")
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "no_leader" and r.headers["retry-after"]
                r = wait_until(
                    lambda: (x := g1.get("/v1/endpoints")).status_code == 200 and x,
                    "a control request answered by the next leader",
                )
            assert "did not answer a control request" in cluster.gateways[0].output()
            assert cluster.leader() is other
        finally:
            _thaw(frozen)
        # Woken, it finds its lease lost and stands by: no exit, nothing of its leadership left.
        line = wait_until(
            lambda: next((x for x in frozen.output().splitlines() if "stepped down" in x), None),
            "the woken leader stepping down",
        )
        print(line)
        assert "did not stop" not in frozen.output()  # every leader-only part stopped
        assert frozen.proc is not None and frozen.proc.poll() is None
        assert httpx.get(f"{frozen.url}/health", timeout=10).status_code == 200
        assert leader_url(cluster.redis_url) == other.url
        assert g2.get("/v1/endpoints").status_code == 200

        # The other leader dies: the one that stepped down leads again, a fresh term.
        wait_until(lambda: "adopted 1 running replica" in other.output(), "the adoption")
        adoptions = frozen.output().count("adopted 1 running replica")  # its first term's
        other.kill()
        try:
            assert cluster.leader() is frozen
            wait_until(lambda: "term 2" in frozen.output(), "the woken leader's second term")
            wait_until(
                lambda: frozen.output().count("adopted 1 running replica") > adoptions,
                "the second term adopting the replica",
                timeout=120,
            )
            assert _replica_pids(g2, "tiny") == pids
            assert chat(g1).status_code == 200
            deploy(g2, "tiny2", str(cluster.models_dir / "tiny"))
            wait_until(lambda: chat(g1, "tiny2").status_code == 200, "tiny2 through gateway 1")
        finally:
            other.start()
