"""Lifecycle of `modelyard serve`: registry pushes and integrity, replica repair and retries,
draining deletes, restarts that keep state, clean and unclean shutdowns, the first-start
bootstrap with the bundled SmolLM2, and the whole flow on PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.databases import platform_mode_env
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    wait_request_ids,
    wait_status,
    wait_usage,
)
from tests.tiny_models import build_model
from tests.waiting import wait_until

MESSAGES = [{"role": "user", "content": "Hello there"}]
ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def start_platform(data_dir: Path, **env: str) -> PlatformProcess:
    base = {"MODELYARD_WORKER_ENGINE": ENGINE, "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5"}
    return PlatformProcess(data_dir, {**base, **env}).start()


@pytest.fixture()
def platform(tmp_path: Path, cache_dir: Path) -> Iterator[PlatformProcess]:
    p = start_platform(tmp_path / "data")
    try:
        yield p
    finally:
        p.stop()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_push_with_the_cli_then_deploy_by_reference(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    admin = platform.api()
    tenant = create_tenant(admin, "pushers")
    key = create_key(admin, tenant, scopes=["admin", "inference"])["key"]
    cmd = [sys.executable, "-m", "modelyard.cli", "models", "push", str(tiny_dir),
           "--name", "tiny-reg", "--url", platform.url, "--api-key", key]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pushed tiny-reg:1 (hf" in out.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "pushed tiny-reg:2" in again.stdout and "uploading 0 of" in again.stdout + again.stderr

    api = platform.api(key)
    model = api.get("/v1/registry/models/tiny-reg").json()
    assert [v["version"] for v in model["versions"]] == [1, 2]
    assert "config.json" in model["versions"][0]["files"]
    endpoint = deploy(api, "tiny-reg", "tiny-reg:1")
    assert api.get(f"/v1/endpoints/{endpoint}").json()["model_artifact"] == "tiny-reg:1"
    client = platform.openai(key)
    assert client.chat.completions.create(model="tiny-reg", messages=MESSAGES, max_tokens=3)
    # Deployed versions cannot be deleted from under their endpoint.
    assert api.delete("/v1/registry/models/tiny-reg").status_code == 409

    # Another tenant neither sees the model nor can use its blobs.
    other = create_key(admin, create_tenant(admin, "others"), scopes=["admin"])["key"]
    other_api = platform.api(other)
    assert other_api.get("/v1/registry/models").json()["data"] == []
    sha = model["versions"][0]["files"]["config.json"]["sha256"]
    assert other_api.head(f"/v1/blobs/{sha}").status_code == 404
    r = other_api.post("/v1/registry/models/steal/versions",
                       json={"files": {"config.json": {"sha256": sha}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_blob"


def test_uploads_are_verified_and_bad_ones_leave_nothing(platform: PlatformProcess) -> None:
    api = platform.api()
    data = b"weights" * 1000
    right = hashlib.sha256(data).hexdigest()
    wrong = hashlib.sha256(b"other").hexdigest()
    r = api.put(f"/v1/blobs/{wrong}", content=data)
    assert r.status_code == 400 and r.json()["error"]["code"] == "digest_mismatch"
    assert api.head(f"/v1/blobs/{wrong}").status_code == 404
    assert not list((platform.data_dir / "artifacts" / "tmp").iterdir())  # no half-written file
    assert api.put("/v1/blobs/not-a-digest", content=data).status_code == 400
    r = api.post(
        "/v1/registry/models/m/versions", json={"files": {"model.gguf": {"sha256": right}}}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_blob"
    assert api.get("/v1/registry/models").json()["data"] == []  # nothing half-registered
    assert api.put(f"/v1/blobs/{right}", content=data).status_code == 201
    r = api.post("/v1/registry/models/m/versions",
                 json={"files": {"../escape.gguf": {"sha256": right}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_manifest"


def test_a_corrupted_blob_is_caught_before_loading(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    files = {}
    for f in sorted(tiny_dir.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        assert api.put(f"/v1/blobs/{sha}", content=f.read_bytes()).status_code == 201
        files[f.name] = {"sha256": sha}
    assert (
        api.post("/v1/registry/models/fragile/versions", json={"files": files}).status_code == 201
    )
    weights = files["model.safetensors"]["sha256"]
    blob = platform.data_dir / "artifacts" / "blobs" / "sha256" / weights[:2] / weights
    blob.chmod(stat.S_IWUSR | stat.S_IRUSR)
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00")
    endpoint = deploy(api, "fragile", "fragile", wait=False)
    failed = wait_status(api, endpoint, "failed")
    assert "corrupted" in failed["status_message"]


def test_dead_replicas_are_replaced_and_retries_hide_them(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    endpoint = deploy(api, "pair", str(tiny_dir), hardware={"min_replicas": 2, "max_replicas": 2})
    replicas = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    assert len(replicas) == 2
    victim = replicas[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    # Until the reconciler notices, the router still lists the dead replica: requests that
    # pick it fail to connect and are retried on the other one before any byte was sent.
    client = platform.openai()
    for _ in range(10):
        assert client.chat.completions.create(model="pair", messages=MESSAGES, max_tokens=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = api.get(f"/v1/endpoints/{endpoint}").json()
        items = body["replicas"]["items"]
        if body["replicas"]["ready"] == 2 and victim not in [r["pid"] for r in items]:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"replica not replaced: {body}")
    assert body["replicas"]["restarts"] >= 1
    assert client.chat.completions.create(model="pair", messages=MESSAGES, max_tokens=2)


def test_delete_drains_in_flight_requests_then_stops_the_replica(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    endpoint = deploy(api, "drain-me", str(tiny_dir))
    pid = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"][0]["pid"]
    result: dict[str, object] = {}

    def long_request() -> None:
        client = platform.openai()
        stream = client.chat.completions.create(
            model="drain-me", messages=MESSAGES, max_tokens=300, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c for c in stream if c.choices]
        result["finish"] = chunks[-1].choices[0].finish_reason

    def in_flight() -> int:
        return sum(int(r["outstanding"]) for r in
                   api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"])  # fmt: skip

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: in_flight() > 0, "the long request in flight on the replica")
    assert api.delete(f"/v1/endpoints/{endpoint}").json()["status"] == "draining"
    with pytest.raises(openai.NotFoundError):  # no new requests once draining
        platform.openai().chat.completions.create(model="drain-me", messages=MESSAGES)
    thread.join(60)
    assert result["finish"] == "length"  # the stream in flight finished whole
    wait_status(api, endpoint, "gone")
    assert wait_gone([pid])


def test_restart_keeps_keys_usage_and_endpoints(tmp_path: Path, tiny_dir: Path) -> None:
    data = tmp_path / "data"
    first = start_platform(data)
    try:
        admin = first.api()
        tenant = create_tenant(admin, "durable")
        key = create_key(admin, tenant)["key"]
        deploy(admin, "kept", str(tiny_dir), public=True)
        first.openai(key).chat.completions.create(model="kept", messages=MESSAGES, max_tokens=2)
        wait_usage(admin, lambda rows: len(rows) == 1, tenant_id=tenant)
    finally:
        assert first.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    second = start_platform(data)
    try:
        admin = second.api()
        (endpoint,) = admin.get("/v1/endpoints").json()["data"]
        wait_status(admin, endpoint["endpoint_id"], "ready")
        second.openai(key).chat.completions.create(model="kept", messages=MESSAGES, max_tokens=2)
        rows = wait_usage(admin, lambda rows: len(rows) >= 2, tenant_id=tenant)
        assert len(rows) == len({r["request_id"] for r in rows}) == 2
        assert "Admin API key: in" in second.output()  # not shown a second time
    finally:
        second.stop()


def test_no_orphan_workers_after_sigterm_or_sigkill(tmp_path: Path, tiny_dir: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = start_platform(tmp_path / f"data-{sig}")
        try:
            deploy(p.api(), "t", str(tiny_dir))
            workers = p.worker_pids()
            assert workers and all(alive(w) for w in workers)
        finally:
            p.stop(sig)
        assert wait_gone(workers), f"workers outlived serve after signal {sig}"


def test_the_platform_on_postgresql_and_redis(tmp_path: Path, tiny_dir: Path) -> None:
    with platform_mode_env("postgres-redis") as env:
        p = start_platform(tmp_path / "data", **env)
        try:
            admin = p.api()
            tenant = create_tenant(admin, "pg-tenant")
            key = create_key(admin, tenant, rpm_limit=100)["key"]
            deploy(admin, "pg-tiny", str(tiny_dir), public=True)
            ids = []
            for _ in range(3):
                raw = p.openai(key).chat.completions.with_raw_response.create(
                    model="pg-tiny", messages=MESSAGES, max_tokens=2
                )
                ids.append(raw.headers["x-request-id"])
            rows = wait_request_ids(admin, ids, tenant_id=tenant)
            assert sorted(r["request_id"] for r in rows) == sorted(ids)
            assert not (p.data_dir / "modelyard.db").exists()  # state went to PostgreSQL
        finally:
            p.stop()
