"""Versions on a live endpoint: a rollout to a version that fails to load falls back to the last
good version (reported `degraded`) without a failed request; a good version rolls out and the
old replicas drain."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, deploy, wait_status
from tests.tiny_models import build_model

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def platform(tmp_path: Path, cache_dir: Path) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_ROLLOUT_ATTEMPTS": "2",
    }
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        yield p
    finally:
        p.stop()


def test_a_broken_version_falls_back_and_a_good_one_rolls_out(
    platform: PlatformProcess, tmp_path: Path
) -> None:
    v1 = build_model(tmp_path / "v1", "llama", seed=0)
    broken = tmp_path / "v2"
    shutil.copytree(v1, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the weights hold 2: the worker cannot load it
    (broken / "config.json").write_text(json.dumps(config))
    v3 = build_model(tmp_path / "v3", "llama", seed=1)
    registry = RegistryClient(platform.url, platform.admin_key)
    for folder in (v1, broken, v3):
        registry.push(folder, "roll")
    api = platform.api()
    endpoint = deploy(api, "roll", "roll:1", public=True)
    body = api.get(f"/v1/endpoints/{endpoint}").json()
    v1_id, first_pid = body["version_id"], body["replicas"]["items"][0]["pid"]
    assert body["good_version_id"] == v1_id

    client = platform.openai()
    failures: list[Exception] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                client.chat.completions.create(model="roll", messages=HI, max_tokens=4)
            except Exception as exc:  # every request must succeed during the rollouts
                failures.append(exc)
            time.sleep(0.1)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        r = api.patch(f"/v1/endpoints/{endpoint}", json={"model_artifact": "roll:2"})
        assert r.status_code == 202 and r.json()["status"] == "rolling_out"
        degraded = wait_status(api, endpoint, "degraded", timeout=120)
        assert "last good version roll:1" in degraded["status_message"]
        assert degraded["version_id"] == v1_id and degraded["model_artifact"] == "roll:1"
        assert degraded["replicas"]["items"][0]["pid"] == first_pid  # it never stopped serving
        # The fallback is in the audit log as the platform's doing, with its reason.
        events = api.get("/v1/audit", params={"target_id": endpoint}).json()["data"]
        fallback = next(e for e in events if e["action"] == "endpoint.rollout_fallback")
        assert fallback["actor_key_id"] == "system"
        assert "failed to load" in fallback["after"]["reason"]
        assert fallback["before"]["model_artifact"] == "roll:2"
        assert fallback["after"]["model_artifact"] == "roll:1"

        r = api.patch(f"/v1/endpoints/{endpoint}", json={"model_artifact": "roll:3"})
        assert r.status_code == 202
        ready = wait_status(api, endpoint, "ready", timeout=120)
        assert ready["version_id"] != v1_id and ready["good_version_id"] == ready["version_id"]
        deadline = time.monotonic() + 30
        while True:  # the old version's replica drains away
            items = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
            if [i["version_id"] for i in items] == [ready["version_id"]]:
                break
            assert time.monotonic() < deadline, items
            time.sleep(0.2)
    finally:
        stop.set()
        worker.join()
    assert failures == []
