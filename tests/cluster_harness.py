"""Run the cluster's roles (`modelyard gateway`, `modelyard controller`) as real processes on one
PostgreSQL database and one Redis database, and drive them as an operator and clients would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import redis

from modelyard.core.cluster_auth import verified_leader_url
from tests import process_logs
from tests.conftest import free_port
from tests.loop_stalls import stall_log_env
from tests.platform_harness import tiny_models_env

LEADER_KEY = "modelyard:controller:leader"
# Every role of a test cluster holds the same secret unless a test says otherwise.
CLUSTER_SECRET = "test-cluster-secret-" + "0123456789abcdef" * 2


class RoleProcess:
    def __init__(self, role: str, data_dir: Path, env: dict[str, str]) -> None:
        self.role = role
        self.data_dir = data_dir
        self.stall_log, env = stall_log_env(env)  # the loop-stall guard: tests/loop_stalls.py
        self.env = {**os.environ, "MODELYARD_CLUSTER_SECRET": CLUSTER_SECRET, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the process
        self.proc: subprocess.Popen[bytes] | None = None
        process_logs.register(self)  # a failing test's report shows this log

    def label(self) -> str:
        return f"modelyard {self.role} on port {self.port}"

    def start(self, timeout: float = 120.0) -> RoleProcess:
        return self.launch().wait_up(timeout)

    def launch(self) -> RoleProcess:
        cmd = [
            sys.executable, "-m", "modelyard.cli", self.role, "--port", str(self.port),
            "--data-dir", str(self.data_dir), "--log-level", "info",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def wait_up(self, timeout: float = 120.0) -> RoleProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.role} did not come up:\n{self.output()}")

    def output(self) -> str:
        return process_logs.read_log(self.log)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """Two controllers (sharing a data dir: the admin key, the Files API's files) and two
    gateways on one PostgreSQL and one Redis database, local workers of the tiny models."""

    def __init__(
        self,
        tmp: Path,
        models_dir: Path,
        database_url: str,
        redis_url: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.models_dir = models_dir
        self.env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": "3",
            "MODELYARD_ROUTING_REFRESH_S": "1",
            "MODELYARD_BATCH_LEASE_S": "5",
            **(env or {}),
        }
        # The controllers share a data dir (admin key, the Files API's files); gateways own one.
        self.control_dir = tmp / "control"
        self.controllers = [RoleProcess("controller", self.control_dir, self.env) for _ in "ab"]
        self.gateways = [RoleProcess("gateway", tmp / f"gw{i}", self.env) for i in (1, 2)]

    def leader(self) -> RoleProcess:
        return wait_leader(self.redis_url, self.controllers)

    def standby(self) -> RoleProcess:
        leader = self.leader()
        return next(c for c in self.controllers if c is not leader)

    @property
    def admin_key(self) -> str:
        return (self.control_dir / "admin_key").read_text().strip()

    def api(self, gateway: int = 0, key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {key or self.admin_key}"}
        return httpx.Client(base_url=self.gateways[gateway].url, headers=headers, timeout=60.0)

    def output(self) -> str:
        return "\n".join(
            f"===== {p.role} {p.url}\n{p.output()[-6000:]}"
            for p in self.controllers + self.gateways
        )

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        """Every process's log, printed when the block fails."""
        try:
            yield
        except BaseException:
            print(self.output())
            raise


def leader_url(redis_url: str) -> str | None:
    client = redis.Redis.from_url(redis_url)
    try:
        value = client.get(LEADER_KEY)
    finally:
        client.close()
    # `<signature> <url>`: the test cluster's own secret verifies it.
    return verified_leader_url(CLUSTER_SECRET, value)


def wait_leader(
    redis_url: str, candidates: list[RoleProcess], timeout: float = 60.0
) -> RoleProcess:
    """The controller whose URL is the advertised leader's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        url = leader_url(redis_url)
        for c in candidates:
            if c.url == url and c.proc is not None and c.proc.poll() is None:
                return c
        time.sleep(0.1)
    raise AssertionError("no controller leads:\n" + "\n---\n".join(c.output() for c in candidates))


def kill_workers(marker: str) -> None:
    """Stop the worker replicas this test's controllers started (they outlive controllers by
    design), found by the test's own model folder on their command line."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    for pid in (int(p) for p in out.stdout.split()):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def chat(api: httpx.Client, model: str = "tiny") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return api.post("/v1/chat/completions", json=body)


class Traffic:
    """Non-streaming chats in a loop over the gateways `connect` opens clients to (a client
    that retries on the next gateway only when one cannot be reached), counting answers and
    failures."""

    def __init__(self, connect: Callable[[], list[httpx.Client]]) -> None:
        self.connect = connect
        self.ok: list[str] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def wait_ok(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        target = len(self.ok) + n
        while len(self.ok) < target:
            assert time.monotonic() < deadline, f"traffic stalled: {self.failed[-3:]}"
            time.sleep(0.05)

    def _run(self) -> None:
        clients = self.connect()
        i = 0
        while not self._stop.is_set():
            i += 1
            for attempt in range(len(clients)):
                client = clients[(i + attempt) % len(clients)]
                try:
                    r = chat(client)
                except httpx.TransportError as exc:
                    if attempt + 1 == len(clients):
                        self.failed.append(repr(exc))
                    continue  # that gateway is gone: the client tries the other
                if r.status_code == 200:
                    self.ok.append(r.headers["x-request-id"])
                else:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")
                break
        for c in clients:
            c.close()
