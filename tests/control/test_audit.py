"""The audit log through a real `modelyard serve`, in both platform modes (SQLite; PostgreSQL and
Redis): every kind of change leaves a row with who, what and before/after; a tenant reads only
its own rows, the platform admin all; the CSV export is the JSON's rows; no key or webhook secret
ever reaches a row; bad filters are refused naming the field."""

from __future__ import annotations

import csv
import io
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.control.audit import REDACTED, scrub
from modelyard.registry_client import RegistryClient
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    wait_status,
)


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
    platform_env: dict[str, str],
) -> Iterator[PlatformProcess]:
    env = {**platform_env, **tiny_models_env(models_dir)}
    p = PlatformProcess(tmp_path_factory.mktemp("audit-data"), env).start()
    try:
        yield p
    finally:
        p.stop()


@dataclass
class History:
    """One tenant's changes of every kind, made through the API; what the tests look for."""

    tenant_id: str
    admin_key: dict[str, Any]  # the tenant's admin key as created (with its secret)
    other_key: dict[str, Any]
    endpoint_id: str
    model: str
    version_ids: list[str]
    webhook_secrets: list[str] = field(default_factory=list)


def audit(api: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    """Every event the caller may see (newest first), read page by page through `after`."""
    events: list[dict[str, Any]] = []
    after = None
    while True:
        r = api.get(
            "/v1/audit", params={**params, "limit": 50, **({"after": after} if after else {})}
        )
        assert r.status_code == 200, r.text
        page = r.json()
        events += page["data"]
        if not page["has_more"]:
            return events
        after = page["last_id"]


def only(events: list[dict[str, Any]], action: str, target_id: str) -> dict[str, Any]:
    found = [e for e in events if e["action"] == action and e["target_id"] == target_id]
    assert len(found) == 1, (action, target_id, [(e["action"], e["target_id"]) for e in events])
    return found[0]


@pytest.fixture(scope="module")
def history(platform: PlatformProcess, models_dir: Path) -> History:
    admin = platform.api()
    ns = uuid.uuid4().hex[:8]
    tenant_id = create_tenant(admin, f"audited-{ns}")
    r = admin.patch(f"/v1/tenants/{tenant_id}", json={"tier": "priority", "max_endpoints": 5})
    assert r.status_code == 200, r.text
    admin_key = create_key(admin, tenant_id, name="ops", scopes=["admin", "inference"])
    api = platform.api(admin_key["key"])
    other = create_key(api, name="app", scopes=["inference"])
    assert api.patch(f"/v1/keys/{other['id']}", json={"rpm_limit": 100}).status_code == 200
    secrets = [api.get("/v1/webhooks/secret").json()["secret"]]
    secrets.append(api.post("/v1/webhooks/secret/rotate").json()["secret"])

    model = f"reg-{ns}"
    registry = RegistryClient(platform.url, admin_key["key"])
    pushed = [registry.push(models_dir / "tiny", model) for _ in range(2)]
    endpoint_id = deploy(api, f"ep-{ns}", f"{model}:1", hardware={"max_replicas": 2})
    # The versions verbs: a canary (not waited for: traffic and rollback need no replica of it).
    r = api.post(f"/v1/endpoints/{endpoint_id}/versions",
                 json={"model_artifact": f"{model}:2", "weight": 10})  # fmt: skip
    assert r.status_code == 201, r.text
    v1, v2 = (str(p["id"]) for p in pushed)
    r = api.patch(f"/v1/endpoints/{endpoint_id}/traffic", json={"weights": {v1: 50, v2: 50}})
    assert r.status_code == 200, r.text
    r = api.post(f"/v1/endpoints/{endpoint_id}/rollback", json={"reason": "audit test"})
    assert r.status_code == 200, r.text
    r = api.patch(f"/v1/endpoints/{endpoint_id}", json={"model_artifact": f"{model}:2"})
    assert r.status_code == 202, r.text
    # Deleted while the rollout's replica loads: the rows do not wait for it.
    assert api.delete(f"/v1/endpoints/{endpoint_id}").status_code == 202
    # The model the endpoint ran: in use (409) while the endpoint drains, free once it is
    # deleted (the deleted endpoint's row still names the version it ran).
    r = api.delete(f"/v1/registry/models/{model}")
    assert r.status_code in (200, 409), r.text
    wait_status(api, endpoint_id, "gone")
    assert api.delete(f"/v1/registry/models/{model}").status_code == 200
    assert api.delete(f"/v1/keys/{other['id']}").status_code == 200
    return History(
        tenant_id=tenant_id,
        admin_key=admin_key,
        other_key=other,
        endpoint_id=endpoint_id,
        model=model,
        version_ids=[str(p["id"]) for p in pushed],
        webhook_secrets=secrets,
    )


def test_every_kind_of_change_leaves_a_row(platform: PlatformProcess, history: History) -> None:
    h = history
    events = audit(platform.api(h.admin_key["key"]))
    assert all(e["tenant_id"] == h.tenant_id for e in events)
    ids = [e["id"] for e in events]
    assert ids == sorted(ids, reverse=True)  # newest first

    system_keys = platform.api().get("/v1/keys").json()["data"]
    admin_key_id = next(k["id"] for k in system_keys if k["name"] == "bootstrap admin")
    created = only(events, "tenant.create", h.tenant_id)
    assert created["before"] is None and created["after"]["name"].startswith("audited-")
    assert created["actor_key_id"] == admin_key_id
    updated = only(events, "tenant.update", h.tenant_id)
    assert updated["before"]["tier"] == "standard" and updated["after"]["tier"] == "priority"
    assert updated["before"]["max_endpoints"] is None and updated["after"]["max_endpoints"] == 5

    key = only(events, "api_key.create", h.admin_key["id"])
    assert key["after"]["prefix"] == h.admin_key["prefix"] and key["actor_key_id"] == admin_key_id
    by_tenant = only(events, "api_key.create", h.other_key["id"])
    assert by_tenant["actor_key_id"] == h.admin_key["id"]
    assert by_tenant["actor_tenant_id"] == h.tenant_id
    limits = only(events, "api_key.update", h.other_key["id"])
    assert limits["before"]["rpm_limit"] is None and limits["after"]["rpm_limit"] == 100
    revoked = only(events, "api_key.revoke", h.other_key["id"])
    assert revoked["before"]["revoked_at"] is None and revoked["after"]["revoked_at"] is not None

    rotated = only(events, "tenant.webhook_secret_rotate", h.tenant_id)
    assert rotated["after"]["format"] == "standard-webhooks"
    for version_id, n in zip(h.version_ids, (1, 2), strict=True):
        pushed = only(events, "model_version.push", version_id)
        assert pushed["after"]["ref"] == f"{h.model}:{n}"
    deleted_model = only(events, "model.delete", h.model)
    assert [v["version"] for v in deleted_model["before"]["versions"]] == [1, 2]

    deployed = only(events, "endpoint.deploy", h.endpoint_id)
    assert deployed["before"] is None
    assert deployed["after"]["model_artifact"] == f"{h.model}:1"
    assert "replicas" not in deployed["after"]  # configuration, not what moves on its own
    rollout = only(events, "endpoint.rollout", h.endpoint_id)
    assert rollout["before"]["version_id"] == h.version_ids[0]
    assert rollout["after"]["model_artifact"] == f"{h.model}:2"
    v1, v2 = h.version_ids
    canary = only(events, "endpoint.version_add", h.endpoint_id)
    assert canary["before"]["traffic"] == {} and canary["after"]["traffic"] == {v1: 90, v2: 10}
    split = only(events, "endpoint.traffic", h.endpoint_id)
    assert split["after"]["traffic"] == {v1: 50, v2: 50}
    back = only(events, "endpoint.rollback", h.endpoint_id)
    assert back["after"]["last_rollback"]["reason"] == "audit test"
    assert back["after"]["last_rollback"]["to_version_id"] == v1
    gone = only(events, "endpoint.delete", h.endpoint_id)
    assert gone["before"]["model_artifact"] == f"{h.model}:2" and gone["after"] is None


def test_a_tenant_sees_only_its_rows_and_the_platform_admin_all(
    platform: PlatformProcess, history: History
) -> None:
    admin = platform.api()
    intruder = create_tenant(admin, f"other-{uuid.uuid4().hex[:8]}")
    intruder_key = create_key(admin, intruder, scopes=["admin", "inference"])
    b = platform.api(intruder_key["key"])
    create_key(b, name="b-own")
    seen = audit(b)
    assert seen and {e["tenant_id"] for e in seen} == {intruder}
    assert history.tenant_id not in json.dumps(seen)
    # Naming the other tenant is refused, not silently answered with its own rows.
    assert b.get("/v1/audit", params={"tenant_id": history.tenant_id}).status_code == 404
    assert b.get("/v1/audit.csv", params={"tenant_id": history.tenant_id}).status_code == 404
    inference_only = create_key(b, name="b-app", scopes=["inference"])
    assert platform.api(inference_only["key"]).get("/v1/audit").status_code == 403

    everything = audit(admin)
    assert {history.tenant_id, intruder} <= {e["tenant_id"] for e in everything}
    one = audit(admin, tenant_id=history.tenant_id)
    assert one == audit(platform.api(history.admin_key["key"]))


def test_csv_export_is_the_json_rows(platform: PlatformProcess, history: History) -> None:
    api = platform.api(history.admin_key["key"])
    events = audit(api)
    for r in (api.get("/v1/audit.csv"), api.get("/v1/audit", params={"format": "csv"})):
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(r.text)))
        assert [int(row["id"]) for row in rows] == [e["id"] for e in events]
        for row, e in zip(rows, events, strict=True):
            assert row["action"] == e["action"] and row["target_id"] == e["target_id"]
            assert int(row["at"]) == e["at"] and row["actor_key_id"] == e["actor_key_id"]
            for side in ("before", "after"):
                assert (json.loads(row[side]) if row[side] else None) == e[side]
    # Filters and the row cap apply to the export as to the list.
    r = api.get("/v1/audit.csv", params={"action": "api_key.create", "limit": 1})
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 1 and rows[0]["action"] == "api_key.create"


def test_no_secret_ever_reaches_a_row(platform: PlatformProcess, history: History) -> None:
    admin = platform.api()
    everything = json.dumps(audit(admin)) + admin.get("/v1/audit.csv").text
    secrets = [history.admin_key["key"], history.other_key["key"], *history.webhook_secrets]
    for secret in secrets:
        assert secret not in everything
    assert not re.search(r"sk-my-[A-Za-z0-9_-]{5}", everything)  # a prefix is 4 long
    assert "whsec_" not in everything
    assert platform.admin_key not in everything


def test_scrub_drops_secret_fields_and_redacts_secret_shaped_text() -> None:
    view = {
        "id": "key-1",
        "key": "sk-my-" + "a" * 43,
        "prefix": "sk-my-abcd",
        "nested": [{"webhook_secret": "whsec_abc", "note": "was sk-my-" + "b" * 43 + "!"}],
    }
    assert scrub(view) == {
        "id": "key-1",
        "prefix": "sk-my-abcd",
        "nested": [{"note": f"was {REDACTED}!"}],
    }


def test_filters_and_their_refusals(platform: PlatformProcess, history: History) -> None:
    api = platform.api(history.admin_key["key"])
    keys = audit(api, target_type="api_key")
    assert keys and {e["target_type"] for e in keys} == {"api_key"}
    revokes = audit(api, action="api_key.revoke")
    assert [e["target_id"] for e in revokes] == [history.other_key["id"]]
    first = min(e["at"] for e in audit(api))
    assert audit(api, until=first - 1) == []
    assert len(audit(api, since=first)) == len(audit(api))
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(first + 3600))
    assert len(audit(api, until=iso)) == len(audit(api))
    for params, param in (
        ({"action": "DROP TABLE"}, "action"),
        ({"target_type": "x" * 90}, "target_type"),
        ({"since": "yesterday"}, "since"),
        ({"since": first + 10, "until": first}, "since"),
        ({"limit": 0}, "limit"),
        ({"limit": 5000}, "limit"),
        ({"after": "abc"}, "after"),
        ({"after": str(2**70)}, "after"),
        ({"target_id": "ep\x00"}, "target_id"),
        ({"tenant_id": "tn\x00"}, "tenant_id"),
        ({"format": "xml"}, "format"),
    ):
        r = api.get("/v1/audit", params=params)
        assert r.status_code == 400, (params, r.text)
        assert param in (r.json()["error"].get("param") or "") + r.json()["error"]["message"]
