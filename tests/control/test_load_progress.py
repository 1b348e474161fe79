"""A starting replica's load progress (`replicas.items[].load_progress` of the endpoint view):
the progress file the worker writes, the control plane's count of the bytes it copies into the
node cache, and a real deploy from the registry watched until it serves.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelyard.control.load_progress import CountingStore, copy_meter, replica_load_progress
from modelyard.control.node_cache import NodeCache
from modelyard.control.registry import ResolvedVersion
from modelyard.control.state import Replica
from modelyard.core.load_progress import (
    LOAD_PROGRESS_ENV,
    LoadPhase,
    copying,
    progress_file_beside,
    read_progress,
    report,
    write_progress,
)
from modelyard.core.status import ReplicaState
from modelyard.protocol.management import ReplicaLoadProgress
from modelyard.registry_client import RegistryClient
from modelyard.store.artifacts import LocalArtifactStore
from modelyard.worker.load_estimate import reporting_load, weight_bytes
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env

PHASES = ["copying", "loading", "warming", "ready"]

# ----- the parts -------------------------------------------------------------------------------


def test_progress_file_round_trip_and_garbage(tmp_path: Path) -> None:
    path = progress_file_beside(tmp_path / "rep-1.log")
    assert path == tmp_path / "rep-1.progress.json"
    assert read_progress(path) is None  # nothing yet
    write_progress(path, LoadPhase.LOADING, 0.25)
    got = read_progress(path)
    assert got is not None and got.phase is LoadPhase.LOADING and got.fraction == 0.25
    write_progress(path, LoadPhase.WARMING, 7.0)  # clamped
    assert read_progress(path).fraction == 1.0  # type: ignore[union-attr]
    for garbage in ("", "{", '{"phase": "dancing", "fraction": 0}', '{"phase": "ready"}', "[]"):
        path.write_text(garbage)
        assert read_progress(path) is None, garbage


def test_report_writes_only_where_the_platform_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LOAD_PROGRESS_ENV, raising=False)
    report(LoadPhase.LOADING, 0.5)  # a worker run by hand: nothing, no error
    assert list(tmp_path.iterdir()) == []
    target = tmp_path / "r.progress.json"
    monkeypatch.setenv(LOAD_PROGRESS_ENV, str(target))
    report(LoadPhase.LOADING, 0.5)
    assert json.loads(target.read_text())["phase"] == "loading"
    monkeypatch.setenv(LOAD_PROGRESS_ENV, str(tmp_path / "missing-dir" / "x.json"))
    report(LoadPhase.LOADING, 0.5)  # unwritable: never fails the load


def test_reporting_load_goes_loading_then_warming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    target = tmp_path / "r.progress.json"
    monkeypatch.setenv(LOAD_PROGRESS_ENV, str(target))
    assert weight_bytes(tiny_llama) > 0
    with reporting_load(tiny_llama):
        seen = read_progress(target)
        assert seen is not None and seen.phase is LoadPhase.LOADING and seen.fraction < 1.0
    after = read_progress(target)
    assert after is not None and after.phase is LoadPhase.WARMING


def test_a_gguf_is_measured_by_its_cached_conversion(tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"g" * 100)
    assert weight_bytes(gguf, tmp_path / "cache") == 100  # not converted yet: the file
    folder = tmp_path / "cache" / "converted" / "abc"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 500)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
    assert weight_bytes(gguf, tmp_path / "cache") == 500


class _State:
    """Stands in for an `EndpointState`: the meters are keyed by the object only."""


def test_node_cache_copy_is_counted_as_copying(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    files = {}
    for name, size in (("a.bin", 3 * 2**20), ("b.json", 1000)):
        src = tmp_path / name
        src.write_bytes(b"x" * size)
        files[name] = store.put_file(src).sha256
    total = 3 * 2**20 + 1000
    version = ResolvedVersion("ver-1", "m", 1, "hf", files, total)
    cache = NodeCache(tmp_path / "node", CountingStore(store), 2**30)
    state, replica = _State(), Replica("rep-1")
    assert replica_load_progress(state, replica) is None  # type: ignore[arg-type]

    seen: list[dict[str, Any]] = []

    async def fetch() -> None:
        with copy_meter(state, total):  # type: ignore[arg-type]
            await asyncio.to_thread(cache.fetch, version, set())
            seen.append(replica_load_progress(state, replica))  # type: ignore[arg-type]

    asyncio.run(fetch())
    assert seen == [
        {"phase": "copying", "fraction": 1.0, "bytes_done": total, "bytes_total": total}
    ]
    ReplicaLoadProgress(**seen[0])
    # The meter is gone with the fetch; a hit reads nothing more.
    assert replica_load_progress(state, replica) is None  # type: ignore[arg-type]
    assert cache.fetch(version, set()).hit


def test_view_of_each_replica_state(tmp_path: Path) -> None:
    from modelyard.control.backends.base import ReplicaHandle, ReplicaSpec

    state = _State()
    replica = Replica("rep-2")
    replica.handle = ReplicaHandle(
        ReplicaSpec("rep-2", "ep", None, "m"), "http://x", 1, tmp_path / "rep-2.log"
    )
    # Started, nothing reported yet: loading from 0.
    assert replica_load_progress(state, replica) == {"phase": "loading", "fraction": 0.0}  # type: ignore[arg-type]
    write_progress(tmp_path / "rep-2.progress.json", LoadPhase.WARMING, 0.0)
    assert replica_load_progress(state, replica)["phase"] == "warming"  # type: ignore[arg-type,index]
    for ready in (ReplicaState.READY, ReplicaState.UNHEALTHY, ReplicaState.DRAINING):
        replica.state = ready
        assert replica_load_progress(state, replica) == {"phase": "ready", "fraction": 1.0}  # type: ignore[arg-type]
    replica.state = ReplicaState.FAILED
    assert replica_load_progress(state, replica) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"phase": "dancing", "fraction": 0.5},
        {"phase": "loading", "fraction": 1.5},
        {"phase": "loading", "fraction": -0.1},
        {"phase": "copying", "fraction": 0.1, "bytes_done": -1},
        {"phase": "ready", "fraction": 1.0, "eta": 3},
    ],
)
def test_the_field_refuses_what_it_must_not_show(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ReplicaLoadProgress(**bad)


def test_copying_view() -> None:
    assert copying(0, 0).view()["fraction"] == 1.0
    assert copying(5, 10).view() == {
        "phase": "copying",
        "fraction": 0.5,
        "bytes_done": 5,
        "bytes_total": 10,
    }


# ----- a real deploy ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("progress-platform"), tiny_models_env(models_dir))
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_a_deploy_from_the_registry_reports_its_phases_until_ready(
    platform: PlatformProcess, models_dir: Path
) -> None:
    pushed = RegistryClient(platform.url, platform.admin_key).push(models_dir / "tiny", "tiny")
    with platform.api() as api:
        endpoint_id = deploy(api, "tiny", pushed["ref"], wait=False)
        observed: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            view = api.get(f"/v1/endpoints/{endpoint_id}").json()
            for item in view["replicas"]["items"]:
                progress = item["load_progress"]
                if progress is not None and (not observed or observed[-1] != progress):
                    observed.append(progress)
            if view["status"] == "ready":
                break
            assert view["status"] != "failed", view
            time.sleep(0.05)
    print("observed load progress:", observed)
    for progress in observed:
        ReplicaLoadProgress(**progress)  # every value the API showed is a valid field
    assert observed[-1] == {"phase": "ready", "fraction": 1.0}
    # Phases only move forward; and the worker's start (a Python process importing torch)
    # is seen before it serves.
    order = [PHASES.index(p["phase"]) for p in observed]
    assert order == sorted(order), observed
    assert len(observed) > 1, observed
