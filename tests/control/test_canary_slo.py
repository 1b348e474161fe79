"""The canary's SLO gate (issue 14): the judgement in process, then on a real platform a canary
that is slow (a 64-layer model beside a 2-layer one) and one whose worker fails every request
(an engine setting that times each request out) are each rolled back by the platform on its
own, with the reason and the numbers on the endpoint and in the audit log (actor `system`);
a clean canary with progressive steps is promoted by itself."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.config import PlatformSettings
from modelyard.control.canary import SloPolicy, judge, next_step
from modelyard.core.errors import Invalid
from modelyard.core.routing import VersionWindow
from modelyard.gateway.version_stats import VersionStats
from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env
from tests.tiny_models import build_model

HI = [{"role": "user", "content": "hi"}]
POLICY = SloPolicy(max_error_rate_delta=0.05, max_p95_ratio=2.0, min_samples=20, window_s=60)


# ----- the judgement, in process --------------------------------------------------------------


def test_too_few_requests_are_not_judged() -> None:
    verdict = judge(POLICY, VersionWindow(19, 19, None), VersionWindow(500, 0, 0.01))
    assert not verdict.judged and verdict.breach is None


def test_a_failing_canary_breaches_on_its_error_rate_delta() -> None:
    verdict = judge(POLICY, VersionWindow(40, 4, 0.01), VersionWindow(400, 4, 0.01))
    assert verdict.breach is not None and "error rate 10.0%" in verdict.breach
    assert verdict.numbers["canary_errors"] == 4 and verdict.numbers["error_rate_delta"] == 0.09
    fine = judge(POLICY, VersionWindow(40, 1, 0.01), VersionWindow(400, 4, 0.01))
    assert fine.breach is None and fine.judged


def test_a_slow_canary_breaches_on_its_p95_ratio() -> None:
    verdict = judge(POLICY, VersionWindow(40, 0, 0.05), VersionWindow(400, 0, 0.02))
    assert verdict.breach is not None and "2.5x" in verdict.breach
    assert verdict.numbers["p95_ratio"] == 2.5
    # The latency is compared only once the stable version has its samples too.
    early = judge(POLICY, VersionWindow(40, 0, 0.05), VersionWindow(10, 0, 0.02))
    assert early.breach is None and not early.judged


def test_progressive_steps_and_their_validation() -> None:
    settings = PlatformSettings()
    policy = SloPolicy.from_request(settings, {"min_samples": 5}, [5, 25, 50, 100])
    assert policy.min_samples == 5 and policy.window_s == settings.canary_window_s
    assert [next_step(policy, w) for w in (5, 25, 50, 100)] == [25, 50, 100, None]
    for bad in ([25, 5, 100], [5, 50], [0, 100]):
        with pytest.raises(Invalid):
            SloPolicy.from_request(settings, None, bad)


def test_version_stats_window_counts_errors_and_the_p95_of_good_answers() -> None:
    stats = VersionStats()
    for i in range(100):
        stats.record("ep", "v2", ok=i % 10 != 0, latency_s=i / 1000)
    stats.record("ep", None, ok=False, latency_s=None)  # no version: nothing kept
    window = stats.window("ep", "v2", 60)
    assert (window.samples, window.errors) == (100, 10)
    assert window.p95_s is not None and 0.093 <= window.p95_s <= 0.097
    assert stats.window("ep", "v1", 60) == VersionWindow()


# ----- a real platform ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[Any]:
    models = tmp_path_factory.mktemp("slo-models")
    p = PlatformProcess(tmp_path_factory.mktemp("slo-data"), tiny_models_env(models)).start()
    registry = RegistryClient(p.url, p.admin_key)
    registry.push(build_model(models / "v1", "llama", seed=0), "slo")  # slo:1
    registry.push(build_model(models / "v2", "llama", seed=1), "slo")  # slo:2
    # slo:3: the same width, 64 layers deep: every step takes many times the stable's.
    registry.push(build_model(models / "v3", "llama", seed=2, num_hidden_layers=64), "slo")
    try:
        yield p
    finally:
        p.stop()


def traffic_until_rolled_back(
    api: httpx.Client, endpoint: str, model: str, timeout: float = 90
) -> dict[str, Any]:
    """Steady requests (two threads) until the canary is gone; the endpoint then."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            payload = {"model": model, "messages": HI, "max_tokens": 8, "ignore_eos": True,
                       "user": f"u-{random.random()}"}  # fmt: skip
            api.post("/v1/chat/completions", json=payload)  # the canary's may fail: the point

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            body = api.get(f"/v1/endpoints/{endpoint}").json()
            if body["versions"]["canary"] is None:
                return dict(body)
            assert time.monotonic() < deadline, body["versions"]
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()


def add(api: httpx.Client, endpoint: str, **body: Any) -> None:
    r = api.post(f"/v1/endpoints/{endpoint}/versions", json=body)
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 60
    while api.get(f"/v1/endpoints/{endpoint}").json()["versions"]["canary"]["status"] != "serving":
        assert time.monotonic() < deadline
        time.sleep(0.1)


def audited(api: httpx.Client, endpoint: str, action: str, count: int = 1) -> list[dict[str, Any]]:
    """The endpoint's audit events of `action`, once there are `count`. The reconciler records
    a move of its own just after carrying it out (the endpoint shows the move a moment before
    its audit row exists), so this waits for the row rather than reading once."""
    deadline = time.monotonic() + 30
    while True:
        params = {"target_id": endpoint, "limit": 100}
        events = api.get("/v1/audit", params=params).json()["data"]
        found = [e for e in events if e["action"] == action]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, [e["action"] for e in events]
        time.sleep(0.05)


def test_slow_and_failing_canaries_are_rolled_back_on_their_own(
    platform: PlatformProcess,
) -> None:
    api = platform.api()
    endpoint = deploy(api, "slo-a", "slo:1", hardware={"max_replicas": 2})
    v1 = api.get(f"/v1/endpoints/{endpoint}").json()["version_id"]
    slo = {"min_samples": 10, "window_s": 30, "max_p95_ratio": 1.5, "max_error_rate_delta": 0.2}

    add(api, endpoint, model_artifact="slo:3", weight=50, slo=slo)
    body = traffic_until_rolled_back(api, endpoint, "slo-a")
    rollback = body["last_rollback"]
    print("slow canary rolled back:", rollback["reason"], rollback["numbers"])
    assert rollback["by"] == "system" and "p95 latency" in rollback["reason"]
    assert rollback["numbers"]["p95_ratio"] > 1.5 and rollback["to_version_id"] == v1
    assert body["version_id"] == v1 and body["traffic"] in ({v1: 100}, {})

    # A canary whose worker answers every request with an error (it times each one out).
    add(api, endpoint, model_artifact="slo:2", weight=50, slo=slo,
        engine={"request_timeout_s": 0.001})  # fmt: skip
    body = traffic_until_rolled_back(api, endpoint, "slo-a")
    rollback = body["last_rollback"]
    print("failing canary rolled back:", rollback["reason"], rollback["numbers"])
    assert rollback["by"] == "system" and "error rate" in rollback["reason"]
    assert rollback["numbers"]["canary_errors"] >= 10
    assert rollback["numbers"]["stable_error_rate"] == 0.0

    events = audited(api, endpoint, "endpoint.auto_rollback", count=2)
    assert len(events) == 2 and {e["actor_key_id"] for e in events} == {"system"}
    assert "error rate" in events[0]["after"]["last_rollback"]["reason"]  # newest first


def test_a_clean_canary_with_steps_is_promoted_on_its_own(platform: PlatformProcess) -> None:
    api = platform.api()
    endpoint = deploy(api, "slo-b", "slo:1", hardware={"max_replicas": 2})
    lax = {"min_samples": 5, "window_s": 2, "max_p95_ratio": 100, "max_error_rate_delta": 0.5}
    add(api, endpoint, model_artifact="slo:2", weight=20, slo=lax, steps=[20, 60, 100])
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            payload = {"model": "slo-b", "messages": HI, "max_tokens": 1}
            api.post("/v1/chat/completions", json=payload)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            body = api.get(f"/v1/endpoints/{endpoint}").json()
            if body["versions"]["canary"] is None:
                break
            assert time.monotonic() < deadline, body["versions"]
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert body["model_artifact"] == "slo:2" and body["last_rollback"] is None
    assert audited(api, endpoint, "endpoint.auto_promote")
    assert audited(api, endpoint, "endpoint.traffic")
