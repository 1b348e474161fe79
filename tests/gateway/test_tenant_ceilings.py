"""Tenant-wide ceilings (issue 27, finding 6) through a real `modelyard serve`, once per platform
mode (SQLite with limits in memory; PostgreSQL with limits in Redis): a second key does not
double the tenant's max_rpm or max_tpm; a canary does not take an endpoint past its
max_replicas; the storage quota refuses the push that would pass it and deleting frees the
space (and the bytes); a 60 MB batch line is refused at upload."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.batch.validation import validate_file
from modelyard.registry_client import RegistryClient
from tests.control.test_versions import Load, wait_canary
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    deploy,
    platform_running,
    tiny_models_env,
)
from tests.tiny_models import build_model

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BLOB_RECLAIM_GRACE_S": "0",  # freed bytes go at once (a test observes it)
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> httpx.Client:
    return platform.api()


@pytest.fixture(scope="module")
def tiny(admin: httpx.Client, models_dir: Path) -> str:
    """A public endpoint every tenant can use."""
    return deploy(admin, "tiny", str(models_dir / "tiny"), public=True)


class Tenant:
    def __init__(self, platform: PlatformProcess, admin: httpx.Client, **settings: Any) -> None:
        r = admin.post("/v1/tenants", json={"name": f"t-{time.time_ns()}", **settings})
        assert r.status_code == 201, r.text
        self.id = str(r.json()["id"])
        self.admin_key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.api = platform.api(self.admin_key)


def ask(platform: PlatformProcess, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "messages": HI, "max_tokens": max_tokens, "ignore_eos": True}
    return platform.api(key).post("/v1/chat/completions", json=body)


# ----- RPM and TPM ----------------------------------------------------------------------------


def test_a_second_key_does_not_double_the_tenants_rpm(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    t = Tenant(platform, admin, max_rpm=2)
    one, two = (create_key(t.api, scopes=["inference"])["key"] for _ in range(2))
    assert ask(platform, one, 1).status_code == 200
    r = ask(platform, two, 1)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "0"  # the tenant's bucket, not the key's
    for key in (one, two):
        r = ask(platform, key, 1)  # each key has used at most one of its own two
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requests per minute: limit 2" in r.json()["error"]["message"]
    # A third key minted now is no way around it either.
    three = create_key(t.api, scopes=["inference"])["key"]
    assert ask(platform, three, 1).status_code == 429


def test_a_second_key_does_not_double_the_tenants_tpm(
    platform: PlatformProcess, admin: httpx.Client, tiny: str
) -> None:
    # One request reserves its upper bound (~150 tokens of prompt and template margins plus
    # max_tokens 200) of the tenant's 400 and uses ~230; the next, by another key, needs the
    # same bound again: the tenant's bucket (170 left, refilling 400 a minute) refuses it.
    t = Tenant(platform, admin, max_tpm=400)
    one, two = (create_key(t.api, scopes=["inference"])["key"] for _ in range(2))
    r = ask(platform, one, 200)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200
    r = ask(platform, two, 200)
    assert r.status_code == 429, r.text
    assert "tokens per minute: limit 400" in r.json()["error"]["message"]


# ----- replicas -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def versions(platform: PlatformProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    models = tmp_path_factory.mktemp("ceiling-models")
    registry = RegistryClient(platform.url, platform.admin_key)
    for seed in (0, 1):  # cap:1 and cap:2
        registry.push(build_model(models / f"v{seed + 1}", "llama", seed=seed), "cap")


def running(api: httpx.Client, endpoint: str) -> list[dict[str, Any]]:
    items = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    return [i for i in items if i["state"] in ("starting", "ready", "unhealthy", "draining")]


@pytest.mark.timeout(360)  # two versions' replicas start and stop: past 2 min on 2 vCPU
def test_a_canary_does_not_push_an_endpoint_past_max_replicas(
    platform: PlatformProcess, admin: httpx.Client, versions: None
) -> None:
    quick = {"metric": "concurrency", "target_value": 1, "stable_window_seconds": 2,
             "panic_window_seconds": 1, "scale_down_delay_seconds": 1}  # fmt: skip
    # max_replicas 1: the stable replica is all there may be, so no canary fits (it ran 3).
    single = deploy(admin, "cap-one", "cap:1", hardware={"max_replicas": 1})
    for replicas in (2, 1):
        body = {"model_artifact": "cap:2", "weight": 50, "replicas": replicas}
        r = admin.post(f"/v1/endpoints/{single}/versions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "above_max_replicas" and error["param"] == "replicas"
        assert "max_replicas=1" in error["message"]
    assert len(running(admin, single)) == 1

    # max_replicas 2: a canary of one beside the stable one; under load its own autoscaler
    # wants more, and gets none past the endpoint's two.
    endpoint = deploy(admin, "cap-two", "cap:1", hardware={"max_replicas": 2}, scaling=quick)
    r = admin.post(f"/v1/endpoints/{endpoint}/versions",
                   json={"model_artifact": "cap:2", "weight": 100,
                         "slo": {"min_samples": 1_000_000}})  # fmt: skip
    assert r.status_code == 201, r.text
    wait_canary(admin, endpoint, "serving")
    wanted, decisions, most = 0, set(), 0
    with Load(admin, "cap-two", threads=4, max_tokens=8, ignore_eos=True) as load:
        deadline = time.monotonic() + 90
        # Until the canary's autoscaler has wanted 2+ for three decisions in a row.
        while wanted < 3:
            view = admin.get(f"/v1/endpoints/{endpoint}").json()
            assert time.monotonic() < deadline, str(view["versions"])
            most = max(most, len(running(admin, endpoint)))
            assert most <= 2, running(admin, endpoint)
            canary = next(i for i in view["versions"]["items"] if i["role"] == "canary")
            decision = canary["autoscaling"] or {}
            numbers = re.findall(r"(?:wants|averages to) (\d+)", decision.get("reason", ""))
            if numbers and int(numbers[0]) >= 2 and decision["at"] not in decisions:
                decisions.add(decision["at"])
                wanted += 1
            time.sleep(0.2)
    assert load.failures == []
    assert len(running(admin, endpoint)) <= 2


# ----- storage --------------------------------------------------------------------------------


def upload(t: Tenant, data: bytes, purpose: str = "user_data") -> httpx.Response:
    return t.api.post("/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": purpose})


def test_the_storage_quota_refuses_past_it_and_deleting_frees_the_space(
    platform: PlatformProcess, admin: httpx.Client, tmp_path: Path
) -> None:
    model = build_model(tmp_path / "model", "llama", seed=7)
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    t = Tenant(platform, admin)
    # The platform admin sets the quota: the model and 100 kB more.
    quota = size + 100_000
    r = admin.patch(f"/v1/tenants/{t.id}", json={"max_storage_bytes": quota})
    assert r.status_code == 200 and r.json()["max_storage_bytes"] == quota, r.text

    RegistryClient(platform.url, t.admin_key).push(model, "mine")
    r = upload(t, os.urandom(150_000))
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and str(quota) in error["message"], error
    blob = os.urandom(150_000)
    digest = hashlib.sha256(blob).hexdigest()
    r = t.api.put(f"/v1/blobs/{digest}", content=blob)
    assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text

    # Deleting the model frees its space: the same upload now fits.
    manifest = t.api.get("/v1/registry/models/mine").json()
    # Its weights (a tokenizer may be another tenant's too, and stay).
    shas = {
        f["sha256"]
        for v in manifest["versions"]
        for path, f in v["files"].items()
        if path.endswith(".safetensors")
    }
    assert shas
    assert t.api.delete("/v1/registry/models/mine").status_code == 200
    r = upload(t, os.urandom(150_000))
    assert r.status_code == 200, r.text
    # And its bytes leave the store once no tenant holds them.
    blobs = platform.data_dir / "artifacts" / "blobs" / "sha256"
    deadline = time.monotonic() + 30
    while left := [s for s in shas if (blobs / s[:2] / s).exists()]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def test_deleting_a_file_frees_its_space_for_a_later_push(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin, max_storage_bytes=300_000)
    first = upload(t, os.urandom(200_000))
    assert first.status_code == 200, first.text
    blob = os.urandom(150_000)
    digest = hashlib.sha256(blob).hexdigest()
    r = t.api.put(f"/v1/blobs/{digest}", content=blob)
    assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
    assert t.api.delete(f"/v1/files/{first.json()['id']}").status_code == 200
    r = t.api.put(f"/v1/blobs/{digest}", content=blob)
    assert r.status_code == 201, r.text
    assert t.api.head(f"/v1/blobs/{digest}").status_code == 200


# ----- batch lines ----------------------------------------------------------------------------


def test_a_60_mb_batch_line_is_refused_at_upload(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin)
    small = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}\n'  # noqa: E501
    huge = small.replace(b'"hi"', b'"' + b"x" * 60_000_000 + b'"').replace(b'"a"', b'"b"')
    r = upload(t, small + huge, purpose="batch")
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["code"] == "line_too_large" and "line 2" in error["message"], error
    assert t.api.get("/v1/files").json()["data"] == []  # nothing was stored
    assert upload(t, small, purpose="batch").status_code == 200


def test_a_stored_file_is_read_one_bounded_line_at_a_time(tmp_path: Path) -> None:
    """A long line in a file stored before the bound becomes its own error record."""
    ok = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}\n'  # noqa: E501
    path = tmp_path / "in.jsonl"
    long = b'{"custom_id": "b", "x": "' + b"y" * 3_000_000 + b'"}\n'
    path.write_bytes(ok + long + ok.replace(b'"a"', b'"c"'))
    good, bad = validate_file(path, "/v1/completions", 1 << 20, 100 << 20)
    assert [g.custom_id for g in good] == ["a", "c"]
    assert [(b.line, b.code) for b in bad] == [(2, "line_too_large")]


def test_a_sweep_never_takes_bytes_a_push_just_wrote(tmp_path: Path) -> None:
    """An upload writes its bytes before it records its hold: bytes younger than the grace
    stay, however unheld they look; older ones go."""
    from modelyard.store.artifacts import LocalArtifactStore

    store = LocalArtifactStore(tmp_path / "artifacts")
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(4096))
    sha = store.put_file(source).sha256
    assert not store.delete_unless_fresh(sha, grace_s=60)  # just pushed: kept
    assert store.has(sha)
    old = time.time() - 120
    os.utime(store.path(sha), (old, old))
    assert store.delete_unless_fresh(sha, grace_s=60)
    assert not store.has(sha) and list(store.tmp.iterdir()) == []
    assert store.put_file(source).sha256 == sha and store.has(sha)  # pushed again later: fine
