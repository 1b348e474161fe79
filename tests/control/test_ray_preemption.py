"""A spot interruption notice acted on ahead of the loss (`node_provider = ray`), on
`ray.cluster_utils.Cluster`: the test plays the cloud, and gives its notice the way a cloud's
reaches Ray, through the GCS's drain API with the preemption reason and a deadline (Ray 2.60's
`GcsClient.drain_node`, `DRAIN_NODE_REASON_PREEMPTION`). The real-time replica on the noticed
spot node leaves routing at once (no new request goes to it), its requests in flight finish, its
replacement starts on on-demand capacity (asked of the autoscaler, which the test's `Cloud`
answers) and serves, and the old one is stopped by the controller, not lost with its node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.databases import services_required
from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy, wait_status
from tests.tiny_models import build_model
from tests.waiting import wait_until

try:
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2
except ImportError as exc:  # pragma: no cover - depends on the environment
    if services_required():
        raise
    pytest.skip(
        f"ray cannot be imported ({exc}); pip install 'modelyard[ray]'", allow_module_level=True
    )

from modelyard.control.backends.ray_nodes import class_resource
from modelyard.control.node_provider import NodeClass
from tests.control.test_ray_backend import node_of, replicas
from tests.control.test_ray_nodes import Cloud, add, alive, class_of, elastic_env, requested

pytestmark = pytest.mark.timeout(600)

ON_DEMAND, SPOT = NodeClass.ON_DEMAND, NodeClass.SPOT
NOTICE_S = 600  # the notice's deadline: far beyond the test, so only acting on it moves the replica


def spot_notice(node_id: str, seconds: int) -> None:
    """What a cloud's spot interruption notice becomes in Ray: a preemption drain with a
    deadline (as `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` sends it)."""
    gcs: Any = ray._private.worker.global_worker.gcs_client
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = time.time_ns() // 1_000_000 + seconds * 1000
    accepted, why = gcs.drain_node(node_id, reason, "spot interruption notice", deadline_ms)
    assert accepted, why


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
def platform(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PlatformProcess]:
    env = {
        **elastic_env(cluster.address),
        # The old replica's worker is paused while the notice is read (see the test): failed
        # probes meanwhile must not have it replaced as broken.
        "MODELYARD_REPLICA_HEALTH_FAILURES": "1000",
    }
    p = PlatformProcess(tmp_path_factory.mktemp("ray-preempt"), env).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """The platform's log and its notes of each replica (where it ran, how it ended)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed and "platform" in request.fixturenames:
        p: PlatformProcess = request.getfixturevalue("platform")
        print(p.output())
        for note in sorted((p.data_dir / "logs").glob("*.log")):
            print(f"--- {note.name}\n{note.read_text()}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def test_a_spot_notice_moves_the_replica_before_its_node_goes(
    cluster: Cluster, platform: PlatformProcess, tiny_dir: Path
) -> None:
    on_demand = add(cluster, ON_DEMAND, 1)
    spot = add(cluster, SPOT, 2)
    api = platform.api()
    cloud = Cloud(cluster)
    cloud.classes = {ON_DEMAND}  # a replacement must not go to spot: it has none to give
    paused = False
    try:
        hardware = {"min_replicas": 1, "max_replicas": 1}
        deploy(api, "rt1", str(tiny_dir), public=True, hardware=hardware)  # on-demand full
        rt = deploy(api, "rt", str(tiny_dir), public=True, hardware=hardware)  # overflows
        (old,) = replicas(api, rt)
        assert node_of(old["id"]) == spot.node_id

        client = platform.openai(
            create_key(api, create_tenant(api, f"pre-{time.time_ns()}"))["key"]
        )
        results: list[str | None] = []  # each stream's finish reason

        def stream() -> None:  # a long answer, read to its end
            chunks = client.chat.completions.create(
                model="rt", messages=[{"role": "user", "content": "go"}], max_tokens=200,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            finish = None
            for chunk in chunks:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
            results.append(finish)

        def view(replica_id: str) -> dict[str, Any] | None:
            return next((r for r in replicas(api, rt) if r["id"] == replica_id), None)

        in_flight = [threading.Thread(target=stream) for _ in range(4)]
        for t in in_flight:
            t.start()
        wait_until(lambda: (view(old["id"]) or {}).get("outstanding", 0) > 0, "in flight", 60, 0.05)
        # The tiny model answers in well under the provider's tick: its worker is paused (its
        # requests held in flight) until the controller has taken it out of routing.
        os.kill(old["pid"], signal.SIGSTOP)
        paused = True
        spot_notice(spot.node_id, NOTICE_S)

        seen: list[dict[str, Any]] = []  # the old replica, each look from the notice on

        def looked(predicate: Any) -> Any:
            def look() -> bool:
                now = view(old["id"])
                if now is not None:
                    seen.append(now)
                return bool(predicate())

            return look

        def draining() -> bool:
            return bool(seen) and seen[-1]["state"] == "draining"

        wait_until(looked(draining), "the old replica out of routing", 60, 0.05)
        assert "preempted" in (seen[-1]["error"] or ""), seen[-1]
        assert seen[-1]["outstanding"] > 0, "nothing was in flight when it left routing"
        os.kill(old["pid"], signal.SIGCONT)
        paused = False

        # Its replacement is asked for on on-demand capacity (rt1's room and its own; the old
        # replica's spot room left the standing request at the notice).
        key = class_resource(ON_DEMAND)
        asked = lambda: sum(key in b for b in requested()) == 2  # noqa: E731
        wait_until(asked, "an on-demand node asked for the replacement", 60, 0.1)

        def old_gone() -> bool:
            now = view(old["id"])
            return (now is None or now["state"] == "stopped") and not alive(spot.node_id)

        # Drained and idle once the old replica stopped, the spot node's raylet leaves by itself
        # (Ray's doing): `cluster_utils` is told before the cloud adds a node.
        wait_until(looked(old_gone), "the old replica stopped and its node gone", 120, 0.1)
        cluster.remove_node(spot)

        def moved() -> bool:
            ready = [r for r in replicas(api, rt) if r["state"] == "ready"]
            return len(ready) == 1 and ready[0]["id"] != old["id"]

        wait_until(cloud.until(moved), "the replacement to serve", 300, 0.2)
        (new,) = [r for r in replicas(api, rt) if r["state"] == "ready"]
        assert class_of(node_of(new["id"])) is ON_DEMAND
        for t in in_flight:
            t.join(timeout=120)
        # Every request in flight on the old replica at the notice ran to its max_tokens.
        assert results == ["length"] * 4, results
        # From the notice on, the old replica took no new request: what it held only went down,
        # and it left by the controller's stop (never lost with its node).
        first = next(i for i, s in enumerate(seen) if s["state"] == "draining")
        tail = seen[first:]
        assert all(s["state"] in ("draining", "stopped") for s in tail), tail
        held = [s["outstanding"] for s in tail if s["state"] == "draining"]
        assert held == sorted(held, reverse=True), held
        reply = client.chat.completions.create(
            model="rt", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None

        assert f"replica {old['id']} lost" not in platform.output()
        assert wait_status(api, rt, "ready")["status"] == "ready"
    finally:
        if paused:
            os.kill(old["pid"], signal.SIGCONT)
        for node in [on_demand, spot, *(n for _, n in cloud.added)]:
            with contextlib.suppress(Exception):
                cluster.remove_node(node)
