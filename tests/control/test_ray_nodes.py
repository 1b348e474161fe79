"""Elastic nodes on Ray (`node_provider = ray`) on `ray.cluster_utils.Cluster`: nodes carry a
`modelyard.node_class.*` resource; a replica no node of its class has room for is asked of Ray's
autoscaler (`request_resources`), and a node that held nothing past `node_idle_release_s` is
drained. The cluster has no autoscaler, so the test plays the cloud (`Cloud`): it reads the
standing request the provider left for the autoscaler and adds a node of each class asked for
beyond what its nodes have; everything on the platform's side is the real thing.

A node is requested when a replica finds no room, and released once empty past the delay. A
spot node removed under load (a batch running on its replica, a real-time replica that
overflowed to it): the batch completes with every item exactly once, and the real-time replica
is replaced on on-demand capacity. The cluster starts once for the module.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import ReplicaSpec
from modelyard.control.backends.ray import RayBackend
from modelyard.control.backends.ray_nodes import RayNodeProvider, class_resource
from modelyard.control.node_provider import NodeClass
from tests.databases import services_required
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    read_jsonl,
    wait_status,
    wait_usage,
)
from tests.tiny_models import build_model
from tests.waiting import async_wait_until, wait_until

try:
    import ray
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.cluster_utils import Cluster
    from ray.experimental.internal_kv import _internal_kv_get
except ImportError as exc:  # pragma: no cover - depends on the environment
    if services_required():
        raise
    pytest.skip(
        f"ray cannot be imported ({exc}); pip install 'modelyard[ray]'", allow_module_level=True
    )

from tests.control.test_ray_backend import node_of, replicas

pytestmark = pytest.mark.timeout(600)

ON_DEMAND, SPOT = NodeClass.ON_DEMAND, NodeClass.SPOT


def add(cluster: Cluster, node_class: NodeClass, cpus: int) -> Any:
    node = cluster.add_node(num_cpus=cpus, resources={class_resource(node_class): 1000})
    cluster.wait_for_nodes()
    return node


def requested() -> list[dict[str, float]]:
    """The standing request to Ray's autoscaler (what `request_resources` last asked for)."""
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return list(json.loads(raw)) if raw else []


def class_of(node_id: str) -> NodeClass | None:
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return next((c for c in NodeClass if class_resource(c) in n["Resources"]), None)
    return None


def alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


class Cloud:
    """The cloud behind Ray's autoscaler: a node of a class is started when the standing
    request asks for more CPUs of that class than its live nodes have (as an autoscaler bin-packs
    the request onto node types), for the classes it has capacity of (`classes`). Stepped from
    the test's main thread (`cluster_utils` starts nodes only there), inside its waits."""

    def __init__(self, cluster: Cluster, cpus: int = 2) -> None:
        self.cluster, self.cpus = cluster, cpus
        self.classes = set(NodeClass)
        self.added: list[tuple[NodeClass, Any]] = []

    def until(self, predicate: Callable[[], bool]) -> Callable[[], bool]:
        """`predicate`, with the cloud answering the autoscaler's request before each look."""

        def stepped() -> bool:
            self.step()
            return predicate()

        return stepped

    def step(self) -> None:
        asks = requested()
        live = [n for n in ray.nodes() if n["Alive"]]
        for node_class in sorted(self.classes):
            key = class_resource(node_class)
            want = sum(b.get("CPU", 0.0) for b in asks if key in b)
            have = sum(n["Resources"].get("CPU", 0.0) for n in live if key in n["Resources"])
            if want > have:
                self.added.append((node_class, add(self.cluster, node_class, self.cpus)))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def test_a_node_is_requested_when_placement_fails_and_released_when_empty(
    cluster: Cluster, tmp_path: Path
) -> None:
    """One on-demand node with one CPU: the first replica takes it; the second finds no room,
    so the provider asks the autoscaler for both replicas' room (the request is the cluster's
    whole size), the cloud adds a node and the replica starts there. Stopped, its node is empty;
    past the delay it is drained (and leaves Ray) while the node that holds a replica stays."""
    first_node = add(cluster, ON_DEMAND, 1)
    settings = PlatformSettings(
        data_dir=tmp_path, backend="ray", node_provider="ray", node_idle_release_s=1.0,
        replica_start_timeout_s=120,
    )  # fmt: skip

    def spec(replica_id: str) -> ReplicaSpec:  # an encoder host: no model to load
        return ReplicaSpec(replica_id, "e", None, "m", command="encoders")

    async def run() -> None:
        backend = RayBackend(settings, tmp_path / "logs")
        provider = backend.nodes
        assert isinstance(provider, RayNodeProvider)
        try:
            a = await backend.start(spec("el-a"))
            assert node_of("el-a") == first_node.node_id
            assert requested() == [{"CPU": 1.0, class_resource(ON_DEMAND): 0.001}]
            starting = asyncio.create_task(backend.start(spec("el-b")))
            await async_wait_until(lambda: len(requested()) == 2, "a request for a node", 60)
            assert [t.replica_id for t in provider.waiting()] == ["el-b"]
            cloud = Cloud(cluster, cpus=1)
            await async_wait_until(
                cloud.until(starting.done), "the replica on a new node", 120, 0.2
            )
            b = starting.result()
            (node_class, new), *more = cloud.added
            assert (node_class, more) == (ON_DEMAND, [])
            assert node_of("el-b") == new.node_id and provider.waiting() == []
            await backend.stop(b)
            assert len(requested()) == 1  # the autoscaler need not keep its room
            await async_wait_until(lambda: not alive(new.node_id), "the empty node to go", 60)
            assert new.node_id in provider.released
            assert first_node.node_id not in provider.released and alive(first_node.node_id)
            await backend.stop(a)
        finally:
            await backend.stop_all()
        cluster.remove_node(new)
        cluster.remove_node(first_node)

    asyncio.run(run())


def elastic_env(address: str) -> dict[str, str]:
    """A platform on the Ray backend with the elastic provider, spot overflow allowed, no idle
    release during a test, a small tiny-model engine and fast health checks."""
    return {
        "MODELYARD_BACKEND": "ray",
        "MODELYARD_RAY_ADDRESS": address,
        "MODELYARD_NODE_PROVIDER": "ray",
        "MODELYARD_SPOT_POLICY": "overflow",
        "MODELYARD_NODE_IDLE_RELEASE_S": "3600",
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }


@pytest.fixture(scope="module")
def platform(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlatformProcess]:
    env = {
        **elastic_env(cluster.address),
        # An item in flight on the lost replica is retried until its replacement serves.
        "MODELYARD_BATCH_ITEM_ATTEMPTS": "20",
    }
    p = PlatformProcess(tmp_path_factory.mktemp("ray-nodes"), env).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def platform_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """The platform's log (its control plane's, Ray's replicas' notes) after a test failed."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed and "platform" in request.fixturenames:
        print(request.getfixturevalue("platform").output())


def test_a_spot_node_removed_under_load_loses_no_batch_item_and_its_real_time_replica_moves(
    cluster: Cluster, platform: PlatformProcess, tiny_dir: Path
) -> None:
    """Spot reclaimed without notice while a batch runs on its replica and a real-time replica
    (policy `overflow`) runs beside it. The cloud has on-demand capacity first: the real-time
    replica's replacement asks for (and gets) an on-demand node, never spot; then spot comes
    back for the batch replica. The batch completes, every item exactly once, billed once."""
    on_demand = add(cluster, ON_DEMAND, 1)
    spot = add(cluster, SPOT, 2)
    api = platform.api()
    cloud = Cloud(cluster)
    cloud.classes = {ON_DEMAND}
    try:
        # The on-demand node's one CPU taken, a second real-time endpoint overflows to spot; the
        # batch endpoint goes to spot first.
        hardware = {"min_replicas": 1, "max_replicas": 1}
        deploy(api, "rt1", str(tiny_dir), public=True, hardware=hardware)
        rt = deploy(api, "rt", str(tiny_dir), public=True, hardware=hardware)
        bt = deploy(api, "tiny", str(tiny_dir), public=True,
                    hardware={**hardware, "workload": "batch"})  # fmt: skip
        (rt_before,) = replicas(api, rt)
        (bt_before,) = replicas(api, bt)
        assert node_of(rt_before["id"]) == node_of(bt_before["id"]) == spot.node_id

        tenant = create_tenant(api, f"spot-{time.time_ns()}")
        client = platform.openai(create_key(api, tenant)["key"])
        n = 24
        lines = [batch_line(f"item-{i}", f"item {i}", 48, ignore_eos=True) for i in range(n)]
        upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        def under_load() -> bool:  # items done, and some in flight on the spot replica
            done = client.batches.retrieve(batch.id).request_counts
            busy = any(r["outstanding"] > 0 for r in replicas(api, bt))
            return done is not None and done.completed >= 2 and busy

        wait_until(under_load, "the batch running on the spot replica", 180, 0.1)
        cluster.remove_node(spot)  # reclaimed without notice

        def rt_moved() -> bool:
            now = [r for r in replicas(api, rt) if r["state"] == "ready"]
            return len(now) == 1 and now[0]["id"] != rt_before["id"]

        wait_until(cloud.until(rt_moved), "the real-time replica's replacement", 240, 0.5)
        (rt_after,) = [r for r in replicas(api, rt) if r["state"] == "ready"]
        assert class_of(node_of(rt_after["id"])) is ON_DEMAND
        cloud.classes.add(SPOT)  # spot capacity back: the batch replica may have it

        def ended() -> bool:
            return client.batches.retrieve(batch.id).status in {"completed", "failed"}

        wait_until(cloud.until(ended), "the batch to end", 400, 0.5)
        done = client.batches.retrieve(batch.id)
        out = read_jsonl(client, done.output_file_id)
        ids = [o["custom_id"] for o in out]
        assert done.status == "completed" and done.request_counts.failed == 0, done
        assert sorted(ids) == sorted(f"item-{i}" for i in range(n))  # every item, once
        rows = wait_usage(api, lambda r: len(r) >= n, tenant_id=tenant)
        assert len(rows) == len({r["request_id"] for r in rows}) == n  # billed once each
        assert ON_DEMAND in {c for c, _ in cloud.added}
        for name in (rt, bt):
            assert wait_status(api, name, "ready")["status"] == "ready"
    finally:
        for node in [on_demand, *(n for _, n in cloud.added)]:
            cluster.remove_node(node)
