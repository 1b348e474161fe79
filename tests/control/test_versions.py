"""Several versions behind one endpoint (issue 14): the weighted, sticky version choice (in
process, 2,000 picks), then a real platform serving two distinguishable tiny models: the
version header and the usage rows agree, `user` and `x-session-id` keep a caller on one version,
a manual rollback under steady load fails no request and starts no replica, a promotion keeps
the previous version warm so that rolling back to it loads nothing, a rollback races streams in
flight and a canary replica that dies under load is retried on the stable one; the versions and
weights survive a restart (SQLite, and PostgreSQL + Redis)."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.core.routing import EndpointRoute, ReplicaRoute, RoutingTable
from modelyard.gateway.version_stats import VERSION_HEADER
from modelyard.registry_client import RegistryClient
from tests.platform_harness import (
    PlatformProcess,
    deploy,
    tiny_models_env,
    usage_rows,
    wait_request_ids,
    wait_status,
)
from tests.tiny_models import build_model
from tests.waiting import wait_until

HI = [{"role": "user", "content": "hi"}]
NO_GATE = {"min_samples": 1_000_000}  # these tests move traffic by hand: no SLO rollback


# ----- the choice of version, in process ------------------------------------------------------


def _route(weights: dict[str, int], ready: dict[str, bool] | None = None) -> EndpointRoute:
    route = EndpointRoute("ep-1", "t", "m", False, "v1", 16)
    for version, up in (ready or {"v1": True, "v2": True}).items():
        route.replicas.append(
            ReplicaRoute(f"r-{version}", "http://x", ready=up, version_id=version)
        )
    route.weights = weights
    return route


def _served(route: EndpointRoute, affinity: str | None = None) -> str | None:
    replica = RoutingTable.pick(route, affinity=affinity)
    assert replica is not None
    return replica.version_id


def test_a_ten_percent_canary_gets_ten_percent_of_2000_requests() -> None:
    random.seed(14)
    route = _route({"v1": 90, "v2": 10})
    share = Counter(_served(route) for _ in range(2000))["v2"] / 2000
    assert 0.08 <= share <= 0.12, share
    users = Counter(_served(route, f"user-{i}") for i in range(2000))["v2"] / 2000
    assert 0.08 <= users <= 0.12, users
    assert route.fallbacks == 0


def test_a_user_stays_on_one_version_while_the_weights_stay() -> None:
    route = _route({"v1": 50, "v2": 50})
    for user in ("alice", "bob", "carol", "dave"):
        assert len({_served(route, user) for _ in range(50)}) == 1
    # Different users do not all land on one version.
    assert len({_served(route, f"u{i}") for i in range(40)}) == 2


def test_a_version_without_a_ready_replica_falls_back_and_weight_zero_is_never_picked() -> None:
    route = _route({"v1": 50, "v2": 50}, ready={"v1": True, "v2": False})
    assert {_served(route) for _ in range(100)} == {"v1"}
    assert 30 <= route.fallbacks <= 70  # the draws that chose v2
    rolled_back = _route({"v1": 100, "v2": 0})
    assert {_served(rolled_back) for _ in range(100)} == {"v1"}
    assert rolled_back.fallbacks == 0
    only_canary = _route({"v1": 0, "v2": 100}, ready={"v1": True, "v2": False})
    assert RoutingTable.pick(only_canary) is None  # never the weight-0 one: the caller waits


def test_a_canarys_load_is_its_own_replicas_and_its_share_of_the_queue() -> None:
    from modelyard.control.autoscaler import ScalingPolicy
    from modelyard.control.state import Replica
    from modelyard.control.version_load import VersionLoad
    from modelyard.control.version_scaling import canary_autoscaler
    from modelyard.core.status import ReplicaState

    route = _route({"v1": 75, "v2": 25})
    for r, busy in zip(route.replicas, (5, 3), strict=True):
        r.outstanding = busy  # v1's replica carries 5, v2's 3
    canary = [Replica("r-v2", route=route.replicas[1], state=ReplicaState.READY, version_id="v2")]
    for _ in range(8):
        route.queue.join(0, 100)  # 8 requests queued at the gateway for the endpoint
    obs = VersionLoad("concurrency").observe(1.0, route, 25, canary)
    assert obs.value == 3 + 8 * 0.25 and obs.active  # its in-flight, a quarter of the queue
    endpoint = ScalingPolicy(metric="concurrency", target=1, min_replicas=0, max_replicas=4,
                             scale_to_zero=True)  # fmt: skip
    scaler = canary_autoscaler(endpoint, 2)
    # The endpoint's max_replicas bounds its versions together: one stays the stable's.
    assert (scaler.policy.min_replicas, scaler.policy.max_replicas) == (2, 3)
    assert not scaler.policy.scale_to_zero  # a canary with no replica has nothing to judge
    scaler.observe(obs)
    assert scaler.decide(1.0, 1).desired == 3  # 5 wanted, capped at the endpoint's max - 1
    assert canary_autoscaler(endpoint, 6).policy.max_replicas == 6  # a restored floor stays


# ----- a real platform ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[Any]:
    models = tmp_path_factory.mktemp("versions-models")
    env = {**tiny_models_env(models), "MODELYARD_ROLLBACK_GRACE_S": "300"}
    p = PlatformProcess(tmp_path_factory.mktemp("versions-data"), env).start()
    registry = RegistryClient(p.url, p.admin_key)
    for seed in (0, 1):  # two distinguishable versions: ver:1 and ver:2
        registry.push(build_model(models / f"v{seed + 1}", "llama", seed=seed), "ver")
    try:
        yield p
    finally:
        p.stop()


def add_canary(api: httpx.Client, endpoint: str, artifact: str, weight: int, **extra: Any) -> dict:
    body = {"model_artifact": artifact, "weight": weight, **extra}
    r = api.post(f"/v1/endpoints/{endpoint}/versions", json=body)
    assert r.status_code == 201, r.text
    return wait_canary(api, endpoint, "serving")


def wait_canary(api: httpx.Client, endpoint: str, status: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = api.get(f"/v1/endpoints/{endpoint}").json()
        canary = body["versions"]["canary"]
        if (canary or {}).get("status") == status or (status == "gone" and canary is None):
            return dict(body)
        assert time.monotonic() < deadline, body["versions"]
        time.sleep(0.1)


def ask(api: httpx.Client, model: str, **body: Any) -> httpx.Response:
    headers = {"x-session-id": body.pop("session")} if "session" in body else {}
    payload = {"model": model, "messages": HI, "max_tokens": 1, **body}
    r = api.post("/v1/chat/completions", json=payload, headers=headers)
    assert r.status_code == 200, r.text
    return r


def replica_ids(api: httpx.Client, endpoint: str) -> dict[str, set[str]]:
    items = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
    by_version: dict[str, set[str]] = {}
    for item in items:
        if item["state"] in ("starting", "ready"):
            by_version.setdefault(item["version_id"], set()).add(item["id"])
    return by_version


class Load:
    """Steady traffic from a few threads until stopped; every failure is kept."""

    def __init__(self, api: httpx.Client, model: str, threads: int = 3, **body: Any) -> None:
        self.api, self.model, self.body = api, model, body
        self.failures: list[str] = []
        self.served: Counter[str] = Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            payload = {"model": self.model, "messages": HI, "max_tokens": 1, **self.body}
            try:
                r = self.api.post("/v1/chat/completions", json=payload)
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
                else:
                    self.served[r.headers.get(VERSION_HEADER, "")] += 1
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def answered(self) -> int:
        return sum(self.served.values()) + len(self.failures)

    def wait_answered(self, more: int = 6, version: str | None = None) -> None:
        """Until `more` further requests are answered (served by `version`, if given)."""
        if version is None:
            target = self.answered() + more
            wait_until(lambda: self.answered() >= target, f"{more} more answers under load")
        else:
            target = self.served[version] + more
            wait_until(lambda: self.served[version] >= target, f"{more} answers by {version}")


def test_header_usage_stickiness_and_a_rollback_under_load(platform: PlatformProcess) -> None:
    api = platform.api()
    endpoint = deploy(api, "ver-a", "ver:1", hardware={"max_replicas": 2})
    v1 = api.get(f"/v1/endpoints/{endpoint}").json()["version_id"]
    body = add_canary(api, endpoint, "ver:2", 30, slo=NO_GATE)
    v2 = body["versions"]["canary"]["version_id"]
    assert body["traffic"] == {v1: 70, v2: 30}
    assert {i["role"]: i["weight"] for i in body["versions"]["items"]} == {
        "stable": 70,
        "canary": 30,
    }

    # ~200 requests: every answer names its version, and the usage rows agree.
    seen: dict[str, str] = {}
    for i in range(200):
        r = ask(api, "ver-a", user=f"user-{i}")
        seen[r.headers["x-request-id"]] = r.headers[VERSION_HEADER]
    assert set(seen.values()) == {v1, v2}
    assert 0.15 <= Counter(seen.values())[v2] / 200 <= 0.45
    rows = wait_request_ids(api, list(seen))
    assert {r["request_id"]: r["version_id"] for r in rows if r["request_id"] in seen} == seen
    by_version = {
        g["version"]: g["requests"]
        for g in api.get("/v1/usage", params={"group_by": "version"}).json()["data"]
    }
    counted = Counter(seen.values())
    assert by_version[v1] >= counted[v1] and by_version[v2] >= counted[v2]

    # The same user, or the same session, stays on one version.
    for user in ("alice", "bob", "carol"):
        assert len({ask(api, "ver-a", user=user).headers[VERSION_HEADER] for _ in range(8)}) == 1
    assert len({ask(api, "ver-a", session="s-1").headers[VERSION_HEADER] for _ in range(8)}) == 1

    # A bad weight set is refused, naming the field.
    r = api.patch(f"/v1/endpoints/{endpoint}/traffic", json={"weights": {v1: 60, v2: 30}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weights"
    r = api.patch(f"/v1/endpoints/{endpoint}/traffic", json={"weights": {"ver-x": 100}})
    assert r.status_code == 400
    r = api.patch(f"/v1/endpoints/{endpoint}/traffic", json={"weights": {v1: 50, v2: 50}})
    assert r.status_code == 200 and r.json()["weights"] == {v1: 50, v2: 50}

    # A manual rollback under steady load: no request fails, no replica starts.
    before = replica_ids(api, endpoint)
    with Load(api, "ver-a") as load:
        load.wait_answered()  # under load before the rollback...
        r = api.post(f"/v1/endpoints/{endpoint}/rollback", json={"reason": "looks off"})
        load.wait_answered(version=v1)  # ...and after it
    assert r.status_code == 200, r.text
    done = r.json()
    print(f"manual rollback took {done['took_ms']} ms (traffic moved before the write)")
    assert done["weights"] == {v1: 100} and done["rollback"]["reason"] == "looks off"
    assert load.failures == [] and load.served[v1] > 0
    after = replica_ids(api, endpoint)
    assert after.get(v1) == before[v1]  # the stable replicas served on; none was started
    assert not (after.get(v2, set()) - before[v2])
    view = wait_canary(api, endpoint, "gone")
    assert view["last_rollback"]["from_version_id"] == v2
    assert view["last_rollback"]["reason"] == "looks off"
    assert view["versions"]["last_rollback"]["by"] != "system"

    # Every change is in the audit log.
    actions = {e["action"] for e in api.get("/v1/audit", params={"limit": 100}).json()["data"]
               if e["target_id"] == endpoint}  # fmt: skip
    assert {"endpoint.version_add", "endpoint.traffic", "endpoint.rollback"} <= actions


def test_promote_keeps_the_previous_version_warm_and_rollback_loads_nothing(
    platform: PlatformProcess,
) -> None:
    api = platform.api()
    endpoint = deploy(api, "ver-b", "ver:1", hardware={"max_replicas": 2})
    v1 = api.get(f"/v1/endpoints/{endpoint}").json()["version_id"]
    v2 = add_canary(api, endpoint, "ver:2", 10, slo=NO_GATE)["versions"]["canary"]["version_id"]
    warm = replica_ids(api, endpoint)[v1]
    r = api.post(f"/v1/endpoints/{endpoint}/promote")
    assert r.status_code == 200, r.text
    assert r.json()["weights"] == {v2: 100, v1: 0}
    view = api.get(f"/v1/endpoints/{endpoint}").json()
    assert view["version_id"] == v2 and view["good_version_id"] == v2
    previous = next(i for i in view["versions"]["items"] if i["role"] == "previous")
    assert previous["version_id"] == v1 and previous["warm_until"] > time.time() + 200
    for _ in range(10):  # the previous version gets nothing while it waits
        assert ask(api, "ver-b").headers[VERSION_HEADER] == v2

    with Load(api, "ver-b") as load:
        load.wait_answered()
        r = api.post(f"/v1/endpoints/{endpoint}/rollback")
        load.wait_answered(version=v1)  # the warm previous version serves at once
    assert r.status_code == 200, r.text
    assert load.failures == [] and load.served[v1] > 0
    view = api.get(f"/v1/endpoints/{endpoint}").json()
    # All traffic on v1 (the weights go once the other version's replicas have drained).
    assert view["version_id"] == v1 and view["traffic"] in ({v1: 100}, {})
    assert replica_ids(api, endpoint)[v1] == warm  # the warm replicas took over: none started
    r = api.post(f"/v1/endpoints/{endpoint}/rollback")
    assert r.status_code == 409  # nothing left to roll back to


def test_a_rollback_races_streams_in_flight_and_a_dying_canary_is_retried(
    platform: PlatformProcess,
) -> None:
    api = platform.api()
    endpoint = deploy(api, "ver-c", "ver:1", hardware={"max_replicas": 2})
    v1 = api.get(f"/v1/endpoints/{endpoint}").json()["version_id"]
    v2 = add_canary(api, endpoint, "ver:2", 50, slo=NO_GATE)["versions"]["canary"]["version_id"]
    results: list[str] = []
    started_on: list[str] = []
    # The rollback and the streams' answers start together: every stream has its first token
    # (it is under way on its version) when the rollback is sent, and none has read on yet.
    go = threading.Barrier(9, timeout=120)
    rolled_back = threading.Event()
    finished_before_rollback: list[int] = []

    def stream(i: int) -> None:
        payload = {"model": "ver-c", "messages": HI, "max_tokens": 200, "stream": True,
                   "user": f"racer-{i}", "ignore_eos": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip
        with api.stream("POST", "/v1/chat/completions", json=payload) as r:
            started_on.append(r.headers.get(VERSION_HEADER, ""))
            lines = r.iter_lines()
            text = ""
            for line in lines:
                text += line + "\n"
                if line.startswith("data: "):
                    break
            go.wait()
            text += "\n".join(lines)
            if not rolled_back.is_set():
                finished_before_rollback.append(i)
        whole = r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
        tokens = sum(json.loads(x[6:])["usage"]["completion_tokens"] for x in text.splitlines()
                     if x.startswith('data: {') and '"usage":{' in x.replace(" ", ""))  # fmt: skip
        ok = whole and '"error"' not in text and tokens >= 200
        results.append("ok" if ok else f"{r.status_code} {tokens} {text[-200:]}")

    racers = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in racers:
        t.start()
    go.wait()
    r = api.post(f"/v1/endpoints/{endpoint}/rollback")
    rolled_back.set()
    assert r.status_code == 200, r.text
    assert r.json()["weights"] == {v1: 100}
    for t in racers:
        t.join()
    # The race was run: streams were under way on both versions when the rollback came.
    assert set(started_on) == {v1, v2}, started_on
    # The rules: a stream under way ends whole on the version it started on, whatever the
    # rollback moved meanwhile; new requests go to the version rolled back to.
    assert results == ["ok"] * 8
    assert {ask(api, "ver-c", user=f"racer-{i}").headers[VERSION_HEADER] for i in range(8)} == {v1}
    print(f"streams finished before the rollback answered: {len(finished_before_rollback)}/8")

    # A canary replica that dies under load: requests it refused go to the stable version.
    body = add_canary(api, endpoint, "ver:2", 50, slo=NO_GATE)
    canary = next(i for i in body["replicas"]["items"] if i["version_id"] != v1
                  and i["state"] == "ready")  # fmt: skip
    sent_before = {r["request_id"] for r in usage_rows(api)}
    with Load(api, "ver-c") as load:
        load.wait_answered()
        os.kill(canary["pid"], signal.SIGKILL)
        wait_until(
            lambda: api.get(f"/v1/endpoints/{endpoint}").json()["versions"]["fallbacks"] > 0,
            "a request meant for the dead canary to fall back to the stable version",
        )
        load.wait_answered()
    assert load.failures == [], load.failures
    assert load.served[v1] > 0
    view = api.get(f"/v1/endpoints/{endpoint}").json()
    assert view["versions"]["fallbacks"] > 0
    served = sum(load.served.values())
    rows = [r for r in usage_rows(api) if r["request_id"] not in sent_before]
    deadline = time.monotonic() + 10
    while len(rows) < served and time.monotonic() < deadline:
        time.sleep(0.2)
        rows = [r for r in usage_rows(api) if r["request_id"] not in sent_before]
    assert len(rows) == served  # each metered once


def test_versions_and_weights_survive_a_restart(
    platform_env: dict[str, str], tmp_path: Path, cache_dir: Path
) -> None:
    """SQLite, and PostgreSQL + Redis: a canary's version, weights and SLO come back after a
    restart, and its replica is started again."""
    models = tmp_path / "models"
    env = {**tiny_models_env(models), **platform_env}
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        registry = RegistryClient(p.url, p.admin_key)
        for seed in (0, 1):
            registry.push(build_model(models / f"v{seed + 1}", "llama", seed=seed), "kept")
        api = p.api()
        # No need to wait for replicas.
        endpoint = deploy(api, "kept", "kept:1", wait=False, hardware={"max_replicas": 2})
        r = api.post(
            f"/v1/endpoints/{endpoint}/versions",
            json={"model_artifact": "kept:2", "weight": 25, "slo": {"min_samples": 999}},
        )
        assert r.status_code == 201, r.text
        weights = r.json()["weights"]
    finally:
        p.stop()
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        api = p.api()
        body = api.get(f"/v1/endpoints/{endpoint}").json()  # restored before HTTP answers
        assert body["traffic"] == weights and sorted(weights.values()) == [25, 75]
        canary = body["versions"]["canary"]
        assert canary["model_artifact"] == "kept:2"
        item = next(i for i in body["versions"]["items"] if i["role"] == "canary")
        assert item["slo"]["min_samples"] == 999
        deadline = time.monotonic() + 30  # and the next tick starts the canary's replica
        while not replica_ids(api, endpoint).get(canary["version_id"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        p.stop()


def test_the_warm_pool_takes_endpoints_whose_engine_settings_come_to_its_own() -> None:
    """A tenant's endpoint may take a warm replica when its overrides change nothing (they
    repeat the pool's values or the engine's defaults), never when they change a setting."""
    from modelyard.config import PlatformSettings
    from modelyard.control.warm_pool import WarmPool

    pool_env = {"MODELYARD_KV_CACHE_MEMORY": "64MiB", "MODELYARD_DTYPE": "float32"}
    pool = WarmPool(PlatformSettings(), None, None, None, pool_env, None)  # type: ignore[arg-type]
    assert pool.same_engine({})
    assert pool.same_engine({"MODELYARD_DTYPE": "float32"})  # the pool's own value
    assert pool.same_engine({"MODELYARD_MAX_NUM_SEQS": "64"})  # the engine's default
    assert pool.same_engine({"MODELYARD_KV_CACHE_MEMORY": str(64 * 2**20)})  # same, in bytes
    assert not pool.same_engine({"MODELYARD_MAX_NUM_SEQS": "8"})
    assert not pool.same_engine({"MODELYARD_REQUEST_TIMEOUT_S": "0.001"})


def test_a_model_in_use_by_a_live_endpoint_is_a_409_and_free_once_its_endpoints_are_deleted(
    platform: PlatformProcess, tmp_path: Path
) -> None:
    """Deleting a registry model: 409 while a live endpoint runs one of its versions as its
    own or as a canary; 200 once only deleted endpoints name it (their rows keep the
    reference text, and used to make this a 500 through their foreign key)."""
    api = platform.api()
    registry = RegistryClient(platform.url, platform.admin_key)
    registry.push(build_model(tmp_path / "d1", "llama", seed=3), "doomed")  # doomed:1
    registry.push(build_model(tmp_path / "c1", "llama", seed=4), "doomed-canary")
    endpoint = deploy(api, "doomed-ep", "doomed:1", wait=False)
    r = api.delete("/v1/registry/models/doomed")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_in_use", r.text
    assert "doomed-ep" in r.json()["error"]["message"]

    stable = deploy(api, "doomed-host", "ver:1", wait=False, hardware={"max_replicas": 2})
    r = api.post(f"/v1/endpoints/{stable}/versions",
                 json={"model_artifact": "doomed-canary:1", "weight": 10})  # fmt: skip
    assert r.status_code == 201, r.text
    r = api.delete("/v1/registry/models/doomed-canary")  # only a canary runs it
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_in_use", r.text

    for gone in (endpoint, stable):
        assert api.delete(f"/v1/endpoints/{gone}").status_code == 202
    for gone in (endpoint, stable):
        wait_status(api, gone, "gone")
    for model in ("doomed", "doomed-canary"):
        r = api.delete(f"/v1/registry/models/{model}")
        assert r.status_code == 200, r.text
        assert api.get(f"/v1/registry/models/{model}").status_code == 404
    events = api.get("/v1/audit", params={"action": "model.delete", "limit": 100}).json()["data"]
    assert {"doomed", "doomed-canary"} <= {e["target_id"] for e in events}


def test_a_canary_scales_by_its_own_load_between_its_count_and_the_endpoints_max(
    platform: PlatformProcess,
) -> None:
    """Its own autoscaler (the endpoint's policy, floored at the canary's replicas, capped at
    what the endpoint's max_replicas leaves beside the stable replica) on its own replicas'
    load: up under load, back down after."""
    api = platform.api()
    quick = {"metric": "concurrency", "target_value": 1, "stable_window_seconds": 2,
             "panic_window_seconds": 1, "scale_down_delay_seconds": 1}  # fmt: skip
    endpoint = deploy(api, "ver-s", "ver:1", hardware={"max_replicas": 3}, scaling=quick)
    v2 = add_canary(api, endpoint, "ver:2", 100, slo=NO_GATE)["versions"]["canary"]["version_id"]

    def canary_replicas() -> dict[str, Any]:
        items = api.get(f"/v1/endpoints/{endpoint}").json()["versions"]["items"]
        return dict(next(i for i in items if i["version_id"] == v2)["replicas"])

    assert canary_replicas()["min"] == 1
    with Load(api, "ver-s", threads=4, max_tokens=8, ignore_eos=True) as load:
        deadline = time.monotonic() + 60
        while canary_replicas()["ready"] < 2:
            assert time.monotonic() < deadline, canary_replicas()
            time.sleep(0.2)
    assert load.failures == [] and set(load.served) == {v2}
    deadline = time.monotonic() + 60
    while (seen := canary_replicas())["live"] > 1:  # idle again: back to its floor
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert seen["desired"] == 1 and seen["ready"] == 1


def test_patch_changes_sampling_defaults_and_scaling_without_a_rollout(
    platform: PlatformProcess,
) -> None:
    api = platform.api()
    endpoint = deploy(api, "ver-p", "ver:1")
    before = api.get(f"/v1/endpoints/{endpoint}").json()
    replicas = replica_ids(api, endpoint)
    greedy = ask(api, "ver-p", max_tokens=8, temperature=0).json()["choices"][0]["message"]
    scaling = {"metric": "requests_per_second", "target_value": 50, "scale_to_zero": False}
    r = api.patch(f"/v1/endpoints/{endpoint}",
                  json={"sampling_defaults": {"temperature": 0}, "scaling": scaling})  # fmt: skip
    assert r.status_code == 202 and r.json()["status"] == "ready", r.text
    # The next request takes the new default: no temperature given, greedy for every seed.
    texts = {
        ask(api, "ver-p", max_tokens=8, seed=seed).json()["choices"][0]["message"]["content"]
        for seed in range(3)
    }
    assert texts == {greedy["content"]}
    deadline = time.monotonic() + 10  # and the next tick's scaling decision follows the policy
    while True:
        view = api.get(f"/v1/endpoints/{endpoint}").json()
        decision = view["autoscaling"]["last_decision"] or {}
        if decision.get("reason", "").startswith("requests_per_second"):
            break
        assert time.monotonic() < deadline, view["autoscaling"]
        time.sleep(0.2)
    assert view["scaling"]["metric"] == "requests_per_second"
    assert view["sampling_defaults"] == {"temperature": 0.0}
    # Nothing rolled out: same version, same replicas, no status change.
    assert view["version_id"] == before["version_id"] and view["status"] == "ready"
    assert replica_ids(api, endpoint) == replicas
    events = api.get("/v1/audit", params={"target_id": endpoint}).json()["data"]
    update = next(e for e in events if e["action"] == "endpoint.update")
    assert update["before"]["sampling_defaults"] == {}
    assert update["after"]["sampling_defaults"] == {"temperature": 0.0}
    assert update["after"]["scaling"]["metric"] == "requests_per_second"
