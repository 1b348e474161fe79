"""`SsoSettings`: single sign-on to the console with OpenID Connect, part of `PlatformSettings`.

Sign-in is on when `oidc_issuer` and `oidc_client_id` are set. Who may sign in: a user the
tenant admin created with the same email (linked to the provider's `sub` on first sign-in), or,
when `oidc_tenant` and `oidc_default_role` are set, anyone whose verified email's domain is in
`oidc_allowed_domains`, made a user of `oidc_tenant` with that role on first sign-in.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from modelyard.config.sources import SettingsBase


class SsoSettings(SettingsBase):
    oidc_issuer: str | None = Field(
        None,
        max_length=500,
        description="The OpenID provider's issuer URL (its /.well-known/openid-configuration is "
        "read from it); with oidc_client_id, turns on single sign-on to the console.",
    )
    oidc_client_id: str | None = Field(None, max_length=500)
    oidc_client_secret: str | None = Field(
        None,
        max_length=2000,
        description="The client's secret (client_secret_basic); unset: a public client (PKCE "
        "only).",
    )
    oidc_redirect_url: str | None = Field(
        None,
        max_length=2000,
        description="The callback registered with the provider; default: this server's "
        "/v1/auth/oidc/callback as the browser reached it.",
    )
    oidc_scopes: str = Field("openid email profile", max_length=500)
    oidc_allowed_domains: list[str] = Field(
        default_factory=list,
        description="Email domains that may sign in (empty: any); checked for every sign-in.",
    )
    oidc_tenant: str | None = Field(
        None, max_length=200, description="The tenant (by name) new SSO users are made in."
    )
    oidc_default_role: Literal["admin", "developer", "viewer"] | None = Field(
        None,
        description="The role of a user made on first sign-in (with oidc_tenant); unset: only "
        "users a tenant admin created may sign in.",
    )
    console_session_ttl_s: int = Field(
        8 * 3600, ge=60, le=30 * 86400, description="How long a console sign-in lasts."
    )
    oidc_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Each call to the provider (discovery, keys, token)."
    )

    @field_validator("oidc_allowed_domains")
    @classmethod
    def _lower(cls, domains: list[str]) -> list[str]:
        return [d.strip().lower().lstrip("@") for d in domains if d.strip()]
