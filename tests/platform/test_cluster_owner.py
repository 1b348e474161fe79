"""Replicas with an owner, in cluster mode with real processes: two `modelyard controller`s and a
`modelyard gateway` on PostgreSQL and Redis, a local LLM worker and the shared encoder host.

In order (the tests share the cluster): the leader SIGKILLed while clients ask for embeddings
through the `openai` SDK: the new leader adopts the running encoder host (same process) and
every embedding is answered through the takeover (none a 404 `model_not_found`, none a 503);
the LLM worker is adopted and keeps running for longer than its owner timeout under the new
leader; then every controller is stopped and the replicas (worker and encoder host) exit on
their own, saying why.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.cluster_harness import RoleProcess, chat, wait_leader
from tests.databases import fresh_postgres, fresh_redis
from tests.platform_harness import deploy, tiny_models_env
from tests.tiny_encoders import build_embedding_model
from tests.tiny_models import build_model
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(420)

LEASE_S = 3.0
OWNER_LEASES = 4  # a replica waits LEASE_S * OWNER_LEASES = 12 s for its owner's heartbeat


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (FileNotFoundError, IndexError):
        return False


class Cluster:
    def __init__(self, tmp: Path, models: Path, database_url: str, redis_url: str) -> None:
        self.redis_url = redis_url
        self.models = models
        env = {
            **tiny_models_env(models),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": str(LEASE_S),
            "MODELYARD_REPLICA_OWNER_LEASES": str(OWNER_LEASES),
            "MODELYARD_ROUTING_REFRESH_S": "1",
        }
        self.control_dir = tmp / "control"
        self.controllers = [RoleProcess("controller", self.control_dir, env) for _ in "ab"]
        self.gateway = RoleProcess("gateway", tmp / "gw", env)
        self.pids: set[int] = set()  # every replica seen, for the clean-up
        self.llm = self.encoder = ""  # the endpoints the first test deploys
        self.llm_pids: set[int] = set()

    @property
    def admin_key(self) -> str:
        return (self.control_dir / "admin_key").read_text().strip()

    def api(self) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.admin_key}"}
        return httpx.Client(base_url=self.gateway.url, headers=headers, timeout=60.0)

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateway.url}/v1", api_key=self.admin_key, max_retries=0, timeout=60
        )

    def leader(self) -> RoleProcess:
        return wait_leader(self.redis_url, self.controllers)

    def replicas(self, api: httpx.Client, endpoint_id: str) -> list[dict[str, Any]]:
        r = api.get(f"/v1/endpoints/{endpoint_id}")
        assert r.status_code == 200, r.text
        items = list(r.json()["replicas"]["items"])
        self.pids.update(i["pid"] for i in items if i.get("pid"))
        return items

    def output(self) -> str:
        logs = sorted((self.control_dir / "logs").glob("*.log"))
        return "\n".join(
            [f"===== {p.role} {p.url}\n{p.output()[-8000:]}" for p in self.controllers]
            + [f"===== gateway\n{self.gateway.output()[-4000:]}"]
            + [f"===== {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in logs]
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    models = tmp_path_factory.mktemp("owner-models")
    build_model(models / "tiny", "llama")
    build_embedding_model(models / "embed")
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        c = Cluster(tmp_path_factory.mktemp("owner"), models, database_url, redis_url)
        failed = True
        try:
            c.controllers[0].start()
            c.leader()
            for p in (c.controllers[1], c.gateway):
                p.launch()
            for p in (c.controllers[1], c.gateway):
                p.wait_up()
            yield c
            failed = False
        finally:
            if failed:
                print(c.output())
            for p in (c.gateway, *c.controllers):
                p.kill(signal.SIGTERM)
            for pid in c.pids:  # whatever a failed test left running
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[None]:
    """Every process's log (controllers, gateway, replicas) when the test failed."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(cluster.output())


class Embeddings:
    """Embeddings through the `openai` SDK (no retries of its own) in a loop on a thread: what
    each call came to."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.ok = 0
        self.errors: list[tuple[int, str | None, str]] = []  # status, Retry-After, body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Embeddings:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.embeddings.create(model="embed", input="hello there")
                self.ok += 1
            except openai.APIStatusError as exc:
                retry_after = exc.response.headers.get("retry-after")
                body = exc.response.headers.get("x-request-id", "") + " " + exc.response.text
                self.errors.append((exc.status_code, retry_after, body[:300]))
                time.sleep(0.1)  # the pace of a client that was told to come back
            except openai.APIConnectionError as exc:
                self.errors.append((0, None, repr(exc)))
                time.sleep(0.1)  # the pace of a client that could not connect


def test_embeddings_keep_answering_through_a_takeover(cluster: Cluster) -> None:
    with cluster.api() as api:
        cluster.llm = deploy(api, "tiny", str(cluster.models / "tiny"))
        cluster.encoder = deploy(api, "embed", str(cluster.models / "embed"))
        cluster.llm_pids = {r["pid"] for r in cluster.replicas(api, cluster.llm)}
        host_pids = {r["pid"] for r in cluster.replicas(api, cluster.encoder)}
    sdk = cluster.sdk()
    assert len(sdk.embeddings.create(model="embed", input="hi").data[0].embedding) > 0
    old = cluster.leader()
    standby = next(c for c in cluster.controllers if c is not old)
    with Embeddings(sdk) as calls:
        wait_until(lambda: calls.ok >= 3, "embeddings answering before the takeover")
        old.kill()
        assert cluster.leader() is standby
        answered = calls.ok
        # Embeddings answer again under the new leader (the takeover is over for them).
        wait_until(lambda: calls.ok >= answered + 5, "embeddings after the takeover", 120)
    print(f"{calls.ok} embeddings answered; {len(calls.errors)} refused: {calls.errors[:3]}")
    not_found = [e for e in calls.errors if e[0] == 404]
    assert not_found == [], not_found[:3]
    # The running host was adopted, not restarted: nothing was refused at all.
    assert calls.errors == [], calls.errors[:3]
    with cluster.api() as api:

        def host_now() -> set[int]:  # once the new leader registered the model there again
            pids = {r["pid"] for r in cluster.replicas(api, cluster.encoder)}
            return pids if None not in pids else set()

        assert wait_until(host_now, "the encoder endpoint's host under the new leader") == host_pids
    old.start()  # back, as the standby


def test_a_standby_that_takes_over_keeps_the_workers(cluster: Cluster) -> None:
    """The takeover above adopted the LLM worker: it runs on, past its owner timeout, under the
    new leader's heartbeats."""
    with cluster.api() as api:
        pids = {r["pid"] for r in cluster.replicas(api, cluster.llm)}
        assert pids == cluster.llm_pids
        timeout = LEASE_S * OWNER_LEASES
        # An absence watched for a while: longer than the owner timeout, the worker must run on.
        watched_from = time.monotonic()
        while time.monotonic() - watched_from < 1.5 * timeout:
            assert all(_running(pid) for pid in pids), "an adopted worker exited"
            assert chat(api).status_code == 200
            time.sleep(0.5)  # the pace of the watch
        assert {r["pid"] for r in cluster.replicas(api, cluster.llm)} == pids


def test_replicas_exit_when_every_controller_is_stopped(cluster: Cluster) -> None:
    with cluster.api() as api:
        llm = {r["pid"]: r["id"] for r in cluster.replicas(api, cluster.llm)}
        host = {r["pid"] for r in cluster.replicas(api, cluster.encoder)}
    pids = set(llm) | host
    assert pids and all(_running(pid) for pid in pids)
    for controller in cluster.controllers:
        controller.kill(signal.SIGTERM)
    stopped_at = time.monotonic()
    # The gateway stays up: its requests are no owner's heartbeat.
    wait_until(
        lambda: not any(_running(pid) for pid in pids),
        "every replica to exit without a controller",
        timeout=LEASE_S * OWNER_LEASES + 60,
        interval=0.2,
    )
    took = time.monotonic() - stopped_at
    print(f"replicas exited {took:.1f}s after the last controller stopped")
    assert took >= LEASE_S * OWNER_LEASES * 0.5, took  # not killed by the controllers' stop
    log = (cluster.control_dir / "logs" / f"{next(iter(llm.values()))}.log").read_text()
    assert "no controller has sent this replica a heartbeat" in log, log[-2000:]
