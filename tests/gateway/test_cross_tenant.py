"""Tenant isolation, route by route: another tenant's admin key on every route that takes a
resource id (derived from the served OpenAPI schema, so a new such route fails this test until
it is covered) gets 404 or 403, never the resource, and changes nothing."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
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
    usage_rows,
    wait_batch,
    wait_status,
    wait_usage,
)

MESSAGES = [{"role": "user", "content": "Hello there"}]
FAST = {"stable_window_seconds": 2, "panic_window_seconds": 1, "scale_down_delay_seconds": 1}
REFUSED = {403, 404}


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
    platform_env: dict[str, str],
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


class Victim:
    """Tenant A with one of everything a route can name."""

    def __init__(self, platform: PlatformProcess, models_dir: Path) -> None:
        admin = platform.api()
        ns = uuid.uuid4().hex[:8]
        self.name = f"victim-{ns}"
        self.id = create_tenant(admin, self.name, quota=10**7)
        self.admin_key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.key = create_key(admin, self.id, name=f"victim-key-{ns}", scopes=["inference"])
        self.api = platform.api(self.admin_key)
        self.client = platform.openai(self.admin_key)
        tiny = str(models_dir / "tiny")

        # A registry model (pushed with the CLI), deployed by reference as a private endpoint.
        self.reg_name = f"vreg-{ns}"
        cmd = [sys.executable, "-m", "modelyard.cli", "models", "push", tiny, "--name",
               self.reg_name, "--url", platform.url, "--api-key", self.admin_key]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        model = self.api.get(f"/v1/registry/models/{self.reg_name}").json()
        self.blob_sha = model["versions"][0]["files"]["config.json"]["sha256"]
        self.model_name = f"vpriv-{ns}"
        self.endpoint = deploy(self.api, self.model_name, f"{self.reg_name}:1")

        # A private endpoint scaled to zero, so a request can be answered asynchronously.
        self.cold_name = f"vcold-{ns}"
        self.cold = deploy(
            self.api, self.cold_name, tiny, wait=False,
            hardware={"min_replicas": 0, "max_replicas": 1},
            scaling={"metric": "concurrency", "target_value": 4, "scale_to_zero": True,
                     "scale_to_zero_after_idle_seconds": 2, **FAST},
        )  # fmt: skip
        wait_status(self.api, self.cold, "scaled_to_zero", timeout=90)
        r = self.api.post(
            "/v1/chat/completions",
            json={"model": self.cold_name, "messages": MESSAGES, "max_tokens": 2},
            headers={"prefer": "respond-async"},
        )
        assert r.status_code == 202, r.text
        self.async_id = str(r.json()["id"])

        # A file, and a finished batch with its output file.
        self.secret = f"secret-content-{ns}"
        self.filename = f"secret-{ns}.jsonl"
        data = jsonl([batch_line("v-1", self.secret, model=self.model_name, max_tokens=2)])
        self.file = self.client.files.create(
            file=(self.filename, io.BytesIO(data)), purpose="batch"
        ).id
        batch = self.client.batches.create(
            input_file_id=self.file, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(self.client, batch.id, {"completed", "failed"})
        assert done.status == "completed" and done.output_file_id, done
        self.batch = batch.id
        self.output_file = done.output_file_id
        self.output = read_jsonl(self.client, self.output_file)
        assert len(self.output) == 1

        # A user in a team, and a key of that user.
        self.email = f"victim-{ns}@example.com"
        self.user = self.api.post("/v1/users", json={"email": self.email}).json()
        self.team = self.api.post("/v1/teams", json={"name": f"vteam-{ns}"}).json()
        r = self.api.post(f"/v1/teams/{self.team['id']}/members", json={"user_id": self.user["id"]})
        assert r.status_code == 200, r.text
        create_key(self.api, name=f"vuser-key-{ns}", owner_user_id=self.user["id"])

        # A price on its endpoint, and budgets on the tenant and on its team.
        r = self.api.put(f"/v1/prices/{self.endpoint}", json={"input_usd_per_million": "1.5"})
        assert r.status_code == 200, r.text
        r = admin.post("/v1/budgets", json={"scope": "tenant", "limit_usd": "1000",
                                            "tenant_id": self.id})  # fmt: skip
        assert r.status_code == 201, r.text
        self.budget = r.json()["id"]
        r = self.api.post("/v1/budgets", json={"scope": "team", "subject_id": self.team["id"],
                                               "limit_usd": "1000"})  # fmt: skip
        assert r.status_code == 201, r.text

        self.client.chat.completions.create(model=self.model_name, messages=MESSAGES, max_tokens=2)
        self.usage = wait_usage(self.api, lambda rows: len(rows) >= 2)

    def markers(self) -> list[str]:
        """Strings only tenant A's data holds: none may appear in an answer to tenant B."""
        return [self.name, self.key["name"], self.key["prefix"], self.secret, self.filename,
                self.email, self.team["name"],
                self.output[0]["response"]["body"]["id"], self.usage[0]["request_id"]]  # fmt: skip


class Prober:
    """Sends tenant B's requests and remembers which (method, path template) each covered."""

    def __init__(self, api: httpx.Client, victim: Victim) -> None:
        self.api = api
        self.victim = victim
        self.covered: set[tuple[str, str]] = set()
        self.count = 0

    def __call__(
        self,
        method: str,
        template: str,
        allowed: set[int] = REFUSED,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        **path: str,
    ) -> httpx.Response:
        url = template.format(**path)
        r = self.api.request(
            method, url, json=json_body, content=content, params=params, headers=headers
        )
        self.count += 1
        if "{" in template:
            self.covered.add((method.lower(), template))
        assert r.status_code in allowed, (method, url, r.status_code, r.text)
        sent = url + json.dumps(json_body) + json.dumps(params)
        for marker in self.victim.markers():
            if marker not in sent:
                assert marker not in r.text, (method, url, marker, r.text)
        return r


def templated_operations(platform: PlatformProcess) -> set[tuple[str, str]]:
    schema = httpx.get(f"{platform.url}/openapi.json", timeout=30).json()
    return {
        (method.lower(), path)
        for path, ops in schema["paths"].items()
        if re.search(r"\{[^}]+\}", path)
        for method in ops
        if method.lower() in {"get", "put", "post", "patch", "delete", "head"}
    }


def test_another_tenant_can_reach_nothing_by_id(
    platform: PlatformProcess, models_dir: Path
) -> None:
    v = Victim(platform, models_dir)
    admin = platform.api()
    b_id = create_tenant(admin, f"intruder-{uuid.uuid4().hex[:8]}")
    b_key = create_key(admin, b_id, scopes=["admin", "inference"])["key"]
    probe = Prober(platform.api(b_key), v)

    # Tenants.
    probe("GET", "/v1/tenants/{tenant_id}", tenant_id=v.id)
    probe("PATCH", "/v1/tenants/{tenant_id}", tenant_id=v.id,
          json_body={"monthly_token_quota": 1})  # fmt: skip
    listed = probe("GET", "/v1/tenants", {200}).json()["data"]
    assert [t["id"] for t in listed] == [b_id]
    # Keys.
    probe("GET", "/v1/keys/{key_id}", key_id=v.key["id"])
    probe("PATCH", "/v1/keys/{key_id}", key_id=v.key["id"], json_body={"rpm_limit": 1})
    probe("POST", "/v1/keys/{key_id}/rotate", key_id=v.key["id"],
          json_body={"grace_period_seconds": 0})  # fmt: skip
    probe("DELETE", "/v1/keys/{key_id}", key_id=v.key["id"])
    probe("GET", "/v1/keys", params={"tenant_id": v.id})
    probe("POST", "/v1/keys", json_body={"name": "steal", "tenant_id": v.id})
    assert v.key["id"] not in str(probe("GET", "/v1/keys", {200}).json())
    # Users and teams.
    b_user = probe.api.post("/v1/users", json={"email": f"b-{b_id}@example.com"}).json()["id"]
    b_team = probe.api.post("/v1/teams", json={"name": "b-team"}).json()["id"]
    probe("GET", "/v1/users/{user_id}", user_id=v.user["id"])
    probe("PATCH", "/v1/users/{user_id}", user_id=v.user["id"], json_body={"role": "admin"})
    probe("DELETE", "/v1/users/{user_id}", user_id=v.user["id"])
    probe("GET", "/v1/teams/{team_id}", team_id=v.team["id"])
    probe("DELETE", "/v1/teams/{team_id}", team_id=v.team["id"])
    probe("POST", "/v1/teams/{team_id}/members", team_id=v.team["id"],
          json_body={"user_id": b_user})  # fmt: skip
    probe("POST", "/v1/teams/{team_id}/members", team_id=b_team,
          json_body={"user_id": v.user["id"]})  # fmt: skip
    probe("DELETE", "/v1/teams/{team_id}/members/{user_id}", team_id=v.team["id"],
          user_id=v.user["id"])  # fmt: skip
    probe("POST", "/v1/keys", json_body={"name": "steal", "owner_user_id": v.user["id"]})
    probe("POST", "/v1/keys", json_body={"name": "steal", "owner_team_id": v.team["id"]})
    probe("GET", "/v1/users", params={"tenant_id": v.id})
    assert [u["id"] for u in probe("GET", "/v1/users", {200}).json()["data"]] == [b_user]
    assert [t["id"] for t in probe("GET", "/v1/teams", {200}).json()["data"]] == [b_team]
    # Prices and budgets.
    for model in (v.endpoint, v.model_name):
        probe("GET", "/v1/prices/{endpoint}", endpoint=model)
        probe("PUT", "/v1/prices/{endpoint}", endpoint=model,
              json_body={"input_usd_per_million": "0"})  # fmt: skip
    # An adapter's price: by the victim's registry name, for its tenant or the caller's own.
    for params in ({"tenant_id": v.id}, None):
        probe("GET", "/v1/prices/adapters/{name}", name=v.reg_name, params=params)
        probe("PUT", "/v1/prices/adapters/{name}", name=v.reg_name, params=params,
              json_body={"input_usd_per_million": "0"})  # fmt: skip
        probe("DELETE", "/v1/prices/adapters/{name}", name=v.reg_name, params=params)
    probe("GET", "/v1/budgets/{budget_id}", budget_id=v.budget)
    probe("PATCH", "/v1/budgets/{budget_id}", budget_id=v.budget, json_body={"limit_usd": "0"})
    probe("DELETE", "/v1/budgets/{budget_id}", budget_id=v.budget)
    probe("GET", "/v1/budgets", params={"tenant_id": v.id})
    probe("POST", "/v1/budgets", json_body={"scope": "tenant", "limit_usd": "0",
                                            "tenant_id": v.id})  # fmt: skip
    probe("POST", "/v1/budgets", json_body={"scope": "team", "subject_id": v.team["id"],
                                            "limit_usd": "0"})  # fmt: skip
    probe("POST", "/v1/budgets", json_body={"scope": "key", "subject_id": v.key["id"],
                                            "limit_usd": "0"})  # fmt: skip
    assert probe("GET", "/v1/budgets", {200}).json()["data"] == []
    # Usage.
    probe("GET", "/v1/usage", params={"tenant_id": v.id})
    probe("GET", "/v1/usage/export", params={"tenant_id": v.id})
    assert probe("GET", "/v1/usage", {200}).json()["data"] == []
    assert usage_rows(probe.api) == []
    # Endpoints and models.
    probe("GET", "/v1/endpoints/{endpoint_id}", endpoint_id=v.endpoint)
    probe("PATCH", "/v1/endpoints/{endpoint_id}", endpoint_id=v.endpoint,
          json_body={"model_artifact": f"{v.reg_name}:1"})  # fmt: skip
    probe("POST", "/v1/endpoints/{endpoint_id}/versions", endpoint_id=v.endpoint,
          json_body={"model_artifact": f"{v.reg_name}:1", "weight": 10})  # fmt: skip
    probe("PATCH", "/v1/endpoints/{endpoint_id}/traffic", endpoint_id=v.endpoint,
          json_body={"weights": {"1": 100}})  # fmt: skip
    probe("POST", "/v1/endpoints/{endpoint_id}/promote", endpoint_id=v.endpoint)
    probe("POST", "/v1/endpoints/{endpoint_id}/rollback", endpoint_id=v.endpoint)
    probe("DELETE", "/v1/endpoints/{endpoint_id}", endpoint_id=v.endpoint)
    assert v.endpoint not in str(probe("GET", "/v1/endpoints", {200}).json())
    for model in (v.model_name, v.endpoint, v.cold_name):
        probe("GET", "/v1/models/{model}", model=model)
        probe("POST", "/v1/chat/completions",
              json_body={"model": model, "messages": MESSAGES, "max_tokens": 2})  # fmt: skip
        probe("GET", "/v2/models/{model}", model=model)
        probe("GET", "/v2/models/{model}/ready", model=model)
        probe("POST", "/v2/models/{model}/infer", model=model, json_body={"inputs": []})
        probe("GET", "/v2/models/{model}/versions/{version}", model=model, version="1")
        probe("GET", "/v2/models/{model}/versions/{version}/ready", model=model, version="1")
        probe("POST", "/v2/models/{model}/versions/{version}/infer", model=model, version="1",
              json_body={"inputs": []})  # fmt: skip
    assert v.model_name not in str(probe("GET", "/v1/models", {200}).json())
    # The async answer.
    probe("GET", "/v1/async/{request_id}", request_id=v.async_id)
    # Registry: another tenant's model and version, and its blobs.
    probe("GET", "/v1/registry/models/{name}", name=v.reg_name)
    probe("DELETE", "/v1/registry/models/{name}", {403, 404, 409}, name=v.reg_name)
    assert probe("GET", "/v1/registry/models", {200}).json()["data"] == []
    probe("POST", "/v1/models/deploy", {400, 403, 404},
          json_body={"model_name": "stolen", "model_artifact": f"{v.reg_name}:1"})  # fmt: skip
    probe("HEAD", "/v1/blobs/{sha256}", sha256=v.blob_sha)
    # Claiming a digest without the bytes is refused, and leaves the blob not owned.
    probe("PUT", "/v1/blobs/{sha256}", {400}, sha256=v.blob_sha, content=b"not the config")
    probe("POST", "/v1/registry/models/{name}/versions", {400}, name=v.reg_name,
          json_body={"files": {"config.json": {"sha256": v.blob_sha}}})  # fmt: skip
    probe("HEAD", "/v1/blobs/{sha256}", sha256=v.blob_sha)
    # Files, the batch's output file included.
    for file_id in (v.file, v.output_file):
        probe("GET", "/v1/files/{file_id}", file_id=file_id)
        probe("GET", "/v1/files/{file_id}/content", file_id=file_id)
        probe("DELETE", "/v1/files/{file_id}", file_id=file_id)
    assert probe("GET", "/v1/files", {200}).json()["data"] == []
    probe("POST", "/v1/batches", json_body={"input_file_id": v.file,
          "endpoint": "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
    # Batches: a finished batch cannot be cancelled (409), but tenant B must not learn even that.
    probe("GET", "/v1/batches/{batch_id}", batch_id=v.batch)
    probe("POST", "/v1/batches/{batch_id}/cancel", batch_id=v.batch)
    assert probe("GET", "/v1/batches", {200}).json()["data"] == []

    # Every route that takes an id was tried.
    operations = templated_operations(platform)
    assert ("get", "/v1/files/{file_id}") in operations and len(operations) >= 20, operations
    missing = operations - probe.covered
    assert not missing, f"routes with a path parameter not covered by this test: {missing}"

    # Nothing of tenant A changed.
    assert v.api.get(f"/v1/tenants/{v.id}").json()["monthly_token_quota"] == 10**7
    key = v.api.get(f"/v1/keys/{v.key['id']}").json()
    assert key["revoked_at"] is None and key["rpm_limit"] is None
    user = v.api.get(f"/v1/users/{v.user['id']}").json()
    assert user["role"] == "developer" and user["teams"] == [v.team["id"]]
    assert v.api.get(f"/v1/endpoints/{v.endpoint}").json()["status"] == "ready"
    assert v.api.get(f"/v1/registry/models/{v.reg_name}").status_code == 200
    assert v.api.head(f"/v1/blobs/{v.blob_sha}").status_code == 200
    assert v.client.files.content(v.file).text.find(v.secret) >= 0
    assert read_jsonl(v.client, v.output_file) == v.output
    assert v.client.batches.retrieve(v.batch).status == "completed"
    deadline = time.monotonic() + 120
    while (r := v.api.get(f"/v1/async/{v.async_id}")).status_code == 202:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    answer = platform.openai(v.key["key"]).chat.completions.create(
        model=v.model_name, messages=MESSAGES, max_tokens=2
    )
    assert answer.choices
    print(f"cross-tenant probes: {probe.count} requests, {len(probe.covered)} routes with ids")
