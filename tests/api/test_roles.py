"""Roles, route by route: a viewer's, a developer's and an admin's key (each a user's key holding
every scope, so only the role limits it) on every route of the served OpenAPI schema (so a new
route fails this test until it is placed in the matrix) is refused with 403
`insufficient_scope` below the route's role and never refused for its role at or above; then
what the roles mean beyond the route: a developer's own keys, a key cut to its user's role,
team keys, a role change and a deletion taking effect at once, and every change audited."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.core.roles import Role
from tests.platform_harness import PlatformProcess, create_key, create_tenant

VIEWER, DEVELOPER, ADMIN = Role.VIEWER, Role.DEVELOPER, Role.ADMIN
RANK = {VIEWER: 0, DEVELOPER: 1, ADMIN: 2}
PUBLIC = "public"  # no key needed
PLATFORM = "platform"  # the platform admin only: every tenant role is refused

# The least role each route needs (docs/security.md, "Roles"). Keyed by the schema's operations.
MATRIX: dict[tuple[str, str], str] = {
    ("get", "/health"): PUBLIC,
    ("get", "/v2"): PUBLIC,
    ("get", "/v2/health/live"): PUBLIC,
    ("get", "/v2/health/ready"): PUBLIC,
    ("get", "/metrics"): VIEWER,
    ("get", "/v1/me"): VIEWER,
    ("get", "/v1/auth/config"): PUBLIC,
    ("get", "/v1/auth/oidc/login"): PUBLIC,
    ("get", "/v1/auth/oidc/callback"): PUBLIC,
    ("post", "/v1/auth/logout"): VIEWER,
    # Reading the tenant's configuration and records.
    ("get", "/v1/models"): VIEWER,
    ("get", "/v1/models/{model}"): VIEWER,
    ("get", "/v1/endpoints"): VIEWER,
    ("get", "/v1/endpoints/{endpoint_id}"): VIEWER,
    ("get", "/v1/async/{request_id}"): VIEWER,
    ("get", "/v1/registry/models"): VIEWER,
    ("get", "/v1/registry/adapters"): VIEWER,
    ("get", "/v1/registry/models/{name}"): VIEWER,
    ("get", "/v1/usage"): VIEWER,
    ("get", "/v1/usage/export"): VIEWER,
    ("get", "/v1/users"): VIEWER,
    ("get", "/v1/users/{user_id}"): VIEWER,
    ("get", "/v1/teams"): VIEWER,
    ("get", "/v1/teams/{team_id}"): VIEWER,
    # Using models.
    ("post", "/v1/chat/completions"): DEVELOPER,
    ("post", "/v1/completions"): DEVELOPER,
    ("post", "/v1/responses"): DEVELOPER,
    ("post", "/v1/embeddings"): DEVELOPER,
    ("get", "/v2/models/{model}"): DEVELOPER,
    ("get", "/v2/models/{model}/ready"): DEVELOPER,
    ("get", "/v2/models/{model}/versions/{version}"): DEVELOPER,
    ("get", "/v2/models/{model}/versions/{version}/ready"): DEVELOPER,
    ("post", "/v2/models/{model}/infer"): DEVELOPER,
    ("post", "/v2/models/{model}/versions/{version}/infer"): DEVELOPER,
    ("post", "/v1/files"): DEVELOPER,
    ("get", "/v1/files"): DEVELOPER,
    ("get", "/v1/files/{file_id}"): DEVELOPER,
    ("get", "/v1/files/{file_id}/content"): DEVELOPER,
    ("delete", "/v1/files/{file_id}"): DEVELOPER,
    ("post", "/v1/batches"): DEVELOPER,
    ("get", "/v1/batches"): DEVELOPER,
    ("get", "/v1/batches/{batch_id}"): DEVELOPER,
    ("post", "/v1/batches/{batch_id}/cancel"): DEVELOPER,
    ("get", "/v1/webhooks/secret"): DEVELOPER,
    ("post", "/v1/webhooks/secret/rotate"): DEVELOPER,
    # Deploying and pushing models.
    ("post", "/v1/models/deploy"): DEVELOPER,
    ("patch", "/v1/endpoints/{endpoint_id}"): DEVELOPER,
    ("delete", "/v1/endpoints/{endpoint_id}"): DEVELOPER,
    ("post", "/v1/endpoints/{endpoint_id}/versions"): DEVELOPER,
    ("patch", "/v1/endpoints/{endpoint_id}/traffic"): DEVELOPER,
    ("post", "/v1/endpoints/{endpoint_id}/promote"): DEVELOPER,
    ("post", "/v1/endpoints/{endpoint_id}/rollback"): DEVELOPER,
    ("head", "/v1/blobs/{sha256}"): DEVELOPER,
    ("put", "/v1/blobs/{sha256}"): DEVELOPER,
    ("post", "/v1/registry/models/{name}/versions"): DEVELOPER,
    ("delete", "/v1/registry/models/{name}"): DEVELOPER,
    # API keys: a developer's own (what they mean is checked below), every key for an admin.
    ("post", "/v1/keys"): DEVELOPER,
    ("get", "/v1/keys"): DEVELOPER,
    ("get", "/v1/keys/{key_id}"): DEVELOPER,
    ("patch", "/v1/keys/{key_id}"): DEVELOPER,
    ("delete", "/v1/keys/{key_id}"): DEVELOPER,
    ("post", "/v1/keys/{key_id}/rotate"): DEVELOPER,
    # Prices and budgets in dollars: prices are read like models, set and budgets by admins.
    ("get", "/v1/prices/{endpoint}"): VIEWER,
    ("put", "/v1/prices/{endpoint}"): ADMIN,
    ("get", "/v1/prices/adapters/{name}"): VIEWER,
    ("put", "/v1/prices/adapters/{name}"): ADMIN,
    ("delete", "/v1/prices/adapters/{name}"): ADMIN,
    ("post", "/v1/budgets"): ADMIN,
    ("get", "/v1/budgets"): ADMIN,
    ("get", "/v1/budgets/{budget_id}"): ADMIN,
    ("patch", "/v1/budgets/{budget_id}"): ADMIN,
    ("delete", "/v1/budgets/{budget_id}"): ADMIN,
    # Administering the tenant.
    ("post", "/v1/users"): ADMIN,
    ("patch", "/v1/users/{user_id}"): ADMIN,
    ("delete", "/v1/users/{user_id}"): ADMIN,
    ("post", "/v1/teams"): ADMIN,
    ("delete", "/v1/teams/{team_id}"): ADMIN,
    ("post", "/v1/teams/{team_id}/members"): ADMIN,
    ("delete", "/v1/teams/{team_id}/members/{user_id}"): ADMIN,
    ("get", "/v1/audit"): ADMIN,
    ("get", "/v1/audit.csv"): ADMIN,
    ("get", "/v1/tenants"): ADMIN,
    ("get", "/v1/tenants/{tenant_id}"): ADMIN,
    # The platform's own.
    ("get", "/v1/devices"): PLATFORM,
    ("post", "/v1/tenants"): PLATFORM,
    ("patch", "/v1/tenants/{tenant_id}"): PLATFORM,
}

# A body every validated route refuses (an unknown field), so an allowed call changes nothing.
PROBE_BODY = {"rbac_probe_unknown_field": 1}
MISSING = "missing-0000"
# The platform's routes check their bodies before the caller: these are valid ones.
VALID_BODIES = {"/v1/tenants": {"name": "rbac-probe"}, "/v1/tenants/{tenant_id}": {"tier": "free"}}


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("data"), {}).start()
    try:
        yield p
    finally:
        p.stop()


class Tenant:
    """A tenant with its admin key and one user (and a key holding every scope) per role."""

    def __init__(self, platform: PlatformProcess) -> None:
        root = platform.api()
        self.id = create_tenant(root, f"roles-{uuid.uuid4().hex[:8]}")
        self.admin_key = create_key(root, self.id, scopes=["admin", "inference"])["key"]
        self.api = platform.api(self.admin_key)
        self.users: dict[Role, dict[str, Any]] = {}
        self.keys: dict[Role, str] = {}
        for role in Role:
            self.users[role] = self.add_user(role)
            self.keys[role] = self.key_for(self.users[role]["id"])["key"]

    def add_user(self, role: Role) -> dict[str, Any]:
        email = f"{role}-{uuid.uuid4().hex[:6]}@example.com"
        r = self.api.post("/v1/users", json={"email": email, "role": role, "name": role.title()})
        assert r.status_code == 201, r.text
        return dict(r.json())

    def key_for(self, user_id: str, scopes: list[str] | None = None) -> dict[str, Any]:
        scopes = scopes or ["admin", "inference", "metrics"]
        return create_key(self.api, name=f"key-of-{user_id}", owner_user_id=user_id, scopes=scopes)


def _operations(platform: PlatformProcess) -> set[tuple[str, str]]:
    schema = httpx.get(f"{platform.url}/openapi.json", timeout=30).json()
    return {
        (method.lower(), path)
        for path, ops in schema["paths"].items()
        for method in ops
        if method.lower() in {"get", "put", "post", "patch", "delete", "head"}
    }


def _call(api: httpx.Client, method: str, template: str) -> httpx.Response:
    url = template
    for name in ("model", "version", "endpoint_id", "request_id", "name", "sha256", "key_id",
                 "user_id", "team_id", "file_id", "batch_id", "tenant_id"):  # fmt: skip
        url = url.replace("{" + name + "}", "0" * 64 if name == "sha256" else MISSING)
    if method in {"post", "put", "patch"}:
        return api.request(method, url, json=VALID_BODIES.get(template, PROBE_BODY))
    return api.request(method, url)


def _refused_for_role(r: httpx.Response) -> bool:
    if r.status_code == 401:
        return True
    if r.status_code != 403:
        return False
    if r.request.method == "HEAD":
        return True  # no body to say why
    # OpenAI's shape names the code; the Open Inference Protocol's is a bare message.
    return "insufficient_scope" in r.text or "scope required" in r.text


def test_every_route_answers_each_role_by_the_matrix(platform: PlatformProcess) -> None:
    t = Tenant(platform)
    operations = _operations(platform)
    missing = operations - set(MATRIX)
    assert not missing, f"routes with no place in the role matrix: {sorted(missing)}"
    assert not set(MATRIX) - operations, sorted(set(MATRIX) - operations)
    wrong = []
    clients = {role: platform.api(t.keys[role]) for role in Role}
    for (method, path), least in sorted(MATRIX.items()):
        for role in Role:
            r = _call(clients[role], method, path)
            allowed = least == PUBLIC or (least != PLATFORM and RANK[role] >= RANK[Role(least)])
            if allowed == _refused_for_role(r) or r.status_code >= 500:
                wrong.append((role.value, method.upper(), path, r.status_code, r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    # The matrix held, and nothing was made by the allowed calls (each body was refused).
    assert len(t.api.get("/v1/users").json()["data"]) == 3
    assert t.api.get("/v1/teams").json()["data"] == []
    print(f"role matrix: {len(MATRIX)} routes x {len(Role)} roles")


def test_what_each_role_means(platform: PlatformProcess) -> None:
    t = Tenant(platform)
    dev, dev_key = t.users[DEVELOPER], t.keys[DEVELOPER]
    dev_api = platform.api(dev_key)

    # A developer's key is cut to the role: no admin scope although the key holds it.
    me = dev_api.get("/v1/me").json()
    assert me["role"] == "developer" and me["user"]["email"] == dev["email"]
    assert "admin" not in me["scopes"] and {"inference", "deploy", "own_keys"} <= set(me["scopes"])
    assert dev_api.post("/v1/users", json={"email": "x@example.com"}).status_code == 403

    # A developer makes and sees only its own keys, within its role.
    own = dev_api.post("/v1/keys", json={"name": "mine", "scopes": ["inference"]})
    assert own.status_code == 201, own.text
    assert own.json()["owner_user_id"] == dev["id"]
    listed = {k["id"] for k in dev_api.get("/v1/keys").json()["data"]}
    admin_keys = {k["id"] for k in t.api.get("/v1/keys").json()["data"]}
    assert own.json()["id"] in listed and listed < admin_keys
    assert all(k["owner_user_id"] == dev["id"] for k in dev_api.get("/v1/keys").json()["data"])
    viewer_key_id = next(
        k["id"] for k in t.api.get("/v1/keys").json()["data"]
        if k["owner_user_id"] == t.users[VIEWER]["id"]
    )  # fmt: skip
    assert dev_api.get(f"/v1/keys/{viewer_key_id}").status_code == 404
    assert dev_api.delete(f"/v1/keys/{viewer_key_id}").status_code == 404
    above = dev_api.post("/v1/keys", json={"name": "x", "scopes": ["admin"]})
    assert above.status_code == 403 and above.json()["error"]["param"] == "scopes"
    other = dev_api.post("/v1/keys", json={"name": "x", "owner_user_id": t.users[VIEWER]["id"]})
    assert other.status_code == 403, other.text
    assert dev_api.delete(f"/v1/keys/{own.json()['id']}").status_code == 200

    # Bounds at the edge: unknown fields, a malformed email, an unknown role.
    for body, param in (
        ({"email": "a@example.com", "is_root": True}, "is_root"),
        ({"email": "not-an-email"}, "email"),
        ({"email": "b@example.com", "role": "root"}, "role"),
        ({"email": "c@example.com" + "x" * 300}, "email"),
    ):
        r = t.api.post("/v1/users", json=body)
        assert r.status_code == 400 and param in r.text, (body, r.text)
    assert t.api.post("/v1/users", json={"email": dev["email"]}).status_code == 409
    page = t.api.get("/v1/users").json()
    ids = [u["id"] for u in page["data"]]
    assert len(ids) == 3 and ids == sorted(ids) and page["has_more"] is False
    after = t.api.get("/v1/users", params={"after": ids[0]}).json()["data"]
    assert [u["id"] for u in after] == ids[1:]
    assert t.api.post("/v1/teams", json={"name": "t", "members": []}).status_code == 400

    # A team, a member, a team key: the key's principal carries the team.
    team = t.api.post("/v1/teams", json={"name": "research"}).json()
    r = t.api.post(f"/v1/teams/{team['id']}/members", json={"user_id": dev["id"]})
    assert r.status_code == 200 and r.json()["members"] == [dev["id"]]
    assert t.api.get(f"/v1/users/{dev['id']}").json()["teams"] == [team["id"]]
    team_key = create_key(t.api, name="team", owner_team_id=team["id"])
    assert team_key["owner_team_id"] == team["id"]
    assert platform.api(team_key["key"]).get("/v1/me").json()["team_id"] == team["id"]
    both = {"name": "x", "owner_team_id": team["id"], "owner_user_id": dev["id"]}
    assert t.api.post("/v1/keys", json=both).status_code == 400
    assert t.api.post("/v1/keys", json={"owner_team_id": MISSING}).status_code == 404

    # A role change holds from the next request; a deleted team's and user's keys stop.
    assert dev_api.post("/v1/chat/completions", json={}).status_code != 403
    r = t.api.patch(f"/v1/users/{dev['id']}", json={"role": "viewer"})
    assert r.status_code == 200 and r.json()["role"] == "viewer"
    assert dev_api.post("/v1/chat/completions", json={}).status_code == 403
    assert dev_api.get("/v1/models").status_code == 200
    assert t.api.delete(f"/v1/teams/{team['id']}").status_code == 200
    assert platform.api(team_key["key"]).get("/v1/models").status_code == 401
    assert t.api.delete(f"/v1/users/{dev['id']}").status_code == 200
    assert dev_api.get("/v1/models").status_code == 401
    assert t.api.get(f"/v1/users/{dev['id']}").status_code == 404

    # Every change is in the tenant's audit log, with who did it.
    events = t.api.get("/v1/audit", params={"limit": 200}).json()["data"]
    actions = {e["action"] for e in events}
    assert {"user.create", "user.update", "user.delete", "team.create", "team.member_add",
            "team.delete", "api_key.create"} <= actions, actions  # fmt: skip
    dev_made = [
        e for e in events if e["action"] == "api_key.create" and e["after"]["name"] == "mine"
    ]
    assert dev_made and dev_made[0]["after"]["owner_user_id"] == dev["id"]
    assert dev_made[0]["actor_key_id"] not in ("system", None)


def test_users_and_teams_stay_in_their_tenant(platform: PlatformProcess, tmp_path: Path) -> None:
    a, b = Tenant(platform), Tenant(platform)
    victim = a.users[DEVELOPER]
    team = a.api.post("/v1/teams", json={"name": "a-team"}).json()
    for method, url, body in (
        ("GET", f"/v1/users/{victim['id']}", None),
        ("PATCH", f"/v1/users/{victim['id']}", {"role": "admin"}),
        ("DELETE", f"/v1/users/{victim['id']}", None),
        ("GET", f"/v1/teams/{team['id']}", None),
        ("DELETE", f"/v1/teams/{team['id']}", None),
        ("POST", f"/v1/teams/{team['id']}/members", {"user_id": b.users[VIEWER]["id"]}),
        ("POST", "/v1/keys", {"name": "steal", "owner_user_id": victim["id"]}),
    ):
        r = b.api.request(method, url, json=body)
        assert r.status_code == 404, (method, url, r.text)
        assert victim["email"] not in r.text
    assert victim["email"] not in b.api.get("/v1/users").text
    assert a.api.get(f"/v1/users/{victim['id']}").json()["role"] == "developer"
    # The platform admin reads and manages any tenant's users.
    root = platform.api()
    listed = root.get("/v1/users", params={"tenant_id": a.id}).json()["data"]
    assert {u["id"] for u in listed} == {u["id"] for u in a.users.values()}
    made = root.post("/v1/teams", json={"name": "from-root", "tenant_id": a.id})
    assert made.status_code == 201 and made.json()["tenant_id"] == a.id
