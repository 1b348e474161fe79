"""`AccessSettings`: how gateways check keys and read budgets (caches, refreshes, the last-use
writes), part of `PlatformSettings` with single sign-on's settings (`SsoSettings`)."""

from __future__ import annotations

from pydantic import Field

from modelyard.config.sso_settings import SsoSettings


class AccessSettings(SsoSettings):
    auth_cache_ttl_s: float = Field(
        5.0,
        description="How long a key lookup is cached: a key revoked, rotated past its grace, "
        "re-scoped or given an earlier expiry in another gateway takes effect here within it.",
    )
    key_last_used_interval_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How often a gateway writes its keys' last use (one UPDATE per key used "
        "meanwhile, off the request path).",
    )
    budget_refresh_s: float = Field(
        5.0,
        gt=0,
        description="How often a gateway rereads prices and budgets (a change made through "
        "the same process applies at once).",
    )
    auth_stale_ttl_s: float = Field(
        300.0,
        ge=0,
        description="With the database unreachable, how long a key's last good lookup is still "
        "served (a key revoked meanwhile by another gateway is honoured only when it is back).",
    )
