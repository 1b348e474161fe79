"""Single sign-on to the console with OpenID Connect against a provider the test starts
(`tests/oidc_provider.py`: discovery, JWKS, auto-consent authorize, token with PKCE): a user a
tenant admin added signs in in Chromium and works with the role given them, and signs out;
a first sign-in makes a user with the configured role; and the platform refuses what it must:
an ID token signed by another key, for another client, expired, or with another nonce, a state
this browser did not start, an unverified email, a domain not allowed."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.test_console import CHROMIUM, CHROMIUM_ARGS, _require_browser
from tests.oidc_provider import Provider
from tests.platform_harness import PlatformProcess, create_key, create_tenant

TENANT = f"sso-{uuid.uuid4().hex[:6]}"
CALLBACK = "/v1/auth/oidc/callback"


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    with Provider("modelyard-console", "s3cret-" + uuid.uuid4().hex, redirect_uri="") as p:
        yield p


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, provider: Provider) -> Iterator[Any]:
    env = {
        "MODELYARD_OIDC_ISSUER": provider.issuer,
        "MODELYARD_OIDC_CLIENT_ID": provider.client_id,
        "MODELYARD_OIDC_CLIENT_SECRET": provider.client_secret,
        "MODELYARD_OIDC_TENANT": TENANT,
        "MODELYARD_OIDC_DEFAULT_ROLE": "viewer",
        "MODELYARD_OIDC_ALLOWED_DOMAINS": json.dumps(["example.com"]),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("sso-data"), env)
    provider.redirect_uri = p.url + CALLBACK
    p.start()
    try:
        tenant_id = create_tenant(p.api(), TENANT)
        admin_key = create_key(p.api(), tenant_id, scopes=["admin", "inference"])["key"]
        yield p, p.api(admin_key)
    except BaseException:
        print(p.output())
        raise
    finally:
        p.stop()


def _flow(platform: PlatformProcess) -> httpx.Response:
    """The browser's round trip without a browser: login, the provider, the callback."""
    with httpx.Client(follow_redirects=True, timeout=30) as browser:
        return browser.get(platform.url + "/v1/auth/oidc/login")


def _session(answer: httpx.Response) -> str:
    found = re.search(r'name="modelyard-session" content="([^"]+)"', answer.text)
    assert answer.status_code == 200 and found, answer.text
    return found.group(1)


def test_a_user_signs_in_to_the_console_in_chromium(
    platform: Any, provider: Provider, tmp_path: Path
) -> None:
    _require_browser()
    from playwright.sync_api import sync_playwright

    p, admin = platform
    email = f"ada-{uuid.uuid4().hex[:4]}@example.com"
    user = admin.post("/v1/users", json={"email": email, "role": "developer"}).json()
    provider.user = {"sub": "ada-subject", "email": email, "name": "Ada"}
    assert httpx.get(p.url + "/v1/auth/config").json()["oidc"] is True

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = chromium.new_context().new_page()
            page.set_default_timeout(30_000)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(p.url + "/")
            page.get_by_role("link", name="Sign in with single sign-on").click()
            page.locator("#shell").wait_for(state="visible")
            assert page.locator("#who").inner_text() == f"{email} (developer)"
            # A developer's console: its own keys, no tenant administration.
            assert page.locator('#nav a[data-view="keys"]').is_visible()
            assert not page.locator('#nav a[data-view="tenants"]').is_visible()
            token = page.evaluate("sessionStorage.getItem('modelyard.key')")
            assert token.startswith("sk-my-session-") and token not in page.url
            page.screenshot(path=str(tmp_path / "sso-signed-in.png"))
            me = httpx.get(p.url + "/v1/me", headers={"authorization": f"Bearer {token}"}).json()
            assert me["role"] == "developer" and me["user"]["id"] == user["id"]
            assert me["user"]["sso"] is True
            page.get_by_role("button", name="Sign out").click()
            page.locator("#signin").wait_for(state="visible")
            assert errors == []
        finally:
            chromium.close()
    gone = httpx.get(p.url + "/v1/me", headers={"authorization": f"Bearer {token}"})
    assert gone.status_code == 401
    events = admin.get("/v1/audit", params={"action": "user.sign_in"}).json()["data"]
    assert events and events[0]["target_id"] == user["id"]
    assert token not in json.dumps(events)
    # The provider saw the whole code flow: discovery, keys, authorize, token.
    for step in ("GET /.well-known/openid-configuration", "GET /jwks", "GET /authorize",
                 "POST /token"):  # fmt: skip
        assert step in provider.requests


def test_first_sign_in_and_what_is_refused(platform: Any, provider: Provider) -> None:
    p, admin = platform
    # A first sign-in of an allowed domain: a viewer of the configured tenant, read-only.
    email = f"bob-{uuid.uuid4().hex[:4]}@example.com"
    provider.user = {"sub": f"bob-{email}", "email": email}
    token = _session(_flow(p))
    viewer = httpx.Client(base_url=p.url, headers={"authorization": f"Bearer {token}"})
    me = viewer.get("/v1/me").json()
    assert me["role"] == "viewer" and me["user"]["email"] == email
    assert viewer.get("/v1/models").status_code == 200
    assert viewer.post("/v1/chat/completions", json={"model": "x"}).status_code == 403
    assert viewer.post("/v1/keys", json={"name": "k"}).status_code == 403
    # Signing in again is the same user (by the provider's subject), a new session.
    again = _session(_flow(p))
    assert again != token
    users = [u for u in admin.get("/v1/users").json()["data"] if u["email"] == email]
    assert len(users) == 1 and users[0]["sso"] is True
    # A user holds at most 20 sessions: the 21st sign-in ends the oldest.
    newest = [_session(_flow(p)) for _ in range(19)][-1]
    assert viewer.get("/v1/me").status_code == 401
    for held in (again, newest):
        me = httpx.get(p.url + "/v1/me", headers={"authorization": f"Bearer {held}"})
        assert me.status_code == 200, me.text

    # What the platform refuses.
    for tamper in ("signature", "nonce", "audience", "expired"):
        provider.tamper = tamper
        r = _flow(p)
        assert r.status_code == 403 and "sso_refused" in r.text, (tamper, r.text)
        assert "modelyard-session" not in r.text
    for user in (
        {"sub": "eve", "email": "eve@elsewhere.org"},
        {"sub": "mallory", "email": f"m-{email}", "email_verified": False},
    ):
        provider.user = user
        r = _flow(p)
        assert r.status_code == 403 and "sso_refused" in r.text, (user, r.text)
    # A callback this browser did not start (no cookie), or with another state.
    provider.user = {"sub": f"bob-{email}", "email": email}
    r = httpx.get(p.url + CALLBACK, params={"code": "x", "state": "y"})
    assert r.status_code == 403 and "sso_refused" in r.text
    with httpx.Client(timeout=30) as browser:
        start = browser.get(p.url + "/v1/auth/oidc/login")
        assert (
            start.status_code == 302 and "code_challenge_method=S256" in start.headers["location"]
        )
        assert "httponly" in start.headers["set-cookie"].lower()
        r = browser.get(p.url + CALLBACK, params={"code": "x", "state": "forged"})
        assert r.status_code == 403 and "state" in r.text
    # Sign-in makes nobody in a tenant other than the configured one, and no refused user.
    assert not any(u["email"].startswith(("eve@", "m-")) for u in
                   p.api().get("/v1/users").json()["data"])  # fmt: skip
