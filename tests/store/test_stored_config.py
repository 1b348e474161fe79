"""Nothing a tenant admin stores can stop the platform from starting (issue 27, finding 2).

A deploy's or PATCH's configuration is parsed whole before anything is written: a bad `scaling`
block is a 400 that leaves no row. A row that no longer parses anyway (written by an older
version, or by hand) is marked failed with why when `modelyard serve` starts, and the platform
starts and serves the others. Both store modes; real `modelyard serve` processes throughout.
JSON bodies nested deeper than the bound are a 400 on every kind of route.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from modelyard.store import repository as repo
from modelyard.store.tables import Endpoint
from tests.cluster_harness import RoleProcess, wait_leader
from tests.databases import fresh_postgres, fresh_redis, postgres_unreachable, skip_or_fail
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    wait_status,
)

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")

MODEL = "tiny"
# What stopped every start before: one stored endpoint each, written straight to the database.
BAD_ROWS = {
    "boom": {"scaling": {"panic_threshold": "boom"}},
    "junk-hardware": {"hardware": "junk"},
    "bad-engine": {"engine_options": {"max_num_seqs": "many"}},
    "bad-replicas": {"hardware": {"min_replicas": 3, "max_replicas": 1}},
    # the Ray backend reads it as a `Workload` to choose a node class: "boom" raised there
    "bad-workload": {"hardware": {"min_replicas": 1, "workload": "boom"}},
}


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, platform_env: dict[str, str]
) -> Iterator[PlatformProcess]:
    env = {**platform_env, **tiny_models_env(models_dir)}
    p = PlatformProcess(tmp_path_factory.mktemp("stored-config"), env).start()
    try:
        yield p
    finally:
        p.stop()


def _database_url(p: PlatformProcess) -> str:
    return p.env.get("MODELYARD_DATABASE_URL") or f"sqlite:///{p.data_dir / 'modelyard.db'}"


def _endpoint_rows(p: PlatformProcess) -> int:
    engine = create_engine(_database_url(p))
    try:
        with Session(engine) as s:
            return int(s.scalar(select(func.count()).select_from(Endpoint)) or 0)
    finally:
        engine.dispose()


def _insert_bad_rows(database_url: str, tenant_id: str, artifact: str) -> None:
    """Rows written straight to the database, as an older version or a hand edit could leave."""
    engine = create_engine(database_url)
    try:
        with Session(engine) as s, s.begin():
            for name, fields in BAD_ROWS.items():
                row = {
                    "hardware": {"min_replicas": 1, "max_replicas": 1},
                    "scaling": {"metric": "concurrency"},
                    "engine_options": {},
                    **fields,
                }
                s.add(
                    Endpoint(
                        id=f"ep-stored-{name}", tenant_id=tenant_id, model_name=name,
                        public=False, artifact=artifact, version_id=None, framework="native",
                        sampling_defaults={}, status="ready", status_message=None,
                        created_at=repo.now(), deleted_at=None, **row,
                    )
                )  # fmt: skip
    finally:
        engine.dispose()


def _restart(p: PlatformProcess) -> None:
    """Stop serve and start it again on the same data directory and database; it must start."""
    p.stop()
    p.start(timeout=120)


def test_a_bad_scaling_block_is_a_400_that_leaves_nothing(
    platform: PlatformProcess, models_dir: Path
) -> None:
    api = platform.api()
    tenant_id = create_tenant(api, "scaling-tenant")
    admin = platform.api(create_key(api, tenant_id, scopes=["admin", "inference"])["key"])
    before = _endpoint_rows(platform)
    artifact = str(models_dir / MODEL)
    for scaling in (
        {"panic_threshold": "boom"},  # the original: a 500 that left a live, unlisted row
        {"panic_threshold": 0.5},  # below 1: a panic every tick
        {"stable_window_seconds": -1},
        {"no_such_key": 1},  # unknown fields are refused, not stored
        {"target_value": 1e308},
    ):
        body = {"model_name": "boom", "model_artifact": artifact, "scaling": scaling}
        r = admin.post("/v1/models/deploy", json=body)
        assert r.status_code == 400, (scaling, r.status_code, r.text)
        assert r.json()["error"]["param"].startswith("scaling."), r.text
    assert _endpoint_rows(platform) == before
    assert admin.get("/v1/endpoints").json()["data"] == []

    # A bad PATCH changes nothing, so a later valid one cannot persist it either.
    fast = {"stable_window_seconds": 2, "panic_window_seconds": 1, "scale_down_delay_seconds": 1}
    endpoint_id = deploy(admin, MODEL, artifact, scaling=fast)
    bad = admin.patch(f"/v1/endpoints/{endpoint_id}", json={"scaling": {"panic_threshold": "x"}})
    assert bad.status_code == 400, bad.text
    ok = admin.patch(f"/v1/endpoints/{endpoint_id}", json={"sampling_defaults": {"top_p": 0.9}})
    assert ok.status_code == 202, ok.text
    view = admin.get(f"/v1/endpoints/{endpoint_id}").json()
    assert (
        view["scaling"]["panic_threshold"] == 2.0 and view["scaling"]["stable_window_seconds"] == 2
    )

    _restart(platform)
    admin = platform.api(admin.headers["authorization"].removeprefix("Bearer "))
    wait_status(admin, endpoint_id, "ready")
    r = admin.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


@pytest.mark.timeout(300)  # serve started twice over bad rows: 110 s on a busy 2 vCPU
def test_serve_starts_over_stored_endpoints_that_no_longer_parse(
    platform: PlatformProcess, models_dir: Path
) -> None:
    api = platform.api()
    tenant_id = create_tenant(api, "stored-tenant")
    key = create_key(api, tenant_id, scopes=["admin", "inference"])["key"]
    good = deploy(platform.api(key), "good", str(models_dir / MODEL))
    _insert_bad_rows(_database_url(platform), tenant_id, str(models_dir / MODEL))

    _restart(platform)  # raised "Application startup failed" on the first of them
    admin = platform.api(key)
    listed = {e["endpoint_id"]: e for e in admin.get("/v1/endpoints").json()["data"]}
    for name in BAD_ROWS:
        view = listed[f"ep-stored-{name}"]
        assert view["status"] == "failed", view
        assert "stored configuration is invalid" in view["status_message"], view
    assert "scaling.panic_threshold" in listed["ep-stored-boom"]["status_message"]
    assert "engine.max_num_seqs" in listed["ep-stored-bad-engine"]["status_message"]
    assert "hardware.workload" in listed["ep-stored-bad-workload"]["status_message"]
    # Requests for them are refused at once, naming no internals; the good one serves.
    r = admin.post(
        "/v1/chat/completions",
        json={"model": "boom", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 503, r.text
    wait_status(admin, good, "ready")
    r = admin.post(
        "/v1/chat/completions",
        json={"model": "good", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    # Nothing changes them but a delete: a PATCH names why they were not started.
    r = admin.patch("/v1/endpoints/ep-stored-boom", json={"scaling": {"metric": "concurrency"}})
    assert r.status_code == 400 and "not started" in r.text, r.text
    # Their owner deletes them like any endpoint; the next start is clean.
    for name in BAD_ROWS:
        assert admin.delete(f"/v1/endpoints/ep-stored-{name}").status_code == 202
        wait_status(admin, f"ep-stored-{name}", "gone")
    _restart(platform)
    left = {e["endpoint_id"] for e in platform.api(key).get("/v1/endpoints").json()["data"]}
    assert left == {good}


@pytest.mark.timeout(300)  # two controllers and a takeover: 105 s on a busy 2 vCPU
def test_a_standby_controller_takes_over_over_stored_endpoints_that_no_longer_parse(
    tmp_path: Path, models_dir: Path
) -> None:
    """Cluster mode: the leader adopts the rows at its takeover; before, every standby died on
    the first bad one in turn."""
    reason = postgres_unreachable()
    if reason:
        skip_or_fail(reason)
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        env = {
            **tiny_models_env(models_dir),
            "MODELYARD_DATABASE_URL": database_url,
            "MODELYARD_REDIS_URL": redis_url,
            "MODELYARD_DEFAULT_MODELS": "false",
            "MODELYARD_CONTROLLER_LEASE_S": "3",
        }
        first, second = (RoleProcess("controller", tmp_path / "control", env) for _ in "ab")
        try:
            first.start()
            assert wait_leader(redis_url, [first]) is first
            engine = create_engine(database_url)
            try:
                with Session(engine) as s, s.begin():
                    tenant_id = repo.create_tenant(s, "stored-cluster", None).id
            finally:
                engine.dispose()
            _insert_bad_rows(database_url, tenant_id, str(models_dir / MODEL))
            second.start()
            first.kill()  # the standby takes over, and adopts the rows
            assert wait_leader(redis_url, [second]) is second
            deadline = time.monotonic() + 60
            while (failed := _statuses(database_url)) != {n: "failed" for n in BAD_ROWS}:
                assert second.proc is not None and second.proc.poll() is None, second.output()
                assert time.monotonic() < deadline, (failed, second.output()[-4000:])
                time.sleep(0.2)
            assert httpx.get(f"{second.url}/health", timeout=10).status_code == 200
        finally:
            for p in (first, second):
                p.kill(signal.SIGTERM)


def _statuses(database_url: str) -> dict[str, str]:
    engine = create_engine(database_url)
    try:
        with Session(engine) as s:
            rows = s.scalars(select(Endpoint).where(Endpoint.id.like("ep-stored-%")))
            return {r.model_name: r.status for r in rows}
    finally:
        engine.dispose()


def _nested(depth: int, leaf: object) -> object:
    for _ in range(depth):
        leaf = {"type": "object", "properties": {"a": leaf}}
    return leaf


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": _nested(150, {})}}},
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
             "tools": [{"type": "function",
                        "function": {"name": "f", "parameters": _nested(150, {})}}]},
        ),
        ("/v1/models/deploy",
         {"model_name": "x", "model_artifact": "y", "engine": _nested(150, 1)}),
        ("/v1/tenants", {"name": _nested(150, 1)}),
    ],
    ids=["response_format", "tools", "deploy", "tenants"],
)  # fmt: skip
def test_deeply_nested_bodies_are_a_400(platform: PlatformProcess, path: str, body: object) -> None:
    """150 levels: under what the JSON parsers take (1,024), over what orjson writes (255 with
    the schema's own levels): a 500 from the gateway's copy for the worker before."""
    r = httpx.post(
        f"{platform.url}{path}",
        content=json.dumps(body),
        headers={
            "authorization": f"Bearer {platform.admin_key}",
            "content-type": "application/json",
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "levels" in r.text, r.text
    assert platform.api().get("/health").status_code == 200
