"""API keys that expire, rotate and are scoped to models (issue 28, item 3), through a real
`modelyard serve` once per platform mode (SQLite with limits in memory; PostgreSQL with limits
in Redis): an expired key is a 401 `key_expired`; a rotated key's old secret works for its grace
period and then stops; a key limited to one model gets 403 `model_not_allowed` on another, on
every inference route and on a batch line, and sees only its models in /v1/models; its last use
is recorded; an expired key's running batch stops; each change is audited, without secrets; bad
fields are refused at the edge."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    platform_running,
    read_jsonl,
    tiny_models_env,
    wait_batch,
)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def tenant_admin(platform: PlatformProcess, models_dir: Path) -> httpx.Client:
    """A tenant's admin, with two private models: `tiny` (served) and `other` (deployed, never
    waited for: it need not be up to be refused)."""
    admin = platform.api()
    tenant = create_tenant(admin, f"keys-{time.time_ns()}")
    api = platform.api(create_key(admin, tenant, scopes=["admin", "inference"])["key"])
    deploy(api, "tiny", str(models_dir / "tiny"))
    deploy(api, "other", str(models_dir / "tiny"), wait=False)
    return api


def poll(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def chat(platform: PlatformProcess, key: str, model: str = "tiny") -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 1}
    return platform.api(key).post("/v1/chat/completions", json=body)


def error_code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def iso(dt: datetime) -> str:
    return dt.isoformat()


def audit_actions(api: httpx.Client, key_id: str) -> list[dict[str, Any]]:
    r = api.get("/v1/audit", params={"target_id": key_id})
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def test_fields_are_checked_at_the_edge(tenant_admin: httpx.Client) -> None:
    past = iso(datetime.now(UTC) - timedelta(minutes=1))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"expires_at": "next tuesday"}, "expires_at"),
        ({"expires_at": past}, "expires_at"),  # a new key that could never work
        ({"expires_at": "9999-12-31T23:59:00-05:00"}, "expires_at"),  # no database reads it back
        ({"allowed_models": []}, "allowed_models"),
        ({"allowed_models": ["a"] * 101}, "allowed_models"),
        ({"allowed_models": ["x" * 201]}, "allowed_models"),
        ({"allowed_models": ["no spaces"]}, "allowed_models"),
        ({"allowed": ["tiny"]}, "allowed"),
        ({"rpm_limit": True}, "rpm_limit"),  # not 1 request a minute
        ({"tpm_limit": True}, "tpm_limit"),
    ]
    for body, param in bad:
        r = tenant_admin.post("/v1/keys", json={"name": "bad", **body})
        assert r.status_code == 400, (body, r.text)
        assert param in r.text, (body, r.text)
    key = create_key(tenant_admin)
    for grace in (-1, True):  # `true` is not 1 s
        r = tenant_admin.post(f"/v1/keys/{key['id']}/rotate", json={"grace_period_seconds": grace})
        assert r.status_code == 400 and "grace_period_seconds" in r.text, r.text
    r = tenant_admin.patch(f"/v1/keys/{key['id']}", json={"rpm_limit": True})
    assert r.status_code == 400 and "rpm_limit" in r.text, r.text
    r = tenant_admin.post(f"/v1/keys/{key['id']}/rotate", json={"grace": 10})
    assert r.status_code == 400 and "grace" in r.text, r.text


def test_an_expired_key_is_refused(platform: PlatformProcess, tenant_admin: httpx.Client) -> None:
    later = iso(datetime.now(UTC) + timedelta(hours=1))
    key = create_key(tenant_admin, expires_at=later)
    assert key["expires_at"] == int(datetime.fromisoformat(later).timestamp())
    assert chat(platform, key["key"]).status_code == 200
    # An admin expires it now: this gateway stops it at once (its cache is told).
    r = tenant_admin.patch(f"/v1/keys/{key['id']}", json={"expires_at": int(time.time()) - 1})
    assert r.status_code == 200, r.text
    r = chat(platform, key["key"])
    assert r.status_code == 401 and error_code(r) == "key_expired", r.text
    assert "expired" in r.json()["error"]["message"]
    # A key whose time runs out while its lookup is cached stops all the same.
    soon = create_key(tenant_admin, expires_at=iso(datetime.now(UTC) + timedelta(seconds=3)))
    statuses: list[int] = []

    def refused() -> bool:
        statuses.append(platform.api(soon["key"]).get("/v1/models").status_code)
        return statuses[-1] == 401

    poll(refused, "the key to expire")
    assert set(statuses) <= {200, 401}, statuses
    # Extending it brings it back; the audit log has each expiry change.
    r = tenant_admin.patch(f"/v1/keys/{key['id']}", json={"expires_at": None})
    assert r.status_code == 200 and r.json()["expires_at"] is None, r.text
    assert chat(platform, key["key"]).status_code == 200
    actions = [e["action"] for e in audit_actions(tenant_admin, key["id"])]
    assert actions.count("api_key.expiry_change") == 2 and "api_key.create" in actions


def test_a_rotated_key_works_through_its_grace_period_then_stops(
    platform: PlatformProcess, tenant_admin: httpx.Client
) -> None:
    key = create_key(tenant_admin)
    r = tenant_admin.post(f"/v1/keys/{key['id']}/rotate", json={"grace_period_seconds": 3600})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["key"] != key["key"] and first["prefix"] != key["prefix"]
    assert first["previous_key_expires_at"] >= time.time() + 3500
    for secret in (key["key"], first["key"]):  # both work during the grace period
        assert chat(platform, secret).status_code == 200
    # A second rotation with a short grace: the oldest secret stops at once, the one it replaces
    # when its grace ends.
    r = tenant_admin.post(f"/v1/keys/{key['id']}/rotate", json={"grace_period_seconds": 2})
    assert r.status_code == 200, r.text
    second = r.json()
    assert chat(platform, second["key"]).status_code == 200
    r = chat(platform, key["key"])
    assert r.status_code == 401 and error_code(r) == "invalid_api_key", r.text

    def first_stopped() -> bool:
        return platform.api(first["key"]).get("/v1/models").status_code == 401

    poll(first_stopped, "the replaced secret's grace to end")
    r = chat(platform, first["key"])
    assert r.status_code == 401 and error_code(r) == "key_expired", r.text
    assert "rotated" in r.json()["error"]["message"]
    assert chat(platform, second["key"]).status_code == 200
    # Audited twice, and no secret in the log.
    events = audit_actions(tenant_admin, key["id"])
    assert [e["action"] for e in events].count("api_key.rotate") == 2
    text = str(events)
    assert all(s["key"] not in text for s in (key, first, second))


def test_a_key_limited_to_one_model(platform: PlatformProcess, tenant_admin: httpx.Client) -> None:
    key = create_key(tenant_admin, allowed_models=["ti*"])
    assert key["allowed_models"] == ["ti*"] and key["last_used_at"] is None
    api = platform.api(key["key"])
    assert [m["id"] for m in api.get("/v1/models").json()["data"]] == ["tiny"]
    assert {m["id"] for m in tenant_admin.get("/v1/models").json()["data"]} >= {"tiny", "other"}
    assert chat(platform, key["key"]).status_code == 200
    refusals = [
        chat(platform, key["key"], "other"),
        api.post("/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 1}),
        api.post("/v1/embeddings", json={"model": "other", "input": "hi"}),
        api.get("/v1/models/other"),
        api.post("/v2/models/other/infer", json={"inputs": []}),
        chat(platform, key["key"], "no-such-model"),  # refused before it is looked up
    ]
    for r in refusals:
        assert r.status_code == 403, (r.request.url, r.text)
        assert "not allowed to use the model" in r.text, r.text  # the OIP's shape has no code
    assert error_code(refusals[0]) == "model_not_allowed"
    # A batch runs under its key's list: the line naming another model fails on its own.
    client = platform.openai(key["key"])
    lines = [batch_line("ok", max_tokens=1), batch_line("not-allowed", model="other")]
    upload = client.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, {"completed", "failed"})
    assert [o["custom_id"] for o in read_jsonl(client, done.output_file_id)] == ["ok"]
    errors = read_jsonl(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("not-allowed", "model_not_allowed")
    ]
    # The key's last use is recorded; widening its list is audited and takes effect at once.
    seen = tenant_admin.get(f"/v1/keys/{key['id']}").json()
    assert seen["last_used_at"] is not None and seen["last_used_at"] >= key["created_at"]
    r = tenant_admin.patch(f"/v1/keys/{key['id']}", json={"allowed_models": None})
    assert r.status_code == 200 and r.json()["allowed_models"] is None, r.text
    assert {m["id"] for m in api.get("/v1/models").json()["data"]} >= {"tiny", "other"}
    actions = [e["action"] for e in audit_actions(tenant_admin, key["id"])]
    assert "api_key.allowed_models_change" in actions


def test_a_batch_stops_when_its_key_expires(
    platform: PlatformProcess, tenant_admin: httpx.Client
) -> None:
    key = create_key(tenant_admin)
    reader = platform.openai(tenant_admin.headers["authorization"].split()[1])
    client = platform.openai(key["key"])
    lines = [batch_line(f"r-{i}", max_tokens=40, ignore_eos=True) for i in range(200)]
    upload = client.files.create(file=("r.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    poll(lambda: reader.batches.retrieve(batch.id).request_counts.completed >= 1, "an item")
    r = tenant_admin.patch(f"/v1/keys/{key['id']}", json={"expires_at": int(time.time()) - 1})
    assert r.status_code == 200, r.text
    done = wait_batch(reader, batch.id, {"cancelled", "completed", "failed"})
    assert done.status == "cancelled", done
    assert done.errors is not None and done.errors.data[0].code == "api_key_revoked"
    assert 1 <= done.request_counts.completed < 200
