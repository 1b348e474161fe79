"""API keys: generation, hashing, and authenticating a request's bearer key to a `Principal`.

Keys are random (256 bits), shown once, stored only as their sha256; the lookup goes by hash
and the final comparison is constant-time. Lookups are cached for a few seconds; revocation in
this process invalidates the cache at once. The cache is bounded (least recently used first
out), and unknown keys go to a smaller cache of their own, so a flood of random keys costs
database lookups but neither memory nor the cached entries of real keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from modelyard.api.errors import APIError
from modelyard.gateway.ratelimit import Limits
from modelyard.store import repository as repo
from modelyard.store.db import Database

KEY_PREFIX = "sk-my-"
SCOPES = ("inference", "admin")


def generate_key() -> tuple[str, str, str]:
    """A new key: (the key itself, its stored hash, a displayable prefix)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key), key[: len(KEY_PREFIX) + 4]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tier(StrEnum):
    """A tenant's service tier, set by the platform admin: under overload the lower tier waits
    (or is refused) first, in the admission queue and in the engine."""

    FREE = "free"
    STANDARD = "standard"
    PRIORITY = "priority"

    @property
    def rank(self) -> int:
        """0 is served first: the engine priority of the tier's interactive requests."""
        return _TIER_RANK[self]


_TIER_RANK = {Tier.PRIORITY: 0, Tier.STANDARD: 1, Tier.FREE: 2}


@dataclass(frozen=True)
class Principal:
    key_id: str
    key_name: str
    tenant_id: str
    tenant_name: str
    scopes: frozenset[str]
    limits: Limits
    monthly_token_quota: int | None
    platform_admin: bool  # an admin key of the system tenant: operates the whole platform
    tier: Tier = Tier.STANDARD
    # The tenant's ceilings on work in flight (None: no ceiling), set by the platform admin.
    max_concurrent_requests: int | None = None
    max_concurrent_batch_items: int | None = None

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise APIError(
                403,
                f"This API key lacks the '{scope}' scope required for this operation.",
                code="insufficient_scope",
            )

    def require_platform_admin(self) -> None:
        if not self.platform_admin:
            raise APIError(
                403, "Only the platform administrator can do this.", code="insufficient_scope"
            )

    def tenant_filter(self, requested: str | None = None) -> str | None:
        """The tenant whose data a call may see: its own, or any one the platform admin names."""
        if self.platform_admin:
            return requested
        if requested is not None and requested != self.tenant_id:
            raise APIError(404, "No such tenant.", code="not_found")
        return self.tenant_id


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def _capped(key_limit: int | None, ceiling: int | None) -> int | None:
    """A key's limit within its tenant's ceiling: a key may be tighter, never looser."""
    if ceiling is None:
        return key_limit
    return ceiling if key_limit is None else min(key_limit, ceiling)


class _LRU:
    """A cache of key hash → (lookup, expiry) holding at most `size` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[Principal | None, float]] = OrderedDict()

    def get(self, key_hash: str, now: float) -> tuple[Principal | None] | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._entries[key_hash]
            return None
        self._entries.move_to_end(key_hash)
        return (entry[0],)

    def put(self, key_hash: str, principal: Principal | None, expires: float) -> None:
        self._entries[key_hash] = (principal, expires)
        self._entries.move_to_end(key_hash)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Authenticator:
    def __init__(
        self,
        db: Database,
        cache_ttl_s: float = 5.0,
        cache_size: int = 10_000,
        negative_cache_size: int = 1_000,
    ) -> None:
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        self._known = _LRU(cache_size)
        self._unknown = _LRU(negative_cache_size)

    @property
    def cached(self) -> int:
        """Entries in the caches (known and unknown keys together)."""
        return len(self._known) + len(self._unknown)

    def _lookup(self, key_hash: str) -> Principal | None:
        with self.db.session() as s:
            key = repo.key_by_hash(s, key_hash)
            if key is None or key.revoked_at is not None:
                return None
            if not hmac.compare_digest(key.key_hash, key_hash):
                return None
            tenant = repo.get_tenant(s, key.tenant_id)
            assert tenant is not None
            scopes = frozenset(filter(None, key.scopes.split(",")))
            return Principal(
                key_id=key.id,
                key_name=key.name,
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                scopes=scopes,
                limits=Limits(
                    rpm=_capped(key.rpm_limit, tenant.max_rpm),
                    tpm=_capped(key.tpm_limit, tenant.max_tpm),
                ),
                monthly_token_quota=tenant.monthly_token_quota,
                platform_admin=tenant.is_system and "admin" in scopes,
                tier=Tier(tenant.tier or Tier.STANDARD),
                max_concurrent_requests=tenant.max_concurrent_requests,
                max_concurrent_batch_items=tenant.max_concurrent_batch_items,
            )

    async def authenticate(self, authorization: str | None) -> Principal:
        if not authorization:
            raise _unauthorized(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        key_hash = hash_key(key.strip())
        now = time.monotonic()
        cached = self._known.get(key_hash, now) or self._unknown.get(key_hash, now)
        if cached is not None:
            principal = cached[0]
        else:
            principal = await asyncio.to_thread(self._lookup, key_hash)
            cache = self._unknown if principal is None else self._known
            cache.put(key_hash, principal, now + self.cache_ttl_s)
        if principal is None:
            shown = key.strip()[:10] + "…" if len(key.strip()) > 10 else "…"
            raise _unauthorized(f"Incorrect API key provided: {shown}. It may have been revoked.")
        return principal

    def invalidate(self) -> None:
        """Forget every cached lookup (after a key is revoked or its limits change)."""
        self._known.clear()
        self._unknown.clear()
