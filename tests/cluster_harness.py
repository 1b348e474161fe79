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
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from modelyard.core.cluster_auth import verified_leader_url
from tests.conftest import free_port
from tests.loop_stalls import stall_log_env

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
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
