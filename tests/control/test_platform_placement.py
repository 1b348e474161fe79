"""Placement on declared devices (`MODELYARD_DEVICES=cpu:3x1GiB`): two small models share one
device, a `gpu_count: 2` model takes two (as tensor-parallel ranks) and answers, and a model
that fits nowhere is `unschedulable` with the reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.platform_harness import PlatformProcess, deploy, platform_running, wait_status
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_DEVICES": "cpu:3x1GiB",
        "MODELYARD_REPLICA_OVERHEAD_BYTES": "64MiB",
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


def devices_of(platform: PlatformProcess, endpoint: str) -> list[str]:
    (replica,) = platform.api().get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    return list(replica["devices"])


def test_small_models_share_a_device_and_a_two_device_model_takes_two(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    a = deploy(api, "small-a", str(tiny_dir), public=True)
    b = deploy(api, "small-b", str(tiny_dir), public=True)
    assert devices_of(platform, a) == devices_of(platform, b) and len(devices_of(platform, a)) == 1
    big = deploy(api, "two-device", str(tiny_dir), public=True,
                 hardware={"gpu_count": 2, "min_replicas": 1, "max_replicas": 1})  # fmt: skip
    two = devices_of(platform, big)
    assert len(two) == len(set(two)) == 2
    client = platform.openai()
    hi = [{"role": "user", "content": "hi"}]
    one = client.chat.completions.create(model="small-a", messages=hi, max_tokens=8, temperature=0)
    tp = client.chat.completions.create(
        model="two-device", messages=hi, max_tokens=8, temperature=0
    )
    assert tp.choices[0].message.content == one.choices[0].message.content  # same weights
    usage = api.get("/v1/devices").json()["data"]
    used = {d["name"]: d["used_bytes"] for d in usage}
    # Best fit packs everything onto two devices and leaves the third whole for a big model.
    assert sorted(v > 0 for v in used.values()) == [False, True, True]


def test_a_model_that_fits_nowhere_is_unschedulable(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    r = api.post("/v1/models/deploy", json={
        "model_name": "too-big", "model_artifact": str(tiny_dir), "public": True,
        "engine": {"kv_cache_memory": "2GiB"},
    })  # fmt: skip
    assert r.status_code == 202
    body = wait_status(api, r.json()["endpoint_id"], "unschedulable", timeout=30)
    assert "GiB" in body["status_message"]
