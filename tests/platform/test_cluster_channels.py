"""The cluster's own channels are authenticated (issue 27): a gateway forwards control
requests (and the caller's bearer key with them) only to a leader URL signed with the cluster
secret, and a worker the platform started answers only requests carrying the cluster's token.

Real processes throughout: a `modelyard gateway` on PostgreSQL and Redis with a listener of
the attacker's own where a forged leader key points; a `modelyard worker` started with a token;
a `modelyard serve` whose cluster secret makes its local workers demand the token, which the
platform then sends on every path (inference, /metrics federation).
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from modelyard.core.cluster_auth import sign_leader_url, worker_token
from tests.cluster_harness import CLUSTER_SECRET, LEADER_KEY, RoleProcess
from tests.conftest import WorkerProcess
from tests.databases import fresh_postgres, fresh_redis
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Listener:
    """Someone's HTTP server that records every request it gets (the host a forged leader key
    points at): answers 200 to anything."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # method, path, authorization
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                seen.append((self.command, self.path, self.headers.get("authorization")))
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                body = b'{"object": "captured"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = _any

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RoleProcess, str]]:
    """One gateway, no controller: whatever the leader key says is all it knows."""
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        env = {
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": "1",  # how long a control request waits for one
        }
        g = RoleProcess("gateway", tmp_path_factory.mktemp("gw"), env).start()
        try:
            yield g, redis_url
        finally:
            g.kill()


def _advertise(redis_url: str, value: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(LEADER_KEY, value, px=60_000)
    finally:
        client.close()


def test_a_forged_leader_key_gets_no_control_request(gateway: tuple[RoleProcess, str]) -> None:
    g, redis_url = gateway
    deploy_body = {"model_name": "m", "model_artifact": "tiny"}
    victim = {"authorization": "Bearer sk-my-a-tenant-admins-key"}
    with Listener() as attacker:
        # Whoever can write Redis, without the secret: a bare URL, and one signed with another
        # secret. Neither is a leader: the request waits for one, then is a 503, and the
        # listener hears nothing (no key of anyone's).
        for forged in (attacker.url, sign_leader_url("another-secret-" + "x" * 32, attacker.url)):
            _advertise(redis_url, forged)
            r = httpx.post(f"{g.url}/v1/models/deploy", json=deploy_body, headers=victim)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "no_leader"
            assert attacker.seen == []
        assert "not signed with this cluster's secret" in g.output()
        # Signed with the cluster's secret, the same URL is the leader: forwarded as it came.
        _advertise(redis_url, sign_leader_url(CLUSTER_SECRET, attacker.url))
        r = httpx.post(f"{g.url}/v1/models/deploy", json=deploy_body, headers=victim)
        assert r.status_code == 200 and r.json() == {"object": "captured"}
        assert attacker.seen == [("POST", "/v1/models/deploy", victim["authorization"])]


def test_cluster_roles_refuse_to_start_without_a_secret(tmp_path: Path) -> None:
    env = {
        "MODELYARD_DATABASE_URL": "postgresql://127.0.0.1/unused",
        "MODELYARD_REDIS_URL": "redis://127.0.0.1:6379/15",
        "MODELYARD_CLUSTER_SECRET": "",
    }
    g = RoleProcess("gateway", tmp_path, env)
    g.env.pop("MODELYARD_CLUSTER_SECRET")
    g.launch()
    assert g.proc is not None and g.proc.wait(60) != 0
    assert "MODELYARD_CLUSTER_SECRET" in g.output()


def test_a_worker_with_a_token_answers_only_its_bearer(tiny_llama: Path) -> None:
    token = worker_token(CLUSTER_SECRET)
    w = WorkerProcess(str(tiny_llama), {"MODELYARD_WORKER_TOKEN": token})
    try:
        w.wait_ready()  # /health stays open: the platform's probes read it
        bearer = {"authorization": f"Bearer {token}"}
        wrong = {"authorization": f"Bearer {worker_token('another-secret-' + 'x' * 32)}"}
        name = httpx.get(f"{w.url}/v1/models", headers=bearer).json()["data"][0]["id"]
        calls = [
            ("POST", "/v1/chat/completions", {**CHAT, "model": name}),
            ("POST", "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1}),
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("PUT", "/admin/served-model", {"name": "hijacked"}),
        ]
        for method, path, body in calls:
            for headers in ({}, wrong):
                r = httpx.request(method, w.url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, r.status_code, r.text)
                assert r.json()["error"]["code"] == "worker_token_required"
        r = httpx.post(f"{w.url}/v1/chat/completions", json=calls[0][2], headers=bearer, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{w.url}/v1/models", headers=bearer).json()["data"][0]["id"] == name
    finally:
        w.stop()


def _worker_port(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--port") + 1])


def test_serve_with_a_cluster_secret_sends_its_workers_the_token(
    tmp_path: Path, models_dir: Path
) -> None:
    env = {**tiny_models_env(models_dir), "MODELYARD_CLUSTER_SECRET": CLUSTER_SECRET}
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        deploy(p.api(), "tiny", str(models_dir / "tiny"))
        # Through the platform: answered (the gateway sends the token), and the replica's
        # series come back through /metrics (so does the federation's scrape).
        r = p.api().post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        metrics = p.api().get("/metrics").text
        assert "vllm:num_requests_running" in metrics
        # Around it: the worker refuses a caller without the token, and was never told the
        # cluster secret itself.
        (pid,) = p.worker_pids()
        url = f"http://127.0.0.1:{_worker_port(pid)}"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 401
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"MODELYARD_CLUSTER_SECRET={CLUSTER_SECRET}".encode() not in environ
        token = worker_token(CLUSTER_SECRET)
        assert f"MODELYARD_WORKER_TOKEN={token}".encode() in environ
        assert json.loads(p.api().get("/health").text)["status"] == "ok"
    finally:
        p.stop()
    assert os.environ.get("MODELYARD_CLUSTER_SECRET") is None
