"""Workers on Ray (`backend = ray`) on a cluster of two simulated nodes
(`ray.cluster_utils.Cluster`: a head without CPUs, so replicas go to the nodes). Two
`modelyard controller`s and two gateways on PostgreSQL and Redis: a deploy through one gateway
serves through the other; the leader SIGKILLed under traffic, its replicas (detached actors)
serve on and the standby adopts them. A detached replica nobody heartbeats exits and takes its
actor with it. A `modelyard serve` whose replicas are Ray actors: a crashed worker's actor is
removed when it is replaced; a deploy Ray has no room for is `unschedulable` at once, saying
why, and serves once room frees; a deploy serves chat from replicas on both nodes; removing
the node that holds one replica fails it: requests in flight on it are retried on the other and
succeed, and the endpoint manager starts its replacement on the surviving node.

The cluster starts once for the module (slow on two cores). Without `ray` the module is skipped
with the reason; with `CI` set it fails instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from modelyard.config import PlatformSettings
from modelyard.control.backends.base import ReplicaSpec, wait_healthy
from modelyard.control.backends.ray import (
    LOST_EXIT_CODE,
    NAMESPACE,
    RayBackend,
    actor_name,
    ray_request,
)
from modelyard.control.owner_heartbeat import OwnerHeartbeat
from tests.cluster_harness import RoleProcess, Traffic, chat, wait_leader
from tests.databases import fresh_postgres, fresh_redis, services_required
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env, wait_status
from tests.tiny_models import build_model
from tests.waiting import async_wait_until, wait_until

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError as exc:  # pragma: no cover - depends on the environment
    if services_required():
        raise
    pytest.skip(
        f"ray cannot be imported ({exc}); pip install 'modelyard[ray]'", allow_module_level=True
    )

pytestmark = pytest.mark.timeout(300)


def test_ray_resources_follow_placement() -> None:
    # A CPU replica asks for a core and its memory budget, a GPU one for its GPUs; a
    # tensor-parallel replica for one bundle per rank (a STRICT_PACK placement group).
    cpu = ReplicaSpec("r1", "e", None, "m", device_kind="cpu", device_bytes=2**30)
    assert ray_request(cpu).actor == {"num_cpus": 1, "num_gpus": 0, "memory": 2**30}
    assert ray_request(cpu).bundles == []
    gpu = ReplicaSpec("r2", "e", None, "m", device_kind="cuda", device_count=4, device_bytes=9)
    request = ray_request(gpu)
    assert request.actor == {"num_cpus": 1, "num_gpus": 1.0}
    assert request.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 4
    unplaced = ReplicaSpec("r3", "e", None, "m", command="encoders")
    assert ray_request(unplaced).actor == {"num_cpus": 1, "num_gpus": 0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def platform(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_BACKEND": "ray",
        "MODELYARD_RAY_ADDRESS": cluster.address,
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    p = PlatformProcess(tmp_path_factory.mktemp("ray-platform"), env).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def platform_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """The platform's log (its control plane's, Ray's replicas' notes) after a test of it
    failed; the cluster test prints its controllers' and gateways' logs itself."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed and "platform" in request.fixturenames:
        print(request.getfixturevalue("platform").output())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def replicas(api: httpx.Client, endpoint_id: str) -> list[dict[str, Any]]:
    return list(api.get(f"/v1/endpoints/{endpoint_id}").json()["replicas"]["items"])


def retries(platform: PlatformProcess) -> float:
    """The gateway's count of requests sent again to another replica."""
    text = platform.api().get("/metrics").text
    lines = [
        line for line in text.splitlines() if line.startswith("modelyard_gateway_upstream_retries")
    ]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if "_created" not in line)


def node_of(replica_id: str) -> str:
    """The Ray node a replica's actor runs on (asked of the actor itself)."""
    actor = ray.get_actor(actor_name(replica_id), namespace=NAMESPACE)
    where = ray.get(actor.where.remote(), timeout=30)
    assert where is not None, f"replica {replica_id}'s worker is not running"
    return str(where.node_id)


def test_a_tensor_parallel_replica_holds_one_node_and_a_successor_adopts_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Two ranks of a CPU replica: a STRICT_PACK group whose bundles are on one node. The
    # process it runs here is an encoder host (no model to load); what is checked is Ray's side.
    settings = PlatformSettings(data_dir=tmp_path, backend="ray", replica_start_timeout_s=60)
    spec = ReplicaSpec("tp1", "e", None, "m", command="encoders", device_count=2,
                       device_bytes=64 * 2**20)  # fmt: skip

    async def run() -> None:
        first = RayBackend(settings, tmp_path / "logs1", detached=True)
        handle = await first.start(spec)
        assert first.alive(handle) and handle.url.startswith("http://")
        group = ray.util.get_placement_group(actor_name("tp1"))
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert len(set(table["bundles_to_node_id"].values())) == 1
        await first.stop_all()  # detached: the replica outlives its controller ...
        successor = RayBackend(settings, tmp_path / "logs2", detached=True)
        adopted = await successor.adopt(spec, handle.url, handle.pid)  # ... and is adopted
        assert successor.alive(adopted) and node_of("tp1") == table["bundles_to_node_id"][0]
        await successor.stop(adopted)
        with pytest.raises(ValueError):
            ray.get_actor(actor_name("tp1"), namespace=NAMESPACE)
        gone = await successor.adopt(spec, handle.url, handle.pid)
        assert not successor.alive(gone) and successor.exit_status(gone) == LOST_EXIT_CODE

    asyncio.run(run())


def test_two_controllers_and_two_gateways_on_ray_survive_the_leaders_death(
    cluster: Cluster, models_dir: Path, tmp_path: Path
) -> None:
    """Cluster mode on Ray: two `modelyard controller`s and two `modelyard gateway`s on
    PostgreSQL and Redis, replicas as detached Ray actors on the two nodes. A deploy through
    gateway 1 serves through gateway 2; the leader SIGKILLed under traffic on both gateways:
    the standby leads within 15 s, no request fails, the same actors (same worker processes)
    serve on under the new leader, and a deploy after the takeover serves."""
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": "3",
            "MODELYARD_ROUTING_REFRESH_S": "1",
            "MODELYARD_BACKEND": "ray",
            "MODELYARD_RAY_ADDRESS": cluster.address,
        }
        control = tmp_path / "control"  # the controllers share one (the admin key)
        controllers = [RoleProcess("controller", control, env) for _ in "ab"]
        gateways = [RoleProcess("gateway", tmp_path / f"gateway{i}", env) for i in (1, 2)]
        try:
            controllers[0].start()
            leader = wait_leader(redis_url, controllers)
            for role in (controllers[1], *gateways):
                role.launch()
            for role in (controllers[1], *gateways):
                role.wait_up()
            standby = next(c for c in controllers if c is not leader)
            headers = {"authorization": f"Bearer {(control / 'admin_key').read_text().strip()}"}

            def connect() -> list[httpx.Client]:
                return [
                    httpx.Client(base_url=g.url, headers=headers, timeout=60.0) for g in gateways
                ]

            g1, g2 = connect()
            ep = deploy(g1, "tiny", str(models_dir / "tiny"), public=True,
                        hardware={"min_replicas": 2, "max_replicas": 2})  # fmt: skip
            ready_at = time.monotonic()
            while (r := chat(g2)).status_code != 200:
                assert time.monotonic() - ready_at < 2.0, f"{r.status_code} {r.text}"
                time.sleep(0.05)
            before = {(r["id"], r["pid"]) for r in replicas(g1, ep)}
            assert len({node_of(replica_id) for replica_id, _ in before}) == 2  # one per node
            with Traffic(connect) as traffic:
                traffic.wait_ok(5)
                leader.kill()
                killed_at = time.monotonic()
                assert wait_leader(redis_url, controllers) is standby
                took = time.monotonic() - killed_at
                traffic.wait_ok(10)
            print(f"standby led {took:.1f}s after the SIGKILL; {len(traffic.ok)} answered")
            assert took < 15.0, took
            assert traffic.failed == [], traffic.failed[:5]
            # Adopted, not restarted: the same actors, the same worker processes. The adoption
            # (joining Ray, finding the actors) runs off the new leader's loop, which answers
            # meanwhile: its listing shows them once adopted.
            wait_until(
                lambda: {(r["id"], r["pid"]) for r in replicas(g2, ep)} == before,
                "the same replicas, adopted by the new leader",
            )
            deploy(g2, "tiny2", str(models_dir / "tiny"))
            assert chat(g1, "tiny2").status_code == 200
        except BaseException:
            for role in (*controllers, *gateways):  # every process's log, on any failure
                print(f"----- {role.role} on :{role.port} -----\n{role.output()}")
            raise
        finally:
            for role in (*gateways, *controllers):
                role.kill(signal.SIGTERM)
            # Detached actors outlive their controllers by design: the module's next test needs
            # the nodes' CPUs back.
            for named in ray.util.list_named_actors(all_namespaces=True):
                if named["namespace"] == NAMESPACE:
                    ray.kill(ray.get_actor(named["name"], namespace=NAMESPACE))


@pytest.fixture
def platform_logs(request: pytest.FixtureRequest, platform: PlatformProcess) -> Iterator[None]:
    """The platform's log printed when the test failed."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(platform.output())


def test_a_replica_nobody_heartbeats_leaves_with_its_actor(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A detached replica (the controller role's) runs on while its owner heartbeats it, longer
    than its owner timeout; once the heartbeats stop, its worker exits on its own (code 4) and
    takes its Ray actor with it: nothing of it holds a CPU with no controller left."""
    settings = PlatformSettings(
        data_dir=tmp_path, backend="ray", replica_start_timeout_s=60,
        controller_lease_s=1.0, replica_owner_leases=3,
    )  # fmt: skip
    spec = ReplicaSpec("orphan1", "e", None, "m", command="encoders")  # no model to load

    async def run() -> None:
        backend = RayBackend(settings, tmp_path / "logs", detached=True)
        handle = await backend.start(spec)
        beats = OwnerHeartbeat(settings, backend)
        beats.start()
        timeout = settings.replica_owner_leases * settings.controller_lease_s
        try:
            async with httpx.AsyncClient() as http:
                await wait_healthy(backend, handle, http, 60)
            # Heartbeats answered over twice the owner timeout: it is kept alive by them.
            need = int(2 * timeout / beats.interval_s) + 1
            await async_wait_until(lambda: beats.sent >= need, "heartbeats answered", 60)
            assert backend.alive(handle)
        finally:
            await beats.stop()
        await async_wait_until(lambda: not backend.alive(handle), "the worker to exit", 60)
        await backend.stop_all()  # detached: forgets it, kills nothing

        def actor_gone() -> bool:
            try:
                ray.get_actor(actor_name("orphan1"), namespace=NAMESPACE)
            except ValueError:
                return True
            return False

        await async_wait_until(actor_gone, "its actor to leave on its own", 60)
        assert "no controller has sent this replica a heartbeat" in handle_log(handle)

    asyncio.run(run())


def handle_log(handle: Any) -> str:
    """The replica's log on its node (its node folder: the same machine here)."""
    from modelyard.control.backends.ray_host import node_dir

    return (node_dir() / "logs" / f"{handle.spec.replica_id}.log").read_text(errors="replace")


@pytest.mark.usefixtures("platform_logs")
def test_a_dead_replicas_actor_is_removed(
    cluster: Cluster, platform: PlatformProcess, tiny_dir: Path
) -> None:
    """A worker that crashed (SIGKILL) is replaced, and its actor is removed: on Ray a dead
    worker's actor would otherwise hold its CPU for good."""
    api = platform.api()
    ep = deploy(api, "crashy", str(tiny_dir))
    victim = replicas(api, ep)[0]
    os.kill(victim["pid"], signal.SIGKILL)  # the nodes run on this machine

    def replaced() -> bool:
        now = replicas(api, ep)
        return any(r["state"] == "ready" and r["id"] != victim["id"] for r in now)

    wait_until(replaced, "the crashed replica's replacement", 120, 0.5)

    def actor_gone() -> bool:
        try:
            ray.get_actor(actor_name(victim["id"]), namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    wait_until(actor_gone, "the dead replica's actor to be removed", 60, 0.5)
    r = api.delete(f"/v1/endpoints/{ep}")
    assert r.status_code in (200, 202, 204), r.text
    wait_status(api, ep, "gone")


@pytest.mark.usefixtures("platform_logs")
def test_a_deploy_ray_has_no_room_for_says_why_and_starts_when_room_frees(
    cluster: Cluster, platform: PlatformProcess, tiny_dir: Path
) -> None:
    """Every CPU of the Ray cluster held (by a placement group of the test's own): a deploy is
    `unschedulable` within seconds, its status naming what it waits for; the room given back,
    it serves."""
    api = platform.api()
    # Every CPU of the cluster, once the earlier tests' actors have given theirs back.
    cpus = int(ray.cluster_resources().get("CPU", 0))
    hog = ray.util.placement_group([{"CPU": 1.0}] * cpus, strategy="SPREAD")
    ray.get(hog.ready(), timeout=120)
    ep = None
    try:
        ep = deploy(api, "squeezed", str(tiny_dir), wait=False)
        body = wait_status(api, ep, "unschedulable", timeout=30)
        message = body["status_message"] or ""
        assert "waiting for room on Ray: no node has 1 CPU" in message, body
        assert f"{cpus} of {cpus} CPU in use" in message, body
        assert "starts when room frees up" in message, body
        chat = platform.openai().with_options(max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:  # at once, not after a wait
            chat.chat.completions.create(
                model="squeezed", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert refused.value.status_code == 503, refused.value.response.text
        ray.util.remove_placement_group(hog)
        assert wait_status(api, ep, "ready", timeout=180)["status"] == "ready"
    finally:
        ray.util.remove_placement_group(hog)
        if ep is not None:  # the next test needs the nodes' CPUs
            r = api.delete(f"/v1/endpoints/{ep}")
            assert r.status_code in (200, 202, 204), r.text
            wait_status(api, ep, "gone")


# Last: it removes a node, and its endpoint keeps the other node's CPUs.
def test_replicas_on_two_nodes_serve_and_a_lost_node_is_replaced(
    cluster: Cluster, platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    ep = deploy(api, "pair", str(tiny_dir), public=True,
                hardware={"min_replicas": 2, "max_replicas": 2})  # fmt: skip
    before = replicas(api, ep)
    nodes = {r["id"]: node_of(r["id"]) for r in before}
    # Spread (Ray's SPREAD strategy): one replica per node, so losing a node loses one.
    assert len(set(nodes.values())) == 2, nodes
    chat = platform.openai().chat.completions.create(
        model="pair", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None

    victim_replica = before[0]["id"]
    victim = next(n for n in cluster.worker_nodes if n.node_id == nodes[victim_replica])
    client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key,
                                max_retries=0, timeout=120)  # fmt: skip

    async def run() -> list[str]:
        async def one(i: int) -> str:
            r = await client.chat.completions.create(
                model="pair", messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=400, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].finish_reason or ""

        # Long enough (400 tokens) that those on the node are still running when it goes: at
        # 120 a fast machine finished them first and nothing was left to retry.
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        # The node goes while requests run on its replica (the gateway counts them).
        for _ in range(600):  # up to 30 s
            loads = await asyncio.to_thread(replicas, api, ep)
            if any(r["id"] == victim_replica and r["outstanding"] > 0 for r in loads):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("no request reached the replica on the node to remove")
        await asyncio.to_thread(cluster.remove_node, victim)
        return await asyncio.gather(*tasks)

    retries_before = retries(platform)
    # Non-streaming requests in flight on the lost node were retried on the other one.
    assert asyncio.run(run()) == ["length"] * 8
    assert retries(platform) > retries_before
    # The lost node's worker died with its actor: nothing answers at its address any more.
    with pytest.raises(httpx.ConnectError):
        httpx.get(before[0]["address"] + "/health", timeout=5)

    deadline = time.monotonic() + 120
    while True:
        now = replicas(api, ep)
        ready = [r for r in now if r["state"] == "ready"]
        if len(ready) == 2 and victim_replica not in {r["id"] for r in ready}:
            break
        assert time.monotonic() < deadline, f"the lost replica was not replaced: {now}"
        time.sleep(0.5)
    survivor = next(n for n in set(nodes.values()) if n != victim.node_id)
    assert {node_of(r["id"]) for r in ready} == {survivor}
    assert wait_status(api, ep, "ready")["status"] == "ready"
    chat = platform.openai().chat.completions.create(
        model="pair", messages=[{"role": "user", "content": "again"}], max_tokens=4
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
