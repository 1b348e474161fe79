"""The chaos soak's cluster: the topology of `soak_topology` wired together (2 controllers,
2 gateways, Redis, PostgreSQL, worker replicas of a tiny model), an operator's supervisor that
restarts gateways and controllers that exit, and one `kill(piece)` per kind of fault that answers
how long recovery took."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks.soak_checks import usage_rows
from benchmarks.soak_load import FailoverTransport
from benchmarks.soak_postgres import PgTopology
from benchmarks.soak_topology import Proc, RedisTopology, RoleNode, wait_for
from modelyard.core.cluster_auth import verified_leader_url
from modelyard.core.cluster_keys import LEADER_KEY
from tests.tiny_encoders import build_embedding_model
from tests.tiny_models import build_model

MODEL = "tiny"
EMBED_MODEL = "tiny-embed"


class Supervisor:
    """Restarts a gateway or controller that exited (killed or crashed) after `delay_s`, on the
    same address, as systemd's `Restart=always` would; exits nobody asked for are recorded."""

    def __init__(self, nodes: list[RoleNode], delay_s: float) -> None:
        self.nodes, self.delay_s = nodes, delay_s
        self.expected: set[str] = set()
        self.unplanned: list[dict[str, Any]] = []
        self.restarts = 0
        self.epoch = time.monotonic()  # `at_s` of an unplanned exit counts from here
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-supervisor")

    def start(self) -> None:
        self._thread.start()

    def expect_exit(self, node: RoleNode) -> None:
        with self._lock:
            self.expected.add(node.name)

    def _run(self) -> None:
        while not self._stop.wait(0.2):  # the supervisor's poll interval
            for node in self.nodes:
                if node.alive or node.popen is None:
                    continue
                with self._lock:
                    if node.name in self.expected:
                        self.expected.discard(node.name)
                    else:
                        self.unplanned.append(
                            {
                                "process": node.name,
                                "code": node.popen.returncode,
                                "at_s": round(time.monotonic() - self.epoch, 1),
                            }
                        )
                if self._stop.wait(self.delay_s):  # RestartSec
                    return
                node.launch()
                self.restarts += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class SoakCluster:
    def __init__(
        self,
        out: Path,
        redis_mode: str,
        pg_mode: str,
        secret: str,
        restart_delay: float,
        pg_promote_after: float = 2.0,
    ) -> None:
        self.out = out
        self.secret = secret
        self.redis = RedisTopology(redis_mode, out, restart_delay)
        self.pg = PgTopology(pg_mode, out, pg_promote_after, restart_delay)
        self.models = out / "models"
        self.control_dir = out / "control"
        self.stall_log = out / "loop_stalls.jsonl"
        self.controllers: list[RoleNode] = []
        self.gateways: list[RoleNode] = []
        self.restart_delay = restart_delay
        self.supervisor = Supervisor([], restart_delay)
        self.key = ""
        self.tenant = ""
        self.endpoint = ""
        self.replicas = 0
        self.model = MODEL
        self.embed_model = ""
        self._gateway_kills = 0

    # ----- start and stop --------------------------------------------------------------------

    def start(self, replicas: int, embeddings: bool = False) -> None:
        build_model(self.models / MODEL, "llama")
        if embeddings:
            build_embedding_model(self.models / EMBED_MODEL)
            self.embed_model = EMBED_MODEL
        self.pg.start()
        self.redis.start()
        env = {
            "MODELYARD_DATABASE_URL": self.pg.url,
            "MODELYARD_REDIS_URL": self.redis.url,
            "MODELYARD_CLUSTER_SECRET": self.secret,
            "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(self.models)]),
            "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
            "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": "3",
            "MODELYARD_ROUTING_REFRESH_S": "1",
            "MODELYARD_BATCH_LEASE_S": "5",
            "MODELYARD_LOOP_STALL_MS": "250",
            "MODELYARD_LOOP_STALL_LOG": str(self.stall_log),
        }
        self.controllers = [
            RoleNode(f"controller-{c}", "controller", self.out, self.control_dir, env) for c in "ab"
        ]
        self.gateways = [
            RoleNode(f"gateway-{i}", "gateway", self.out, self.out / f"gw{i}", env) for i in (1, 2)
        ]
        self.controllers[0].start()
        wait_for(lambda: self.leader() is self.controllers[0], "the first controller leading", 60)
        for node in [self.controllers[1], *self.gateways]:
            node.launch()
        for node in [self.controllers[1], *self.gateways]:
            node.wait_up()
        self.supervisor = Supervisor([*self.controllers, *self.gateways], self.restart_delay)
        self.supervisor.start()
        self._provision(replicas)
        if embeddings:
            self._deploy_embeddings()

    def _provision(self, replicas: int) -> None:
        admin = (self.control_dir / "admin_key").read_text().strip()
        with self.api(admin) as api:
            r = api.post("/v1/tenants", json={"name": "soak", "monthly_token_quota": None})
            assert r.status_code == 201, r.text
            self.tenant = r.json()["id"]
            # Limits on the key, so that every request takes the Redis path of admission.
            r = api.post(
                "/v1/keys",
                json={
                    "name": "soak",
                    "tenant_id": self.tenant,
                    "rpm_limit": 1_000_000,
                    "tpm_limit": 10**9,
                },
            )
            assert r.status_code == 201, r.text
            self.key = r.json()["key"]
            hardware = {
                "gpu_type": "cpu",
                "gpu_count": 1,
                "min_replicas": replicas,
                "max_replicas": replicas,
            }
            r = api.post(
                "/v1/models/deploy",
                json={
                    "model_name": MODEL,
                    "model_artifact": str(self.models / MODEL),
                    "public": True,
                    "hardware": hardware,
                },
            )
            assert r.status_code == 202, r.text
            self.endpoint = r.json()["endpoint_id"]
        self.replicas = replicas
        wait_for(lambda: len(self.ready_pids()) == replicas, "the replicas ready", 180, 0.5)

    def _deploy_embeddings(self) -> None:
        """The tiny embedding model, served by the encoder host the leader runs."""
        admin = (self.control_dir / "admin_key").read_text().strip()
        with self.api(admin) as api:
            body = {"model_name": EMBED_MODEL, "public": True,
                    "model_artifact": str(self.models / EMBED_MODEL)}  # fmt: skip
            r = api.post("/v1/models/deploy", json=body)
            assert r.status_code == 202, r.text
            endpoint = r.json()["endpoint_id"]

            def ready() -> bool:
                return api.get(f"/v1/endpoints/{endpoint}").json().get("status") == "ready"

            wait_for(ready, "the embedding endpoint ready", 180, 0.5)

    def close(self) -> None:
        self.supervisor.stop()
        for node in [*self.gateways, *self.controllers]:
            node.kill(signal.SIGTERM)
        self._kill_workers()
        for proc in [*self.redis.procs(), *self.pg.procs()]:
            proc.kill()
        for node in self.pg.nodes:
            node.remove()

    def _kill_workers(self) -> None:
        """Worker replicas (and the encoder host) outlive their controllers by design: stop
        this run's, found by the stall-log path unique to this run in their environment."""
        marker = f"MODELYARD_LOOP_STALL_LOG={self.stall_log}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)

    # ----- looking at it ---------------------------------------------------------------------

    @property
    def gateway_urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def api(self, key: str) -> httpx.Client:
        transport = FailoverTransport(self.gateway_urls, 0)
        return httpx.Client(
            base_url=self.gateway_urls[0],
            transport=transport,
            timeout=30.0,
            headers={"authorization": f"Bearer {key}"},
        )

    def sdk(self, key: str) -> openai.OpenAI:
        http = httpx.Client(transport=FailoverTransport(self.gateway_urls, 1), timeout=60.0)
        return openai.OpenAI(base_url=f"{self.gateway_urls[1]}/v1", api_key=key, http_client=http)

    def describe(self) -> str:
        return (
            f"2 controllers, 2 gateways, {self.replicas} worker replicas"
            f"{' + an embedding model' if self.embed_model else ''}, Redis "
            f"{self.redis.mode}, PostgreSQL {self.pg.mode}"
        )

    def leader(self) -> RoleNode | None:
        client = self.redis.client()
        try:
            url = verified_leader_url(self.secret, client.get(LEADER_KEY))
        finally:
            client.close()
        return next((c for c in self.controllers if c.url == url and c.alive), None)

    def ready_pids(self) -> set[int]:
        admin = (self.control_dir / "admin_key").read_text().strip()
        with self.api(admin) as api:
            r = api.get(f"/v1/endpoints/{self.endpoint}")
        if r.status_code != 200:
            return set()
        items = r.json().get("replicas", {}).get("items", [])
        return {i["pid"] for i in items if i.get("state") == "ready" and i.get("pid")}

    def procs(self) -> list[Proc]:
        return [*self.controllers, *self.gateways, *self.redis.procs(), *self.pg.procs()]

    def logs_tail(self, chars: int = 3000) -> str:
        """The tail of every process's log: servers, roles, and the replicas the controllers
        started (their logs are in the controllers' shared data dir)."""
        parts = [f"===== {p.name} ({p.log_path})\n{p.tail(chars)}" for p in self.procs()]
        for log in sorted((self.control_dir / "logs").glob("*.log")):
            parts.append(f"===== {log}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def loop_stalls(self) -> int:
        try:
            lines = self.stall_log.read_text().splitlines()
        except FileNotFoundError:
            return 0
        return sum(1 for x in lines if x.strip() and json.loads(x).get("event") == "stall")

    def all_up(self, timeout: float = 120.0) -> None:
        for node in [*self.controllers, *self.gateways]:
            wait_for(node.healthy, f"{node.name} back", timeout, 0.2)
        wait_for(self.leader, "a leader", timeout)

    def wait_metered(self, answered: list[str], timeout: float) -> list[tuple[str, str, bool]]:
        """The tenant's usage rows once every answered id has one (or `timeout` passed)."""
        wanted = set(answered)
        deadline = time.monotonic() + timeout
        while True:
            rows = usage_rows(self.pg.primary_url(), self.tenant)
            if wanted <= {r[0] for r in rows} or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)  # a poll's interval: usage rows are written asynchronously

    # ----- faults ----------------------------------------------------------------------------

    def kill(self, piece: str, round_no: int) -> dict[str, Any]:
        return {
            "worker": self._kill_worker,
            "gateway": self._kill_gateway,
            "leader": self._kill_leader,
            "redis": self._kill_redis,
            "postgres": self._kill_postgres,
        }[piece](round_no)

    def _kill_worker(self, round_no: int) -> dict[str, Any]:
        pids = sorted(wait_for(self.ready_pids, "a ready replica", 60))
        victim = pids[round_no % len(pids)]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(p := self.ready_pids()) >= self.replicas and victim not in p,
            "a replacement replica ready",
            120,
            0.2,
        )
        return {
            "target": f"worker pid {victim}",
            "recovery_s": time.monotonic() - t0,
            "means": "replacement replica ready",
        }

    def _kill_gateway(self, round_no: int) -> dict[str, Any]:
        node = self.gateways[self._gateway_kills % len(self.gateways)]  # alternating
        self._gateway_kills += 1
        self.supervisor.expect_exit(node)
        t0 = time.monotonic()
        node.kill()
        wait_for(lambda: node.alive and node.healthy(), f"{node.name} restarted", 120, 0.1)
        return {
            "target": node.name,
            "recovery_s": time.monotonic() - t0,
            "means": "restarted gateway answering (clients fail over meanwhile)",
        }

    def _kill_leader(self, round_no: int) -> dict[str, Any]:
        old = wait_for(self.leader, "a leader", 60)
        self.supervisor.expect_exit(old)
        t0 = time.monotonic()
        old.kill()
        new = wait_for(
            lambda: (n := self.leader()) is not None and n is not old and n,
            "a new leader advertised",
            120,
            0.05,
        )
        took = time.monotonic() - t0
        wait_for(old.healthy, f"{old.name} back as standby", 120, 0.2)
        return {
            "target": f"{old.name} -> {new.name}",
            "recovery_s": took,
            "means": "standby advertised as leader",
        }

    def _kill_redis(self, round_no: int) -> dict[str, Any]:
        name, recover = self.redis.kill_primary()
        took = recover()
        return {
            "target": name,
            "recovery_s": took,
            "means": "Redis writable again"
            + (" (promoted replica)" if self.redis.sentinel else ""),
        }

    def _kill_postgres(self, round_no: int) -> dict[str, Any]:
        name, recover = self.pg.kill_primary()
        took = recover()
        return {
            "target": name,
            "recovery_s": took,
            "means": "PostgreSQL writable again"
            + (" (promoted standby)" if self.pg.mode == "standby" else ""),
        }
