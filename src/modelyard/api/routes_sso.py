"""Console sign-in with OpenID Connect, and sign-out: the routes.

`GET /v1/auth/config` tells the console whether single sign-on is on. `GET /v1/auth/oidc/login`
starts the authorization-code flow: the state, nonce and PKCE verifier go into a signed,
HttpOnly cookie scoped to the callback, and the browser to the provider. `GET
/v1/auth/oidc/callback` checks the state against that cookie, has the code traded and the ID
token verified (`control/oidc.py`), signs the user in (`control/sso.py`) and answers a page that
hands the session token to the console through a meta tag its script reads (never a URL, never
a cookie). `POST /v1/auth/logout` ends a console session.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import RedirectResponse, Response

from modelyard.api.deps import base_url, get_principal, get_services
from modelyard.api.routes_console import CONTENT_SECURITY_POLICY
from modelyard.api.services import Services
from modelyard.control.oidc import OidcClient
from modelyard.core.errors import Forbidden, NotFound
from modelyard.core.identity import Principal
from modelyard.gateway.auth import generate_session_token

router = APIRouter()
COOKIE = "modelyard_oidc"
CALLBACK = "/v1/auth/oidc/callback"
_PAGE_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


def _client(services: Services) -> OidcClient:
    if services.oidc is None or services.sign_in is None:
        raise NotFound("single sign-on is not configured on this platform", code="not_found")
    return services.oidc


def _redirect_uri(request: Request, services: Services) -> str:
    return services.settings.oidc_redirect_url or base_url(request) + CALLBACK


@router.get("/v1/auth/config")
async def auth_config(services: Services = Depends(get_services)) -> dict[str, Any]:
    """Which sign-ins the console offers: an API key always, single sign-on when configured."""
    return {"object": "auth.config", "api_key": True, "oidc": services.oidc is not None}


@router.get("/v1/auth/oidc/login", response_class=RedirectResponse, status_code=302)
async def oidc_login(request: Request, services: Services = Depends(get_services)) -> Response:
    """Start single sign-on: off to the provider, with a signed cookie for the way back."""
    client = _client(services)
    pending = client.start()
    url = await client.authorization_url(pending, _redirect_uri(request, services))
    r = RedirectResponse(url, status_code=302, headers={"cache-control": "no-store"})
    r.set_cookie(COOKIE, client.seal(pending), max_age=600, path=CALLBACK, httponly=True,
                 secure=request.url.scheme == "https", samesite="lax")  # fmt: skip
    return r


@router.get(
    "/v1/auth/oidc/callback",
    response_model=None,
    responses={200: {"content": {"text/html": {"schema": {"type": "string"}}}}},
)
async def oidc_callback(
    request: Request,
    code: str | None = Query(None, max_length=4096),
    state: str = Query("", max_length=512),
    error: str | None = Query(None, max_length=200),
    services: Services = Depends(get_services),
) -> Response:
    """The provider's answer: a console session for the user, handed to the console's page."""
    client = _client(services)
    if error is not None:
        raise Forbidden(f"single sign-on refused: the provider answered {error!r}",
                        code="sso_refused")  # fmt: skip
    pending = client.unseal(request.cookies.get(COOKIE), state)
    if not code:
        raise Forbidden("single sign-on refused: no code", code="sso_refused")
    claims = await client.finish(pending, code, _redirect_uri(request, services))
    token, token_hash = generate_session_token()
    assert services.sign_in is not None
    await services.sign_in.sign_in(client.issuer, claims, token_hash)
    services.auth.invalidate()  # a session the sign-in ended (the user's oldest) ends now
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Signing in…</title>'
        f'<meta name="modelyard-session" content="{html.escape(token)}">'
        '<script type="module" src="/console/sso.js"></script></head>'
        "<body><p>Signing in…</p></body></html>"
    )
    r = Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)
    r.delete_cookie(COOKIE, path=CALLBACK)
    return r


@router.post("/v1/auth/logout")
async def logout(
    principal: Principal = Depends(get_principal), services: Services = Depends(get_services)
) -> dict[str, Any]:
    """End the caller's console session (an API key stays valid: revoke it instead)."""
    ended = services.sign_in is not None and await services.sign_in.sign_out(principal)
    if ended:
        services.auth.invalidate()
    return {"object": "auth.logout", "ended": ended}
