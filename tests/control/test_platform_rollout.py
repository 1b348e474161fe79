"""Versions on a live endpoint: a rollout to a version that fails to load falls back to the last
good version (reported `degraded`) without a failed request; a good version rolls out and the
old replicas drain. A rollout is a canary at 100 % (promoted once it serves): a manual rollback
takes it back exactly as it takes a canary back."""

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
from tests.waiting import wait_until

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
        # It is a rollback like a canary's (one path): kept as the endpoint's last rollback.
        last = degraded["last_rollback"]
        assert last["by"] == "system" and "failed to load" in last["reason"]
        assert (last["from_model_artifact"], last["to_version_id"]) == ("roll:2", v1_id)

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


@pytest.fixture()
def patient(tmp_path: Path, cache_dir: Path) -> Iterator[PlatformProcess]:
    """A platform that never gives up on a new version by itself: what a rollout and a canary
    come to is decided by the caller's rollback alone."""
    env = {
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MODELYARD_ROLLOUT_ATTEMPTS": "1000",
    }
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        yield p
    finally:
        p.stop()
        print(p.output()[-8000:])  # shown when the test failed


def test_a_rollout_is_a_canary_at_100_percent_and_rolls_back_as_a_canary_does(
    patient: PlatformProcess, tmp_path: Path
) -> None:
    """While a rollout's version loads it is the endpoint's canary at 100 %, and
    `POST …/rollback` takes it back as it takes a canary back: the same record, the same
    audit event, the stable replica serving throughout."""
    v1 = build_model(tmp_path / "v1", "llama", seed=0)
    broken = tmp_path / "v2"
    shutil.copytree(v1, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the weights hold 2: the worker cannot load it
    (broken / "config.json").write_text(json.dumps(config))
    registry = RegistryClient(patient.url, patient.admin_key)
    for folder in (v1, broken):
        registry.push(folder, "one")
    api = patient.api()
    endpoint = deploy(api, "one", "one:1", hardware={"max_replicas": 2})
    body = api.get(f"/v1/endpoints/{endpoint}").json()
    v1_id, pid = body["version_id"], body["replicas"]["items"][0]["pid"]

    def fails_to_load() -> dict | None:
        view = api.get(f"/v1/endpoints/{endpoint}").json()
        canary = view["versions"]["canary"]
        return view if canary and canary["status"] == "failing" else None

    records = []
    for change in ("rollout", "canary"):
        if change == "rollout":
            r = api.patch(f"/v1/endpoints/{endpoint}", json={"model_artifact": "one:2"})
            assert r.status_code == 202 and r.json()["status"] == "rolling_out", r.text
            v2_id = r.json()["version_id"]
        else:
            r = api.post(f"/v1/endpoints/{endpoint}/versions",
                         json={"model_artifact": "one:2", "weight": 10})  # fmt: skip
            assert r.status_code == 201, r.text
        view = wait_until(fails_to_load, f"the {change}'s version to fail")
        canary = view["versions"]["canary"]
        assert canary["version_id"] == v2_id
        assert canary["weight"] == (100 if change == "rollout" else 10)
        if change == "rollout":  # the view names where it goes and what serves meanwhile
            assert view["status"] == "rolling_out" and view["version_id"] == v2_id
            assert view["rollout_from"] == v1_id and view["traffic"] == {}
        r = api.post(f"/v1/endpoints/{endpoint}/rollback", json={"reason": f"no {change}"})
        assert r.status_code == 200, r.text
        assert r.json()["weights"] == {v1_id: 100}
        records.append(r.json()["rollback"])
        view = wait_status(api, endpoint, "ready")
        assert view["version_id"] == v1_id and view["rollout_from"] is None
        assert view["versions"]["canary"] is None
        assert [i["pid"] for i in view["replicas"]["items"] if i["state"] == "ready"] == [pid]

    same = {"from_version_id": v2_id, "from_model_artifact": "one:2",
            "to_version_id": v1_id, "to_model_artifact": "one:1"}  # fmt: skip
    for record, change in zip(records, ("rollout", "canary"), strict=True):
        assert {k: record[k] for k in same} == same and record["reason"] == f"no {change}"
    assert records[0]["by"] == records[1]["by"] != "system"
    events = api.get("/v1/audit", params={"target_id": endpoint}).json()["data"]
    rollbacks = [e for e in events if e["action"] == "endpoint.rollback"]
    assert [e["after"]["last_rollback"]["reason"] for e in rollbacks] == ["no canary", "no rollout"]
    assert [e["action"] for e in reversed(events)] == [
        "endpoint.deploy", "endpoint.rollout", "endpoint.rollback",
        "endpoint.version_add", "endpoint.rollback",
    ]  # fmt: skip
