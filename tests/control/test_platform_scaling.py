"""GPU economics on real worker processes: scale to zero and back (waiting, progress comments,
202 + polling), autoscaling on load, admission control (429 + Retry-After, never a crash), a
warm pool replica taken over by a cold endpoint, and failures: a worker killed under 50
concurrent requests loses none, a stream that already sent tokens ends with a clean error
event."""

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

from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, deploy, wait_status
from tests.tiny_models import build_model
from tests.waiting import wait_until

MESSAGES = [{"role": "user", "content": "Hello there"}]
FAST = {"stable_window_seconds": 2, "panic_window_seconds": 1, "scale_down_delay_seconds": 1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def start(data_dir: Path, **env: str) -> PlatformProcess:
    base = {
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    return PlatformProcess(data_dir, {**base, **env}).start()


@pytest.fixture()
def platform(tmp_path: Path, cache_dir: Path) -> Iterator[PlatformProcess]:
    p = start(tmp_path / "data")
    try:
        yield p
    finally:
        p.stop()


def endpoint(api: httpx.Client, endpoint_id: str) -> dict[str, Any]:
    return dict(api.get(f"/v1/endpoints/{endpoint_id}").json())


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def deploy_to_zero(platform: PlatformProcess, tiny_dir: Path, name: str) -> str:
    api = platform.api()
    ep = deploy(
        api, name, str(tiny_dir), public=True, wait=False,
        hardware={"min_replicas": 0, "max_replicas": 1},
        scaling={"metric": "concurrency", "target_value": 4, "scale_to_zero": True,
                 "scale_to_zero_after_idle_seconds": 2, **FAST},
    )  # fmt: skip
    wait_status(api, ep, "scaled_to_zero", timeout=60)
    assert endpoint(api, ep)["replicas"]["items"] == []
    return ep


def test_scale_to_zero_when_idle_and_back_on_the_next_request(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    ep = deploy_to_zero(platform, tiny_dir, "sleepy")
    assert platform.worker_pids() == []  # nothing runs for it
    decision = endpoint(api, ep)["autoscaling"]["last_decision"]
    assert decision["desired"] == 0 and "scale to zero" in decision["reason"]
    t0 = time.monotonic()
    answer = platform.openai().chat.completions.create(
        model="sleepy", messages=MESSAGES, max_tokens=3
    )
    assert answer.choices[0].message.content is not None and time.monotonic() - t0 < 60
    body = endpoint(api, ep)
    assert body["status"] == "ready" and body["replicas"]["ready"] == 1
    # Idle again: back to zero.
    wait_status(api, ep, "scaled_to_zero", timeout=60)


def test_a_stream_reports_loading_progress_and_async_clients_get_202(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    ep = deploy_to_zero(platform, tiny_dir, "cold")
    headers = {"authorization": f"Bearer {platform.admin_key}"}
    body = {"model": "cold", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body,
                      headers=headers, timeout=120) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    # Progress comments (`: loading …`); each event's token stamp (`: tokens N`) is not one.
    comments = [line for line in lines if line.startswith(":") and not line.startswith(": tokens")]
    data = [line for line in lines if line.startswith("data: ")]
    assert comments and comments[0].startswith(": loading cold")
    assert data[-1] == "data: [DONE]" and '"finish_reason"' in "".join(data)
    assert lines.index(comments[-1]) < lines.index(data[0])  # progress first, then tokens

    wait_status(api, ep, "scaled_to_zero", timeout=60)
    r = httpx.post(
        f"{platform.url}/v1/chat/completions",
        json={"model": "cold", "messages": MESSAGES, "max_tokens": 4},
        headers={**headers, "prefer": "respond-async"},
    )
    assert r.status_code == 202 and r.json()["status"] == "in_progress"
    poll = platform.url + r.json()["poll_url"]
    deadline = time.monotonic() + 120
    while (result := httpx.get(poll, headers=headers)).status_code == 202:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert result.status_code == 200
    assert result.json()["object"] == "chat.completion"


def test_load_scales_up_and_overload_is_429_with_retry_after(
    tmp_path: Path, tiny_dir: Path, cache_dir: Path
) -> None:
    # A replica admits 2 requests at once; 2 more may queue for at most 3 s.
    p = start(
        tmp_path / "data",
        MODELYARD_ADMISSION_TOKENS_PER_REQUEST=str(10**9),
        MODELYARD_ADMISSION_QUEUE_SIZE="2",
        MODELYARD_ADMISSION_TIMEOUT_S="3",
    )
    try:
        api = p.api()
        ep = deploy(
            api, "busy", str(tiny_dir), public=True,
            hardware={"min_replicas": 1, "max_replicas": 2},
            scaling={"metric": "concurrency", "target_value": 1, **FAST},
        )  # fmt: skip
        client = openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key=p.admin_key, max_retries=0,
                                    timeout=120)  # fmt: skip
        codes: list[int] = []

        async def one() -> None:
            try:
                await client.chat.completions.create(
                    model="busy", messages=MESSAGES, max_tokens=300,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                codes.append(200)
            except openai.RateLimitError as exc:
                assert int(exc.response.headers["retry-after"]) >= 1
                assert exc.body["code"] == "model_overloaded"
                codes.append(429)

        async def load_until_two_replicas() -> None:
            await asyncio.gather(*(one() for _ in range(10)))  # over 2 admitted + 2 queued
            two = asyncio.Event()

            async def keep_busy() -> None:  # steady load: it never falls between bursts
                while not two.is_set():
                    await one()
                    if codes[-1] == 429:
                        await asyncio.sleep(0.2)  # a client backing off, not synchronisation

            async def watch() -> None:
                deadline = time.monotonic() + 240  # a replica's start on a loaded CI machine
                try:
                    while (view := await asyncio.to_thread(endpoint, api, ep))["replicas"][
                        "ready"
                    ] < 2:
                        assert time.monotonic() < deadline, (
                            "the endpoint never reached 2 ready replicas: "
                            f"{view['replicas']} {view['autoscaling']}"
                        )
                        await asyncio.sleep(0.5)
                finally:
                    two.set()

            await asyncio.gather(watch(), *(keep_busy() for _ in range(4)))

        asyncio.run(load_until_two_replicas())
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2
        changes = endpoint(api, ep)["autoscaling"]["recent_changes"]
        up = next(c for c in changes if c["desired"] == 2)
        assert up["current"] == 1 and "concurrency" in up["reason"]
    finally:
        p.stop()


def test_killing_a_worker_under_50_requests_loses_none(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    ep = deploy(api, "pair", str(tiny_dir), public=True,
                hardware={"min_replicas": 2, "max_replicas": 2})  # fmt: skip
    victim = endpoint(api, ep)["replicas"]["items"][0]["pid"]

    def victim_outstanding() -> int:
        items = endpoint(api, ep)["replicas"]["items"]
        return sum(int(r["outstanding"]) for r in items if r["pid"] == victim)

    client = openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=platform.admin_key,
                                max_retries=0, timeout=120)  # fmt: skip

    async def run() -> list[str]:
        async def one(i: int) -> str:
            r = await client.chat.completions.create(
                model="pair", messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=120, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].finish_reason or ""

        tasks = [asyncio.create_task(one(i)) for i in range(50)]
        # The kill lands while the victim is answering: requests are in flight on it.
        await asyncio.to_thread(
            wait_until, lambda: victim_outstanding() > 0, "requests in flight on the victim"
        )
        os.kill(victim, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert results == ["length"] * 50


def test_a_stream_cut_by_a_dying_worker_ends_cleanly(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    ep = deploy(api, "fragile", str(tiny_dir), public=True)
    pid = endpoint(api, ep)["replicas"]["items"][0]["pid"]
    headers = {"authorization": f"Bearer {platform.admin_key}"}
    body = {"model": "fragile", "messages": MESSAGES, "max_tokens": 480, "stream": True,
            "ignore_eos": True}  # fmt: skip
    events: list[str] = []
    with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body,
                      headers=headers, timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 5:
                    os.kill(pid, signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])
    assert error["error"]["code"] == "upstream_error"
    assert len(events) < 400  # it did not run to the end


def test_a_cold_endpoint_takes_over_a_warm_pool_replica(
    tmp_path: Path, tiny_dir: Path, cache_dir: Path
) -> None:
    platform = start(tmp_path / "data", MODELYARD_WARM_POOL=json.dumps({"tiny": 1}))
    try:
        RegistryClient(platform.url, platform.admin_key).push(tiny_dir, "tiny")
        api = platform.api()

        def idle() -> int:
            return int(api.get("/health").json()["warm_pool_idle"].get("tiny", 0))

        wait_for(lambda: idle() == 1, 120, "the warm pool to fill")
        (warm_pid,) = platform.worker_pids()
        placed = [r for d in api.get("/v1/devices").json()["data"] for r in d["replicas"]]
        assert len(placed) == 1  # the idle replica holds its device memory like any other

        ep = deploy(api, "pooled", "tiny", public=True)
        view = endpoint(api, ep)
        assert view["model_files_from"] == "warm pool"
        (replica,) = view["replicas"]["items"]
        assert replica["pid"] == warm_pid and replica["devices"]
        reply = platform.openai().chat.completions.create(
            model="pooled", messages=MESSAGES, max_tokens=4, temperature=0
        )
        assert reply.model == "pooled" and reply.usage.completion_tokens == 4
        # The pool starts a replacement in the background.
        wait_for(lambda: idle() == 1, 120, "the warm pool to refill")
        assert len(platform.worker_pids()) == 2
    finally:
        platform.stop()
